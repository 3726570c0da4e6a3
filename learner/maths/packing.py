"""How a micro-batch's rows reach the model: padded ([b, T] with an attention mask) or packed (the rows'
real tokens back to back in one [1, N] sequence, positions restarting at each sample, sample boundaries
as `cu_seq_lens` for the variable-length attention of `learner.maths.attention`).

Either way the model runs over one flat list of rows and scores those marked `scored` against their `targets`;
`to_target_positions` puts the scores back into the [b, T-1] target-position layout of `learner.maths.batching`, where
the losses work: entry t of a row scores the token at t + 1. `only` narrows the scored rows to the positions a
loss reads (completion tokens): with a 151,936-token vocabulary the output head over every prompt position was
most of a step. Positions not scored hold 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


@dataclass
class ModelInputs:
    """One forward pass's inputs and how its flat rows map back to target positions."""

    input_ids: Tensor  # [1, N] packed or [b, T] padded
    position_ids: Tensor | None  # [1, N] restarting at 0 per sample (packed); None: transformers counts 0..T-1
    attention_mask: Tensor | None  # [b, T] (padded); None when packed
    targets: Tensor  # [rows] token id each flat row of hidden states predicts (a dummy where none)
    scored: Tensor  # [rows] bool: the flat row is scored (it has a real target, and one that is asked for)
    target_mask: Tensor  # [b, T-1] bool: the scored target positions (row-major order = `scored`'s rows)
    attention_kwargs: dict = field(default_factory=dict)  # cu_seq_lens_q/k, max_length_q/k (packed)

    def only(self, wanted: Tensor) -> ModelInputs:
        """The same inputs scoring only the target positions where `wanted` ([b, T-1] bool) is true."""
        scored = self.scored.clone()  # [rows]
        scored[self.scored] = wanted[self.target_mask]  # both list the scored positions in row-major order
        return replace(self, scored=scored, target_mask=self.target_mask & wanted)

    def to_target_positions(self, values: Tensor) -> Tensor:
        """[M] values of the scored rows, in row order → [b, T-1], 0 where nothing is scored (differentiable)."""
        return torch.zeros(self.target_mask.shape, dtype=values.dtype, device=values.device).masked_scatter(self.target_mask, values)


def padded_inputs(input_ids: Tensor, attention_mask: Tensor) -> ModelInputs:
    """The rows as they are, right-padded: every position is a flat row; the last column has no target."""
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # [b, T]
    scored = torch.ones_like(input_ids, dtype=torch.bool)  # [b, T]
    scored[:, -1] = False
    return ModelInputs(
        input_ids=input_ids, position_ids=None, attention_mask=attention_mask, targets=targets.reshape(-1),
        scored=scored.reshape(-1), target_mask=torch.ones_like(input_ids[:, 1:], dtype=torch.bool),
    )


def packed_inputs(input_ids: Tensor, attention_mask: Tensor) -> ModelInputs:
    """The rows' real tokens back to back (rows are right-padded, so each row's tokens are its first ones)."""
    real = attention_mask.bool()  # [b, T]
    lengths = real.sum(dim=1)  # [b]
    tokens = input_ids[real]  # [N] row after row
    starts = torch.cumsum(lengths, dim=0) - lengths  # [b] first flat index of each sample
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)  # [N]
    positions = torch.arange(len(tokens), device=tokens.device) - starts[sample]  # [N] 0.. per sample
    last = positions == lengths[sample] - 1  # [N] a sample's last token predicts nothing
    cu_seq_lens = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, dim=0)]).to(torch.int32)  # [b+1]
    targets = torch.cat([tokens[1:], tokens.new_zeros(1)])  # [N] next token (a dummy across a boundary)
    longest = int(lengths.max())
    return ModelInputs(
        input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0), attention_mask=None,
        attention_kwargs={"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                          "max_length_q": longest, "max_length_k": longest},
        targets=targets, scored=~last, target_mask=real[:, 1:],
    )
