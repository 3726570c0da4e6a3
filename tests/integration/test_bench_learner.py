"""scripts/bench_learner.py runs the learner's real train step, packed and padded, in full fine-tuning and with
LoRA, on a small shape and ends with its RESULT line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.sections import LoraConfig

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_learner.py"
BENCH_TIMEOUT_S = 180
SAMPLES, SEQ_LEN = 4, 32


def bench(*extra: str) -> dict:
    args = ["--device", "cpu", "--shape", "tiny", "--layers", "1", "--seq-len", str(SEQ_LEN), "--prompt-len", "8",
            "--batch", str(SAMPLES), "--group-size", "2", "--warmup", "1", "--steps", "2", "--threads", "1", *extra]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return json.loads(last.removeprefix("RESULT "))


def test_bench_reports_both_variants_and_no_mfu_on_cpu():
    result = bench("--sigma", "0")
    assert result["tokens_per_step"] == SAMPLES * SEQ_LEN  # full-length samples
    assert result["variant"] == "packed" and set(result["variants"]) == {"packed", "padded"}
    assert result["learner_tok_s"] == pytest.approx(result["tokens_per_step"] / result["step_s"], rel=1e-2)  # both rounded
    assert result["variants"]["padded"]["speedup"] == 1.0  # the baseline
    assert result["learner_tok_s"] > 0 and result["mfu"] is None and result["peak_memory_gib"] is None
    assert result["params"] > 0  # the FLOP count itself is checked by hand in tests/unit/test_bench_learner_flops.py


def test_long_tailed_lengths_leave_padding_out_of_the_token_count_and_a_reference_model_runs():
    result = bench("--median-tokens", "6", "--sigma", "1.0", "--variants", "packed", "--reference")
    assert SAMPLES * (8 + 1) <= result["tokens_per_step"] < SAMPLES * SEQ_LEN
    assert set(result["variants"]) == {"packed"} and result["reference"] is True


def test_lora_trains_the_adapters_alone_for_fewer_flops_than_full_fine_tuning():
    one_step = ("--variants", "packed", "--steps", "1")  # the same batch both times (the seed's)
    full, lora = bench(*one_step), bench(*one_step, "--lora")
    assert full["lora"] is None and full["trained_params"] == full["params"]
    assert lora["lora"] == LoraConfig().rank and lora["tokens_per_step"] == full["tokens_per_step"]
    # the base is the full model's, all frozen: what trains is exactly what the adapters added
    assert 0 < lora["trained_params"] == lora["params"] - full["params"]
    assert lora["tflop_per_step"] < full["tflop_per_step"]  # no weight gradients of the base (by hand: the unit test)
