"""The numbered prompt stream: after a restart it regenerates exactly the unacknowledged prompts."""

from pathlib import Path

import pytest

from asyncrl.data import PromptMixture, write_rows
from rollout_servers.prompt_stream import PromptStream

ROWS = 7  # fewer rows than drawn below, so the stream crosses an epoch (a reshuffle)
SEED = 5


@pytest.fixture
def data_file(tmp_path: Path) -> str:
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "t",
             "reward_model": {"ground_truth": str(i), "style": "rule"}} for i in range(ROWS)]
    return str(write_rows(rows, tmp_path / "train.jsonl"))


def mixture(data_file: str) -> PromptMixture:
    return PromptMixture([data_file], seed=SEED)


def first_row(rows) -> str:
    return next(rows).ground_truth


def take(stream: PromptStream, count: int) -> list[tuple[int, str]]:
    return [stream.take(first_row) for _ in range(count)]


def test_prompts_are_numbered_in_mixture_order(data_file):
    plain = mixture(data_file)
    expected = [(k, next(plain).ground_truth) for k in range(10)]
    assert take(PromptStream(mixture(data_file)), 10) == expected


def test_restart_regenerates_only_unacknowledged_prompts_then_continues(data_file, tmp_path):
    state = tmp_path / "rollout" / "server-0.json"
    expected = dict(take(PromptStream(mixture(data_file)), 12))
    before = PromptStream(mixture(data_file), state)
    drawn = take(before, 9)
    for number in (0, 1, 2, 4, 5, 8):  # 3, 6 and 7 were in flight when the process died
        before.acknowledge(number)

    after = PromptStream(mixture(data_file), state)
    assert after.owed == 3
    regenerated = take(after, 3)
    assert regenerated == [(3, expected[3]), (6, expected[6]), (7, expected[7])]
    assert [(k, row) for k, row in drawn if k in (3, 6, 7)] == regenerated, "the same prompts, not new draws"
    assert after.owed == 0
    assert take(after, 3) == [(9, expected[9]), (10, expected[10]), (11, expected[11])]
    assert sorted(path.name for path in state.parent.iterdir() if path.name.startswith(state.name)) == [state.name]


def test_a_second_restart_before_any_acknowledgement_owes_the_same(data_file, tmp_path):
    state = tmp_path / "server-0.json"
    first = PromptStream(mixture(data_file), state)
    take(first, 4)
    first.acknowledge(1)
    second = PromptStream(mixture(data_file), state)
    assert second.owed == 3
    take(second, 1)  # prompt 0 regenerated, then the process dies again
    third = PromptStream(mixture(data_file), state)
    assert third.owed == 3 and [k for k, _ in take(third, 4)] == [0, 2, 3, 4]


def test_without_a_state_file_nothing_is_owed(data_file):
    assert PromptStream(mixture(data_file)).owed == 0


def test_changed_weights_are_kept_across_a_restart(tmp_path):
    files = []
    for name in ("a", "b"):
        rows = [{"prompt": [{"role": "user", "content": f"{name}{i}"}], "data_source": name,
                 "reward_model": {"ground_truth": name, "style": "rule"}} for i in range(ROWS)]
        files.append(str(write_rows(rows, tmp_path / f"{name}.jsonl")))
    state = tmp_path / "s0.prompts.json"
    stream = PromptStream(PromptMixture(files, [0.5, 0.5], seed=SEED), state)
    stream.set_weights([0.0, 1.0])  # the learner's weights: only b from now on
    restarted = PromptStream(PromptMixture(files, [0.5, 0.5], seed=SEED), state)
    assert [answer for _, answer in take(restarted, 20)] == ["b"] * 20
