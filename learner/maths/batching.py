"""Turning trajectory groups into padded training tensors, and cutting them into micro-batches by a
token budget so that memory stays flat as response lengths vary (a packed micro-batch's rows go to the
model back to back: `learner.maths.packing`).

Positions are "target" positions: entry t of every [B, T-1] tensor describes the token at t + 1, which
the logits at position t predict. Completion token j of a sample sits at target position P + j - 1,
where P is the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.messages import Trajectory, TrajectoryGroup


@dataclass
class TrainBatch:
    input_ids: Tensor  # [B, T] prompt + completion, right-padded
    attention_mask: Tensor  # [B, T] 1 on real tokens
    loss_mask: Tensor  # [B, T-1] 1 on trained completion tokens (model tokens), 0 on prompt/env/padding
    behaviour_logprobs: Tensor  # [B, T-1] log π_behav at target positions (0 elsewhere)
    token_versions: Tensor  # [B, T-1] policy version of each target token (-1 elsewhere)
    rewards: Tensor  # [B] scalar reward per sample
    group_index: Tensor  # [B] long: samples with the same value share a prompt

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def target_width(self) -> int:
        """T - 1: the width of the per-target-position fields."""
        return self.input_ids.shape[1] - 1

    def select(self, rows: list[int]) -> "TrainBatch":
        """The given rows, cut to the longest of them: rows are right-padded, so the columns beyond hold
        padding only, and a micro-batch of short rows must not pay for the batch's longest one."""
        index = torch.tensor(rows, dtype=torch.long)
        width = int(self.attention_mask[index].sum(dim=1).max())
        picked = {name: getattr(self, name)[index] for name in _FIELDS}
        return TrainBatch(**{name: _first_columns(value, width, self.input_ids.shape[1]) for name, value in picked.items()})

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(*(getattr(self, name).to(device) for name in _FIELDS))

    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


_FIELDS = ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs", "token_versions", "rewards", "group_index")


def collate(groups: list[TrajectoryGroup], pad_id: int) -> TrainBatch:
    """One padded batch holding every sample of every group, in order."""
    samples = [(index, trajectory) for index, group in enumerate(groups) for trajectory in group.trajectories]
    width = max(len(t.prompt_ids) + len(t.completion_ids) for _, t in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(samples), width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(samples), width - 1), dtype=torch.float32)  # [B, T-1]
    behaviour = torch.zeros((len(samples), width - 1), dtype=torch.float32)  # [B, T-1]
    versions = torch.full((len(samples), width - 1), -1, dtype=torch.long)  # [B, T-1]
    for row, (_, trajectory) in enumerate(samples):
        _fill_row(row, trajectory, input_ids, attention, loss_mask, behaviour, versions)
    rewards = torch.tensor([t.reward for _, t in samples], dtype=torch.float32)  # [B]
    group_index = torch.tensor([index for index, _ in samples], dtype=torch.long)  # [B]
    return TrainBatch(input_ids, attention, loss_mask, behaviour, versions, rewards, group_index)


def micro_batches(batch: TrainBatch, token_budget: int, packed: bool = False) -> list[list[int]]:
    """Row indices per micro-batch, rows taken shortest first while the micro-batch's tokens stay within the
    budget: padded, rows × longest row; packed, the sum of the rows' lengths (a single row longer than the
    budget still forms its own micro-batch). Rows of similar length share a micro-batch, so little of a
    padded pass goes to padding when response lengths are long-tailed; the order depends on the batch's
    content only, so equal batches give equal micro-batches."""
    lengths = batch.attention_mask.sum(dim=1).tolist()  # [B]
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for row in sorted(range(len(lengths)), key=lambda r: lengths[r]):  # stable: ties keep batch order
        length = lengths[row]
        tokens = total + length if packed else (len(current) + 1) * max(longest, length)
        if current and tokens > token_budget:
            chunks.append(current)
            current, longest, total = [], 0, 0
        current.append(row)
        longest, total = max(longest, length), total + length
    if current:
        chunks.append(current)
    return chunks


def _fill_row(
    row: int,
    trajectory: Trajectory,
    input_ids: Tensor,
    attention: Tensor,
    loss_mask: Tensor,
    behaviour: Tensor,
    versions: Tensor,
) -> None:
    prompt, completion = len(trajectory.prompt_ids), len(trajectory.completion_ids)
    input_ids[row, : prompt + completion] = torch.tensor(trajectory.prompt_ids + trajectory.completion_ids)
    attention[row, : prompt + completion] = 1
    targets = slice(prompt - 1, prompt - 1 + completion)
    loss_mask[row, targets] = torch.tensor(trajectory.loss_mask, dtype=torch.float32)
    behaviour[row, targets] = torch.tensor(trajectory.behaviour_logprobs, dtype=torch.float32)
    versions[row, targets] = torch.tensor(trajectory.token_versions, dtype=torch.long)


def _first_columns(field: Tensor, width: int, full_width: int) -> Tensor:
    """A [b, T] field cut to `width` columns, a [b, T-1] one to `width` - 1; [b] fields unchanged."""
    if field.dim() == 1:
        return field
    return field[:, : width - (full_width - field.shape[1])]
