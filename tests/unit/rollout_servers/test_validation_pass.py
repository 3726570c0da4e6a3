"""Validation passes on a fake engine and scorer: what is sampled, when, and the val/* numbers."""

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from asyncrl.config import AsyncRLConfig
from asyncrl.config.rollout import SamplingConfig
from asyncrl.config.validation import ValidationConfig
from asyncrl.data import PromptRow, write_rows
from rollout_servers.rewards import RewardResult
from demo.tasks import arithmetic
from asyncrl.weight_transfer.control_messages import ValidationResult
from asyncrl.validation_scores import NOT_VALIDATED, decode_outcomes, encode_outcomes
from rollout_servers.reference_sampler import rank_share
from rollout_servers.validation import (RECENT_PASSES, VALIDATION_SEED_OFFSET, ValidationPrompt, Validator,
                                        load_validation_prompts)
from waiting import wait_until_async

N, K = 4, 2
FINAL_VERSION = 33  # the learner's last version: validated although no multiple of `every`
POLL_S = 0.01
WAIT_S = 5.0  # bound on every wait for a background pass


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """Answers prompt p correctly in the first `correct[p]` of its samples, wrongly in the rest."""

    def __init__(self, correct: dict[tuple[int, ...], tuple[str, int]], version: int = 10) -> None:
        self.correct, self.current_version, self.needs_catch_up = correct, version, False
        self.samplings: list[SamplingConfig] = []
        self.seeds: list[int | None] = []

    async def generate_group(self, prompt_ids, sampling=None, *, seed=None):
        self.samplings.append(sampling)
        self.seeds.append(seed)
        answer, right = self.correct[tuple(prompt_ids)]
        texts = [answer if index < right else "wrong" for index in range(sampling.n)]
        return [SimpleNamespace(token_ids=[ord(c) for c in text]) for text in texts]


class ExactMatchScorer:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def score_async(self, requests):
        if self.fail:
            raise RuntimeError("scorer broke")
        return [RewardResult(score=float(r.solution_str == r.ground_truth)) for r in requests]


def prompt(ids: list[int], answer: str, source: str = "arithmetic") -> ValidationPrompt:
    return ValidationPrompt(PromptRow([{"role": "user", "content": "q"}], source, answer), ids)


def make_validator(every: int = 10, seeded: bool = True, run_seed: int = 0,
                   length_buckets: tuple[int, ...] = ()) -> tuple[Validator, FakeEngine]:
    prompts = [prompt([1], "3"), prompt([2], "7"), prompt([3], "x=1", source="algebra")]
    engine = FakeEngine({(1,): ("3", 1), (2,): ("7", 2), (3,): ("x=1", 0)})
    settings = ValidationConfig(every=every, n=N, k=K, temperature=0.5, seeded=seeded, length_buckets=list(length_buckets))
    sampling = SamplingConfig(temperature=1.0, max_tokens=16, n=8)
    return Validator(settings, sampling, prompts, CharTokenizer(), run_seed), engine


def test_every_pass_samples_each_prompt_with_the_same_seeds_drawn_from_the_run_seed():
    validator, engine = make_validator(run_seed=5)
    for _ in range(2):
        asyncio.run(validator.run_pass(engine, ExactMatchScorer()))
    base = 5 + VALIDATION_SEED_OFFSET
    # prompt i's group seed is base + i * n (its samples take that + their index: no two samples share one)
    assert engine.seeds == [base, base + N, base + 2 * N] * 2
    other, other_engine = make_validator(run_seed=6)
    asyncio.run(other.run_pass(other_engine, ExactMatchScorer()))
    assert other_engine.seeds == [base + 1, base + 1 + N, base + 1 + 2 * N]  # another run.seed, other draws
    unseeded, unseeded_engine = make_validator(seeded=False)
    asyncio.run(unseeded.run_pass(unseeded_engine, ExactMatchScorer()))
    assert unseeded_engine.seeds == [None] * 3


def test_pass_samples_n_per_prompt_and_reports_hand_computed_metrics():
    validator, engine = make_validator()
    metrics = asyncio.run(validator.run_pass(engine, ExactMatchScorer()))
    assert [(s.n, s.temperature, s.max_tokens) for s in engine.samplings] == [(N, 0.5, 16)] * 3
    # correct samples per prompt: 1/4, 2/4, 0/4; pass@2 = 1 - C(n-c,2)/C(4,2) = 0.5, 5/6, 0
    assert metrics["val/score/mean"] == pytest.approx(3 / 12)
    assert metrics["val/pass@2"] == pytest.approx((0.5 + 5 / 6 + 0.0) / 3)
    assert metrics["val/arithmetic/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert metrics["val/arithmetic/score/mean"] == pytest.approx(3 / 8)
    assert metrics["val/algebra/score/mean"] == 0.0
    assert 0.0 < metrics["val/seconds"] < 60.0  # the pass was timed
    assert validator.results("server-0") == [ValidationResult("server-0", 10, metrics)]


def test_a_pass_split_among_ranks_and_pooled_through_bytes_scores_as_one_pass():
    whole, whole_engine = make_validator(run_seed=5, length_buckets=(1, 4))
    expected = asyncio.run(whole.run_pass(whole_engine, ExactMatchScorer()))
    split, engine = make_validator(run_seed=5, length_buckets=(1, 4))
    shares = [rank_share(3, rank, 2) for rank in range(2)]  # [0, 1] and [2]
    payloads = [encode_outcomes(asyncio.run(split.outcomes(engine, ExactMatchScorer(), None, share))) for share in shares]
    pooled = [outcome for payload in payloads for outcome in decode_outcomes(payload)]
    metrics = split.record(pooled, engine.current_version, 0.5)
    assert engine.seeds == whole_engine.seeds  # each prompt on its own seeds, whichever rank sampled it
    assert metrics == expected | {"val/seconds": 0.5} and split.version == 10
    with pytest.raises(msgspec.ValidationError, match="scores"):
        decode_outcomes(msgspec.msgpack.encode([{"data_source": "a", "scores": "many"}]))


def test_pass_reports_the_mean_score_per_bucket_of_response_tokens():
    validator, engine = make_validator(length_buckets=(1, 4))
    metrics = asyncio.run(validator.run_pass(engine, ExactMatchScorer()))
    # right answers "3", "7" are 1 token (3 samples), every other sample is "wrong", 5 tokens (9 samples)
    assert {name: value for name, value in metrics.items() if "/bucket/" in name} == {
        "val/score/bucket/1-1": 1.0, "val/samples/bucket/1-1": 3.0,
        "val/score/bucket/5-inf": 0.0, "val/samples/bucket/5-inf": 9.0}


def test_due_on_each_new_multiple_of_every_and_the_version_the_learner_asks_for():
    validator, engine = make_validator(every=10)
    assert validator.results("server-0") == [], "nothing to report before the first pass"
    assert not validator.is_due(FINAL_VERSION)
    validator.request(FINAL_VERSION)  # the learner's final version
    assert [v for v in range(FINAL_VERSION + 1) if validator.is_due(v)] == [0, 10, 20, 30, FINAL_VERSION]
    asyncio.run(validator.run_pass(engine, ExactMatchScorer()))  # validates version 10
    assert [v for v in range(FINAL_VERSION + 1) if validator.is_due(v)] == [20, 30, FINAL_VERSION]
    off, _ = make_validator(every=0)
    assert not any(off.is_due(v) for v in range(FINAL_VERSION + 1))


def test_each_report_repeats_the_latest_passes_oldest_first():
    validator, engine = make_validator()
    outcomes = asyncio.run(validator.outcomes(engine, ExactMatchScorer(), None, range(3)))
    for version in range(RECENT_PASSES + 2):
        validator.record(outcomes, version, seconds=float(version))
    reported = validator.results("server-0")
    assert [(r.server_id, r.version, r.metrics["val/seconds"]) for r in reported] == [
        ("server-0", version, float(version)) for version in range(2, RECENT_PASSES + 2)]  # the two oldest dropped


def test_background_task_validates_due_versions_and_survives_a_failing_pass():
    async def scenario(scorer) -> Validator:
        validator, engine = make_validator(every=5)
        validator.follow(11, 2)  # the learner one version ahead of the engine's 10
        task = asyncio.create_task(validator.run_when_due(engine, scorer, POLL_S))
        await wait_until_async(lambda: validator.version == engine.current_version, WAIT_S,
                               "the pass over the engine's version", poll_s=POLL_S)
        assert not task.done()  # still watching after the pass, failed or not
        task.cancel()
        return validator

    assert asyncio.run(scenario(ExactMatchScorer())).metrics["val/prompts"] == 3.0
    failed = asyncio.run(scenario(ExactMatchScorer(fail=True)))
    assert failed.version == 10 and failed.metrics == {}


def test_a_server_that_starts_behind_the_learner_validates_only_once_it_caught_up():
    async def scenario() -> None:
        validator, engine = make_validator(every=5)
        engine.current_version = 0  # a server (re)started on the model's first weights
        task = asyncio.create_task(validator.run_when_due(engine, ExactMatchScorer(), POLL_S))
        await asyncio.sleep(10 * POLL_S)
        assert validator.version == NOT_VALIDATED  # no admission answer yet: where the learner is, unknown
        validator.follow(10, 2)  # a resumed learner at version 10, K = 2
        await asyncio.sleep(10 * POLL_S)
        assert validator.version == NOT_VALIDATED  # version 0 is 10 behind it: not scored again
        engine.current_version = 10  # caught up
        await wait_until_async(lambda: validator.version == 10, WAIT_S, "the pass of the caught-up version",
                               poll_s=POLL_S)
        task.cancel()

    asyncio.run(scenario())
    fresh, _ = make_validator(every=5)
    fresh.follow(0, 0)
    assert fresh.near_learner(0)  # a fresh job validates its version 0
    fresh.follow(7, 2)
    assert [v for v in (4, 5, 6, 10) if fresh.near_learner(v)] == [5, 6, 10]  # within K of the learner, or ahead


def test_held_out_prompts_respect_max_prompts_and_prompt_length(tmp_path):
    from demo.tiny.tokenizer import build_char_tokenizer

    rows = [arithmetic.make_row(q, a, i, "val") for i, (q, a) in enumerate([("1+2=", "3"), ("12345+1=", "12346"), ("4+4=", "8"), ("5-1=", "4")])]
    path = write_rows(rows, tmp_path / "val.jsonl")
    tokenizer = build_char_tokenizer()
    config = AsyncRLConfig()
    config.data.val_files = [str(path)]
    short_prompt = len(tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, return_dict=False))
    config.data.max_prompt_length = short_prompt  # the 8-character question is too long
    config.validation.max_prompts = 2
    prompts = load_validation_prompts(config, tokenizer)
    assert [p.row.ground_truth for p in prompts] == ["3", "8"]
    assert all(len(p.prompt_ids) == short_prompt for p in prompts)


class FakeEpisodes:
    """Plays prompts of data source "game" as episodes whose rewards are given; records what it was asked."""

    def __init__(self, rewards: list[float]) -> None:
        self.rewards, self.calls = rewards, []

    def handles(self, data_source):
        return data_source == "game"

    async def run_group(self, row, sampling, seed, group_id):
        self.calls.append((row.ground_truth, sampling.n, seed, group_id))
        return [SimpleNamespace(reward=reward, reward_info={"solved": float(reward == 1.0)}, loss_mask=[1, 0, 1] * (i + 1))
                for i, reward in enumerate(self.rewards)]


def test_multi_turn_prompts_are_validated_as_episodes_with_their_environment_rewards():
    prompts = [prompt([1], "3"), prompt([9], "7", source="game")]
    engine = FakeEngine({(1,): ("3", 2)})
    settings = ValidationConfig(every=10, n=N, k=K, temperature=0.5, length_buckets=[2, 4])
    validator = Validator(settings, SamplingConfig(n=8), prompts, CharTokenizer())
    episodes = FakeEpisodes([1.0, 0.5, 0.0, 1.0])
    metrics = asyncio.run(validator.run_pass(engine, ExactMatchScorer(), episodes))
    # the episodes of held-out prompt 1 are seeded like a single-turn prompt's group (their turns from there)
    assert episodes.calls == [("7", N, VALIDATION_SEED_OFFSET + N, "validation")] and engine.seeds == [VALIDATION_SEED_OFFSET]
    assert len(engine.samplings) == 1  # only the single-turn prompt went to the engine directly
    assert metrics["val/game/score/mean"] == pytest.approx(2.5 / 4)
    assert metrics["val/arithmetic/score/mean"] == pytest.approx(2 / 4)
    assert metrics["val/game/pass@2"] == pytest.approx(1 - 1 / 6)  # 2 of 4 reach a reward of 1
    assert metrics["val/game/solved/mean"] == pytest.approx(2 / 4)  # the environments' reward info, per task
    # an episode's response length counts its model tokens (loss mask 1): 2, 4, 6, 8; the answers "3" take 1 token
    assert metrics["val/score/bucket/1-2"] == pytest.approx((1.0 + 1.0 + 1.0) / 3)  # episode 1 and the two "3"s
    assert metrics["val/score/bucket/3-4"] == 0.5 and metrics["val/samples/bucket/5-inf"] == 4.0  # 2 "wrong", 2 episodes
