"""Splitting a batch into the mini-batches of its optimizer steps (`algorithm.mini_batches`), by whole groups:
the samples of one prompt always train in the same step, so group-relative advantages computed once over the
batch are the ones each step would compute over its own groups."""

from __future__ import annotations

from torch import Tensor

from learner.maths.advantages import as_group_index


def mini_batch_rows(group_index: Tensor, count: int) -> list[list[int]]:
    """Batch rows of each of `count` mini-batches: the groups in order of first appearance, cut into `count`
    consecutive runs whose sizes differ by one group at most, each run's rows in batch order."""
    groups = as_group_index(group_index)  # [B] 0, 1, ... in order of first appearance
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    if count > num_groups:
        raise ValueError(f"algorithm.mini_batches={count}: the batch holds {num_groups} groups and a mini-batch "
                         "needs at least one (buffer.batch_groups sets the groups per batch)")
    mini_of_group = [(group * count) // num_groups for group in range(num_groups)]
    rows: list[list[int]] = [[] for _ in range(count)]
    for row, group in enumerate(groups.tolist()):
        rows[mini_of_group[group]].append(row)
    return rows
