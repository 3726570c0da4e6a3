"""A batch whose loss is NaN or infinite is skipped (weights, optimizer and step counter untouched), a good
batch after it trains, and learner.max_bad_steps bad batches in a row stop the run (TooManyBadSteps)."""

import math
from dataclasses import dataclass

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.messages import Batch
from learner.bad_steps import TooManyBadSteps
from learner.loop_state import LoopState
from learner.policy.policy_model import load_policy
from learner_helpers import gathered_weights, random_groups, save_tiny_model, single_rank_world
from offline_learner import OfflineConnections, run_offline

pytestmark = pytest.mark.slow

MAX_BAD_STEPS = 3
BAD_BATCHES = {
    "nan_behaviour_logprob": dict(behaviour_logprob=math.nan),  # NaN importance weight → NaN loss
    "inf_reward": dict(reward=math.inf),  # group mean inf, advantage inf - inf = NaN
}


def batch_of(groups, first_offset: int) -> Batch:
    offsets = list(range(first_offset, first_offset + len(groups)))
    return Batch(groups=groups, offsets=offsets, next_offset=offsets[-1] + 1)


class ScriptedBuffer:
    """fetch_batch that hands out the given batches in order and records the version each was asked for,
    with the weights the model held at that moment."""

    def __init__(self, model, batches: list[Batch]) -> None:
        self.model, self.batches = model, batches
        self.versions: list[int] = []
        self.weights_seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, version: int, max_staleness: int) -> Batch:
        self.versions.append(version)
        self.weights_seen.append({k: v.clone() for k, v in gathered_weights(self.model).items()})
        return self.batches[len(self.versions) - 1]


@dataclass
class Trained:
    state: LoopState
    buffer: ScriptedBuffer
    initial: dict[str, torch.Tensor]  # weights before run_loop
    final: dict[str, torch.Tensor]  # weights after it
    logged: list[int]  # versions whose record rank 0 logged
    optimizer_entries: int  # parameters with AdamW state (0 = the optimizer never stepped)
    error: TooManyBadSteps | None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def train_on(model_dir, run_dir, batches: list[Batch], total_steps: int) -> Trained:
    config = load_config(overrides=[
        f"learner.total_steps={total_steps}", f"learner.max_bad_steps={MAX_BAD_STEPS}", "learner.lr=0.01",
        "learner.device=cpu", f"model.path={model_dir}",
    ])
    with single_rank_world() as world:
        model = load_policy(str(model_dir), "float32", config.learner, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learner.lr)
        initial = {k: v.clone() for k, v in gathered_weights(model).items()}
        buffer = ScriptedBuffer(model, batches)
        connections = OfflineConnections(buffer)
        state = LoopState()
        error = None
        try:
            run_offline(config, run_dir, world, model, optimizer, state, connections)
        except TooManyBadSteps as raised:
            error = raised
        logged = [version for version, _ in connections.records]
        return Trained(state, buffer, initial, gathered_weights(model), logged, len(optimizer.state), error)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("bad", sorted(BAD_BATCHES))
def test_bad_step_is_skipped_and_next_good_batch_trains(model_dir, tmp_path, bad):
    batches = [batch_of(random_groups(1, **BAD_BATCHES[bad]), 0), batch_of(random_groups(2), 2)]
    run = train_on(model_dir, tmp_path, batches, total_steps=1)
    assert run.error is None
    assert run.buffer.versions == [0, 0]  # the bad step did not advance the policy version
    assert_same_weights(run.buffer.weights_seen[1], run.initial)  # ...nor touch the weights
    assert run.state.step == 1 and run.state.bad_steps == 0 and run.logged == [1]
    assert run.state.buffer_offset == 4  # the good batch's next_offset: the skipped one is not re-read either
    moved = sum(not torch.equal(run.final[k], run.initial[k]) for k in run.initial)
    assert moved > len(run.initial) // 2  # the good batch really trained
    assert run.optimizer_entries > 0


@pytest.mark.parametrize("bad", sorted(BAD_BATCHES))
def test_max_bad_steps_in_a_row_stop_the_run(model_dir, tmp_path, bad):
    batches = [batch_of(random_groups(seed, **BAD_BATCHES[bad]), 2 * seed) for seed in range(MAX_BAD_STEPS + 1)]
    run = train_on(model_dir, tmp_path, batches, total_steps=5)
    assert isinstance(run.error, TooManyBadSteps)
    assert len(run.buffer.versions) == MAX_BAD_STEPS and set(run.buffer.versions) == {0}
    assert run.state.step == 0 and run.state.bad_steps == MAX_BAD_STEPS and run.logged == []
    assert run.optimizer_entries == 0  # AdamW never stepped: no moment buffers were even created
    assert_same_weights(run.final, run.initial)
