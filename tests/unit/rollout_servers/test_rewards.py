"""Rewards: verl reward functions, built-in scorers by data_source, and the worker pool's failure handling."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from asyncrl.config.sections import CustomRewardConfig, RewardConfig
from rollout_servers.rewards import (
    RewardFunctionError,
    RewardRequest,
    RewardResult,
    RewardScorer,
    UnknownDataSourceError,
    WorkerStartError,
    check_reward_setup,
    compute_score,
    load_reward_function,
)
from rollout_servers.rewards.builtin import check_data_sources
from rollout_servers.rewards.results import result_from_return
from demo.tasks import arithmetic
from tests.fixture_files import FIXTURES

REWARD_FILE = FIXTURES / "reward_functions.py"
TIMEOUT_S = 1.0  # per-call deadline of the misbehaving scorer
SLACK_S = 2.0  # what a loaded 2-core machine may add to a deadline (kill, wake-up, scheduling)
NUM_WORKERS = 2
REPLACEMENT_WAIT_S = 20.0  # a replacement worker is spawned and imports sympy: seconds, not minutes
TEST_TIMEOUT_S = 60  # no test may hang the suite, whatever the pool does

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)


def custom_config(name: str, timeout_s: float = TIMEOUT_S, path: Path | str = REWARD_FILE) -> RewardConfig:
    return RewardConfig(
        custom_fn=CustomRewardConfig(path=str(path), name=name), timeout_s=timeout_s, num_workers=NUM_WORKERS
    )


def request(solution: str, ground_truth: str = "42", data_source: str = "test", **extra_info) -> RewardRequest:
    return RewardRequest(data_source, solution, ground_truth, extra_info or None)


@pytest.fixture(scope="module")
def builtin_scorer():
    with RewardScorer(RewardConfig(num_workers=NUM_WORKERS)) as scorer:
        yield scorer


@pytest.fixture(scope="module")
def misbehaving_scorer():
    with RewardScorer(custom_config("misbehaving_reward")) as scorer:
        yield scorer


# ----------------------------------------------------------------------------------------------
# What a reward function returns


@pytest.mark.parametrize("returned, score", [(1.0, 1.0), (0, 0.0), (True, 1.0), (np.float32(0.5), 0.5)])
def test_a_number_is_the_score(returned, score):
    assert result_from_return(returned) == RewardResult(score=score)


def test_a_dict_gives_its_score_and_its_other_numbers_as_info():
    result = result_from_return({"score": np.float64(0.25), "acc": True, "length": 7, "pred": "x = 2"})
    assert result == RewardResult(score=0.25, info={"acc": 1.0, "length": 7.0})


@pytest.mark.parametrize(
    "returned, error",
    [
        ({"acc": 1.0}, "without 'score'"),
        ("1.0", "str score"),
        (None, "NoneType score"),
        ({"score": "high"}, "str score"),
        (float("nan"), "non-finite"),
        (math.inf, "non-finite"),
    ],
)
def test_anything_else_is_a_failure_with_score_zero(returned, error):
    result = result_from_return(returned)
    assert result.failed and error in result.error and result.score == 0.0


# ----------------------------------------------------------------------------------------------
# Loading custom functions: every problem named at startup


def test_loads_a_verl_function_and_calls_it_with_verl_keywords():
    function = load_reward_function(REWARD_FILE, "float_reward")
    assert function(data_source="d", solution_str="7", ground_truth="7", extra_info={}) == 1.0
    assert load_reward_function(REWARD_FILE, "keyword_reward")  # keyword-only with **kwargs is verl-callable


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nowhere.py"
    with pytest.raises(RewardFunctionError, match=r"reward\.custom_fn\.path.*nowhere\.py.*does not exist"):
        load_reward_function(missing, "compute_score")


def test_missing_function_is_named_with_the_file_and_what_it_defines():
    with pytest.raises(RewardFunctionError, match=r"reward_functions\.py' defines no 'compute_score'") as raised:
        load_reward_function(REWARD_FILE, "compute_score")
    assert "float_reward" in str(raised.value)


@pytest.mark.parametrize(
    "name, problem",
    [
        ("two_argument_reward", r"'two_argument_reward' .* has signature \(solution_str, ground_truth\); expected"),
        ("NOT_A_FUNCTION", r"'NOT_A_FUNCTION' .* is a int, not a function"),
        ("async_reward", r"'async_reward' .* is async"),
    ],
)
def test_unusable_function_is_named(name, problem):
    with pytest.raises(RewardFunctionError, match=problem):
        load_reward_function(REWARD_FILE, name)


def test_file_that_fails_to_import_is_named_with_its_error():
    with pytest.raises(RewardFunctionError, match=r"importing '.*broken_reward\.py' failed: ImportError: this reward"):
        load_reward_function(FIXTURES / "broken_reward.py", "compute_score")


def test_scorer_fails_at_startup_on_a_bad_function(tmp_path):
    with pytest.raises(RewardFunctionError, match="nowhere.py"):
        RewardScorer(custom_config("compute_score", path=tmp_path / "nowhere.py"))


# ----------------------------------------------------------------------------------------------
# Built-in scorers


@pytest.mark.parametrize(
    "data_source, solution, answer, score",
    [
        ("arithmetic", "95", "95", 1.0),  # exact match
        ("arithmetic", " 95\n", "95", 1.0),
        ("arithmetic", "-13", "-13", 1.0),
        ("arithmetic", "96", "95", 0.0),
        ("arithmetic", "095", "95", 0.0),
        ("arithmetic", "", "95", 0.0),
        ("scratchpad", "5+7:5+7+0=12:2\n=12", "12", 1.0),  # the final answer line
        ("scratchpad", "5+7:5+7+0=13:3\n=12", "12", 1.0),  # the working is not scored, only the answer line
        ("scratchpad", "=12\n", "12", 1.0),
        ("scratchpad", "5+7:5+7+0=12:2\n=13", "12", 0.0),
        ("scratchpad", "5+7:5+7+0=12:2\n12", "12", 0.0),  # no final-answer mark
        ("scratchpad", "=12\n5+7:5+7+0=12:2", "12", 0.0),  # the answer must be the last line
        ("scratchpad", "5+7:5+7+0=12:2\n=120", "12", 0.0),
        ("scratchpad", "", "12", 0.0),
    ],
)
def test_arithmetic_is_exact_match_and_scratchpad_scores_its_final_answer_line(data_source, solution, answer, score):
    assert compute_score(data_source, solution, answer) == score


@pytest.mark.parametrize(
    "data_source, solution, answer, score",
    [
        ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("openai/gsm8k", "The answer is $2$", "2", 1.0),
        ("openai/gsm8k", "so she has \\boxed{72} left", "72", 1.0),
        ("math_dapo", "The answer is $\\frac{3}{4}$.", "\\frac34", 1.0),
        ("DigitalLearningGmbH/MATH-lighteval", "We get \\boxed{x^2+1}", "1+x^2", 1.0),
        ("math", "The answer is $3$", "2", 0.0),
        ("math", "I do not know", "2", 0.0),
        ("my-org/GSM8K-hard", "\\boxed{7}", "$7$", 1.0),  # found by keyword, ground truth already LaTeX
    ],
)
def test_math_answers_are_checked_by_value(data_source, solution, answer, score):
    assert compute_score(data_source, solution, answer) == score


def test_a_request_is_built_from_a_verl_row():
    row = arithmetic.make_row("37+58=", "95", index=3, split="train")
    assert RewardRequest.for_row(row, "95") == RewardRequest("arithmetic", "95", "95", {"index": 3, "split": "train"})


def test_unparsable_math_ground_truth_raises_rather_than_scoring_zero():
    with pytest.raises(ValueError, match="ground truth"):
        compute_score("math", "\\boxed{1}", "")


def test_unknown_data_source_is_named():
    with pytest.raises(UnknownDataSourceError, match="'trivia'.*reward.custom_fn.path"):
        compute_score("trivia", "Paris", "Paris")
    with pytest.raises(UnknownDataSourceError, match="'trivia'"):
        check_data_sources(["arithmetic", "openai/gsm8k", "trivia"])
    check_data_sources(["arithmetic", "openai/gsm8k", "lighteval/MATH"])


def test_builtin_scorer_scores_a_mixed_batch_and_records_unknown_sources(builtin_scorer):
    results = builtin_scorer.score(
        [
            request("95", "95", "arithmetic"),
            request("\\boxed{\\frac{1}{2}}", "0.5", "lighteval/MATH"),
            request("Paris", "Paris", "trivia"),
            request("The answer is $3$", "2", "openai/gsm8k"),
        ]
    )
    assert [result.score for result in results] == [1.0, 1.0, 0.0, 0.0]
    assert results[2].error.startswith("UnknownDataSourceError: no built-in scorer for data_source 'trivia'")
    assert not (results[0].error or results[1].error or results[3].error)
    with pytest.raises(UnknownDataSourceError):
        check_reward_setup(RewardConfig(), ["arithmetic", "trivia"])
    check_reward_setup(RewardConfig(), ["arithmetic", "openai/gsm8k"])


# ----------------------------------------------------------------------------------------------
# Custom functions in the worker pool


def test_float_and_dict_returns_through_the_pool():
    with RewardScorer(custom_config("dict_reward")) as scorer:
        right, wrong = scorer.score([request("42", weight=0.5), request("41")])
    assert right == RewardResult(score=2.0, info={"acc": 1.0, "length": 2.0, "weight": 0.5})
    assert wrong == RewardResult(score=-1.0, info={"acc": 0.0, "length": 2.0, "weight": 0.0})


def test_a_custom_function_takes_every_data_source(misbehaving_scorer):
    check_reward_setup(custom_config("misbehaving_reward"), ["trivia"])
    assert misbehaving_scorer.score([request("42", data_source="trivia")]) == [RewardResult(score=1.0)]


def test_failures_are_recorded_per_sample_and_the_rest_is_scored(misbehaving_scorer):
    results = misbehaving_scorer.score([request("raise"), request("42"), request("nan"), request("text"), request("7")])
    assert results[0] == RewardResult.failure("ValueError: cannot score this sample")
    assert results[1] == RewardResult(score=1.0)
    assert "non-finite" in results[2].error and "str score" in results[3].error
    assert results[4] == RewardResult(score=0.0)


def test_a_request_that_cannot_reach_a_worker_fails_alone(misbehaving_scorer):
    unsendable, right = misbehaving_scorer.score([request("42", callback=lambda: None), request("42")])
    assert unsendable.error.startswith("request cannot be sent to a worker:") and unsendable.score == 0.0
    assert right == RewardResult(score=1.0)


def test_a_hung_call_times_out_and_its_batch_is_still_scored(misbehaving_scorer):
    started = time.monotonic()
    hung, right, raised = misbehaving_scorer.score([request("hang"), request("42"), request("raise")])
    elapsed = time.monotonic() - started
    assert hung == RewardResult.failure(f"timeout after {TIMEOUT_S:g}s")
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S
    assert right == RewardResult(score=1.0) and raised.error.startswith("ValueError")


def test_a_dead_worker_is_a_failure_not_a_crash(misbehaving_scorer):
    died, right = misbehaving_scorer.score([request("die"), request("42")])
    assert died.failed and "reward worker died (exit code 3)" in died.error
    assert right == RewardResult(score=1.0)


def test_killed_workers_are_replaced_so_the_pool_keeps_its_capacity(misbehaving_scorer):
    before = workers_running_in_parallel(misbehaving_scorer)
    assert misbehaving_scorer.score([request("hang")])[0].error.startswith("timeout")
    after = workers_running_in_parallel(misbehaving_scorer)
    assert len(after) == NUM_WORKERS and after != before  # two processes again, one of them new


def test_stop_signals_to_the_process_group_leave_the_workers_to_the_pool(misbehaving_scorer):
    before = workers_running_in_parallel(misbehaving_scorer)
    for pid in before:  # what Ctrl-C, or `asyncrl run` stopping the rollout role, sends to every process
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
    assert workers_running_in_parallel(misbehaving_scorer) == before  # none died, none was replaced


def workers_running_in_parallel(scorer: RewardScorer) -> set[int]:
    """Ids of the processes that ran NUM_WORKERS slow calls at once, once every worker is ready."""
    deadline = time.monotonic() + REPLACEMENT_WAIT_S
    while time.monotonic() < deadline:
        pids = {int(result.info["pid"]) for result in scorer.score([request("slow")] * NUM_WORKERS)}
        if len(pids) == NUM_WORKERS:
            return pids
    pytest.fail(f"the pool did not run {NUM_WORKERS} calls in parallel within {REPLACEMENT_WAIT_S}s")


def test_score_async_leaves_the_event_loop_free(misbehaving_scorer):
    async def score_while_ticking() -> tuple[list[RewardResult], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)  # the behaviour under test: a tick every 10 ms while the loop is free

        ticker = asyncio.create_task(tick())
        results = await misbehaving_scorer.score_async([request("slow"), request("42")])
        ticker.cancel()
        return results, ticks

    results, ticks = asyncio.run(score_while_ticking())
    assert [result.score for result in results] == [1.0, 1.0]
    assert ticks > 10  # the loop kept running for most of the half-second call


def test_closing_fails_queued_requests_and_refuses_new_ones():
    hang_timeout_s = 30.0
    scorer = RewardScorer(custom_config("misbehaving_reward", timeout_s=hang_timeout_s))
    futures = [scorer.submit(request("hang")) for _ in range(NUM_WORKERS + 1)]
    started = time.monotonic()
    scorer.close()
    scorer.close()
    # a close that waited for the hanging calls would take their 30 s timeout; stopping the workers takes well under
    # half of it even on a loaded 2-core box (2 s was too tight there: the workers' kill and join ran past it)
    assert time.monotonic() - started < hang_timeout_s / 2
    closed = RewardResult.failure("the reward scoring pool is closed")
    assert all(future.result(timeout=0) == closed for future in futures)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(request("42"))


def breaking_once_loaded(tmp_path: Path, monkeypatch) -> Path:
    """A reward file the parent loads fine, which then changes under the workers' feet (they cannot load it)."""
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    import rollout_servers.rewards.scorer as scorer_module
    from rollout_servers.rewards.terms import load_reward

    def load_then_break(spec):
        function = load_reward(spec)
        reward_file.write_text("raise RuntimeError('gone')\n")
        return function

    monkeypatch.setattr(scorer_module, "load_reward", load_then_break)
    return reward_file


def test_a_function_that_cannot_load_in_the_worker_fails_startup(tmp_path, monkeypatch):
    reward_file = breaking_once_loaded(tmp_path, monkeypatch)
    with pytest.raises(WorkerStartError, match="could not load the reward function.*RuntimeError: gone"):
        RewardScorer(custom_config("compute_score", path=reward_file))


def test_when_no_worker_can_be_replaced_requests_fail_instead_of_waiting(tmp_path):
    reward_file = tmp_path / "hanging_reward.py"
    reward_file.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    time.sleep(60)\n"  # a call that hangs past the pool's timeout
    )
    config = RewardConfig(custom_fn=CustomRewardConfig(path=str(reward_file)), timeout_s=TIMEOUT_S, num_workers=1)
    with RewardScorer(config) as scorer:
        reward_file.write_text("raise RuntimeError('gone')\n")  # the replacement worker cannot load it
        hung = scorer.submit(request("hang"))
        assert hung.result(timeout=TIMEOUT_S + SLACK_S).error == f"timeout after {TIMEOUT_S:g}s"
        stranded = scorer.submit(request("42"))
        assert "no reward workers left: RewardFunctionError" in stranded.result(timeout=REPLACEMENT_WAIT_S).error


# ----------------------------------------------------------------------------------------------
# Workers spawned first, waited for later (a server's engine starts in between)

def _workers(scorer: RewardScorer) -> set[int]:
    """The pids of the scorer's worker processes (this module's other scorers spawn replacements of their own)."""
    return {worker.process.pid for worker in scorer._pool._workers}


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}


def test_requests_wait_for_workers_spawned_without_waiting_and_are_scored_once_they_are_ready():
    scorer = RewardScorer(custom_config("misbehaving_reward"), wait_ready=False)
    try:
        assert len(_alive(_workers(scorer))) == NUM_WORKERS  # spawned, importing
        queued = scorer.submit(request("42"))
        assert not queued.done()  # no dispatcher runs before the workers are waited for
        scorer.wait_ready()
        scorer.wait_ready()  # once is enough: a second call changes nothing
        assert queued.result(timeout=REPLACEMENT_WAIT_S).score == 1.0
        assert scorer.score([request("41"), request("42")])[1].score == 1.0
    finally:
        scorer.close()


def test_a_function_that_cannot_load_in_the_worker_fails_the_wait_and_the_queue(tmp_path, monkeypatch):
    reward_file = breaking_once_loaded(tmp_path, monkeypatch)
    scorer = RewardScorer(custom_config("compute_score", path=reward_file), wait_ready=False)  # no error yet
    spawned = _workers(scorer)
    queued = scorer.submit(request("42"))
    with pytest.raises(WorkerStartError, match="could not load the reward function.*RuntimeError: gone"):
        scorer.wait_ready()
    assert queued.result(timeout=0) == RewardResult.failure("the reward scoring pool is closed")
    assert spawned and not _alive(spawned)
    scorer.close()  # after a failed wait: nothing left to close, and no error


def test_closing_a_pool_never_waited_for_stops_its_workers_and_fails_its_queue():
    scorer = RewardScorer(custom_config("misbehaving_reward"), wait_ready=False)
    spawned = _workers(scorer)
    queued = scorer.submit(request("42"))
    scorer.close()
    scorer.close()
    assert queued.result(timeout=0) == RewardResult.failure("the reward scoring pool is closed")
    assert spawned and not _alive(spawned)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(request("42"))
