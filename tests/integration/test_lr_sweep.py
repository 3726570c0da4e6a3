"""The learning-rate sweep at CPU size (scripts/lr_sweep.py, the script itself): the synchronous run at two rates side
by side from one model, then one `asyncrl evaluate` over both. Every due version of each is scored (and its weights
deleted); the shared start
scores the same in both; at rate 0 the weights never move, so every version scores exactly what version 0 does; at a
rate that learns, the score rises, and that rate is the one the sweep names.

The reward is the response's length (tests/fixtures/length_reward.py), as in the race's test: a barely trained model
learns it in a few steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from run_helpers import RUN_TIMEOUT_S, learning_script_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS, VAL_EVERY = 4, 2
DUE = [0, 2, 4]
SCRIPT = Path(__file__).parents[2] / "scripts" / "lr_sweep.py"


def sweep_job(inputs: Path, own_dir: Path) -> tuple[dict, str, dict, str, list[str]]:
    """The sweep over rates 0 and 0.01 on the shared tiny model, in `own_dir`, then the same command again: each
    time its RESULT and its console output; then the snapshot weights left."""
    command = [sys.executable, str(SCRIPT), "--config", "configs/quickstart.yaml", "--lrs", "0,0.01", "--steps",
               str(STEPS), "--val-every", str(VAL_EVERY), "--out-dir", str(own_dir / "sweep"),
               *learning_script_job(inputs, STEPS)]  # its learner.lr comes before each rate's, which wins
    outcomes = []
    for _ in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=3 * RUN_TIMEOUT_S, cwd=SCRIPT.parents[1])
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
        outcomes += [json.loads(result[len("RESULT "):]), done.stdout]
    return (*outcomes, sorted(path.name for path in (own_dir / "sweep").rglob("*.pt")))


REAL_JOBS = [sweep_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def sweep(real_jobs) -> tuple[dict, str, dict, str, list[str]]:
    return real_jobs[sweep_job].result()


def test_every_due_version_of_every_rate_is_scored_and_the_start_scores_the_same(sweep):
    result, _, _, _, weights_left = sweep
    still, learning = (result["rates"][rate]["curve"] for rate in ("0", "0.01"))
    assert [v for v, _ in still] == DUE and [v for v, _ in learning] == DUE
    assert still[0][1] == learning[0][1]  # version 0: the same model, prompts and seeds
    assert weights_left == []  # each snapshot's weights deleted once scored


def test_rate_zero_keeps_its_score_and_the_rate_that_learns_is_named(sweep):
    result, stdout, _, _, _ = sweep
    still, learning = result["rates"]["0"], result["rates"]["0.01"]
    assert [score for _, score in still["curve"]] == [still["curve"][0][1]] * len(DUE)  # the weights never moved
    assert still["rise"] == 0 and learning["rise"] > 0
    assert learning["final"] == learning["curve"][-1][1] and learning["best"] >= learning["final"]
    assert result["highest_final"] == "0.01"
    assert "lr 0.01" in stdout and "highest final score: lr 0.01" in stdout


def test_the_same_sweep_again_runs_nothing_and_reports_the_same(sweep):
    first, _, again, stdout, _ = sweep
    assert "lr 0: run finished before" in stdout and "lr 0.01: run finished before" in stdout
    assert "trained" not in stdout
    assert again == first
