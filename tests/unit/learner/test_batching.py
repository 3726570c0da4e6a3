"""Collation puts every per-token field at the target position that predicts the token."""

import torch

from asyncrl.messages import Trajectory, TrajectoryGroup
from learner.maths.batching import collate, micro_batches


def trajectory(prompt, completion, logprobs, versions, mask, reward=1.0, group="g"):
    return Trajectory(prompt, completion, logprobs, versions, mask, reward, group, "arithmetic", "stop")


def test_fields_align_with_target_positions():
    a = trajectory([7, 8, 9], [4, 5], [-0.5, -0.25], [3, 4], [1, 1], reward=1.0, group="a")
    b = trajectory([7], [6, 6, 6], [-1.0, 0.0, -2.0], [2, -1, 2], [1, 0, 1], reward=0.0, group="b")
    batch = collate([TrajectoryGroup("r1", "a", "s", [a]), TrajectoryGroup("r2", "b", "s", [b])], pad_id=0)
    assert batch.input_ids.tolist() == [[7, 8, 9, 4, 5], [7, 6, 6, 6, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # row a: completion token 4 is predicted at position 2 (the last prompt token), 5 at position 3
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 0]]
    assert batch.behaviour_logprobs.tolist() == [[0, 0, -0.5, -0.25], [-1.0, 0.0, -2.0, 0.0]]
    assert batch.token_versions.tolist() == [[-1, -1, 3, 4], [2, -1, 2, -1]]
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.group_index.tolist() == [0, 1]
    targets = batch.input_ids[:, 1:]
    assert targets[0, 2].item() == 4 and targets[1, 0].item() == 6


def test_micro_batches_respect_the_token_budget():
    rows = [trajectory([1] * n, [2], [0.0], [0], [1]) for n in (3, 3, 3, 9, 1)]
    batch = collate([TrajectoryGroup("r", "g", "s", rows)], pad_id=0)
    lengths = batch.attention_mask.sum(1).tolist()
    assert lengths == [4, 4, 4, 10, 2]
    chunks = micro_batches(batch, token_budget=12)
    assert chunks == [[4, 0, 1], [2], [3]]  # shortest first; ties in batch order
    for chunk in chunks:
        assert len(chunk) == 1 or len(chunk) * max(lengths[i] for i in chunk) <= 12
    assert sorted(i for chunk in chunks for i in chunk) == list(range(5))
    assert micro_batches(batch, token_budget=1) == [[4], [0], [1], [2], [3]]
    assert torch.equal(batch.select([3]).input_ids[0, :10], torch.tensor([1] * 9 + [2]))


def test_selected_rows_are_cut_to_their_longest_row():
    rows = [trajectory([1] * n, [2, 3], [-0.5, -0.25], [0, 1], [1, 1]) for n in (1, 8, 2)]
    batch = collate([TrajectoryGroup("r", "g", "s", rows)], pad_id=0)
    assert batch.input_ids.shape == (3, 10)
    short = batch.select([2, 0])
    assert short.input_ids.tolist() == [[1, 1, 2, 3], [1, 2, 3, 0]]
    assert short.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert short.target_width == 3
    for name in ("loss_mask", "behaviour_logprobs", "token_versions"):
        assert getattr(short, name).shape == (2, 3)
        assert torch.equal(getattr(short, name), getattr(batch, name)[[2, 0], :3])
    assert short.behaviour_logprobs.tolist() == [[0.0, -0.5, -0.25], [-0.5, -0.25, 0.0]]
    assert short.rewards.shape == (2,) and short.group_index.tolist() == [0, 0]
    assert batch.select([1]).input_ids.shape == (1, 10)


def test_packed_micro_batches_count_real_tokens_not_padding():
    rows = [trajectory([1] * n, [2], [0.0], [0], [1]) for n in (3, 3, 3, 9, 1)]
    batch = collate([TrajectoryGroup("r", "g", "s", rows)], pad_id=0)
    lengths = batch.attention_mask.sum(1).tolist()  # [4, 4, 4, 10, 2]
    chunks = micro_batches(batch, token_budget=12, packed=True)
    assert chunks == [[4, 0, 1], [2], [3]]  # 2+4+4 = 10; adding 4 would make 14
    assert micro_batches(batch, token_budget=14, packed=True) == [[4, 0, 1, 2], [3]]  # padded: 4 rows x 4 = 16 > 14
    assert micro_batches(batch, token_budget=14) == [[4, 0, 1], [2], [3]]
    for chunk in chunks:
        assert len(chunk) == 1 or sum(lengths[i] for i in chunk) <= 12
