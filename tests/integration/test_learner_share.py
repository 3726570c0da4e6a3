"""The learner-share benchmark end to end at CPU size (scripts/bench_learner_share.py): for the config and one
candidate (more layers, half the prompts a step), a random model of each shape, the task's rows capped at the
teacher's response lengths, the product's synchronous job on them, and its figures. The job exiting 0 means the script
found every trained sample as long as its cap (it exits otherwise); the tokens a step follow from those lengths."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run_helpers import RUN_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BENCH = Path(__file__).parents[2] / "scripts" / "bench_learner_share.py"
STEPS = 3
SHAPE = ["model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.num_layers=2",
         "model.tiny.intermediate_size=128"]
CANDIDATE = "model.tiny.num_layers=4 buffer.batch_groups=8"


def share_job(inputs: Path, own_dir: Path) -> dict:
    """The benchmark on the quickstart task (2-digit sums: 3 or 4 response tokens with the end marker); its RESULT."""
    overrides = [*SHAPE, "task.num_train=300", "learner.torch_threads=1", "rollout.engine.cpu_threads=1"]
    done = subprocess.run([sys.executable, str(BENCH), "--config", "configs/quickstart.yaml", "--steps", str(STEPS),
                           "--skip", "1", "--candidate", CANDIDATE, "--work-dir", str(own_dir), *overrides],
                          capture_output=True, text=True, timeout=2 * RUN_TIMEOUT_S, cwd=BENCH.parents[1])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(result[len("RESULT "):])


REAL_JOBS = [share_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def result(real_jobs) -> dict:
    return real_jobs[share_job].result()


def test_each_candidate_is_measured_on_its_own_shape_and_batch(result):
    config, candidate = result["candidates"]
    assert config["overrides"] == [] and candidate["overrides"] == CANDIDATE.split()
    assert (config["prompts"], candidate["prompts"]) == (16, 8) and config["samples_per_prompt"] == 8
    assert candidate["params"] > config["params"]  # two more layers
    assert config["steps_timed"] == candidate["steps_timed"] == STEPS - 1


def test_a_step_trains_the_task_s_response_lengths_and_the_share_is_training_s_part_of_it(result):
    for figures in result["candidates"]:
        per_sample = figures["tokens_per_step"] / (figures["prompts"] * figures["samples_per_prompt"])
        assert 3 <= per_sample <= 4  # a 2- or 3-digit sum and the end marker, whatever random weights sample
        assert 0 < figures["learner_share"] < 1
        assert figures["trained_tokens_per_s"] > 0
