"""scripts/bench_learner.py runs the learner's real train step on a tiny shape and ends with its RESULT line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_learner.py"
BENCH_TIMEOUT_S = 180
SAMPLES, SEQ_LEN = 4, 32


def test_bench_reports_tokens_per_second_and_no_mfu_on_cpu():
    args = ["--device", "cpu", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
            "--seq-len", str(SEQ_LEN), "--prompt-len", "8", "--batch", str(SAMPLES), "--group-size", "2",
            "--warmup", "1", "--steps", "2"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last.removeprefix("RESULT "))
    assert result["tokens_per_step"] == SAMPLES * SEQ_LEN  # full-length samples: no padding counted
    assert result["learner_tok_s"] == pytest.approx(result["tokens_per_step"] / result["step_s"], rel=1e-2)  # both rounded
    assert result["learner_tok_s"] > 0 and result["mfu"] is None and result["peak_memory_gib"] is None
