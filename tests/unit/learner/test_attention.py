"""The learner's attention: causal within each packed sample, the same as sdpa on that sample alone."""

from __future__ import annotations

import torch

from learner.maths import attention


def test_per_sample_attention_equals_one_masked_sdpa_over_the_packed_rows():
    lengths = [5, 1, 8]
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(14, 4, 8, dtype=torch.float64, generator=generator)  # [N, Hq, D]
    k, v = (torch.randn(14, 2, 8, dtype=torch.float64, generator=generator) for _ in range(2))  # [N, Hk, D]
    out = attention.per_sample_attention(q, k, v, cu, max(lengths), 0.3)
    sample = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))  # [N]
    position = torch.arange(14)
    allowed = (sample[:, None] == sample[None, :]) & (position[None, :] <= position[:, None])  # [N, N] block-causal
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed, scale=0.3,
        enable_gqa=True)[0].transpose(0, 1)
    assert torch.allclose(out, expected, atol=1e-12)


def test_cpu_and_float32_use_the_per_sample_reference():
    assert attention.varlen_kernel(torch.device("cpu"), torch.bfloat16) is attention.per_sample_attention
    assert attention.varlen_kernel(torch.device("cuda"), torch.float32) is attention.per_sample_attention


def test_a_packed_forward_gets_no_mask_and_the_implementation_is_registered():
    assert attention.attention_mask(batch_size=1, attention_mask=None) is None
    assert attention.register() == attention.IMPLEMENTATION
