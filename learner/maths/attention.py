"""The learner's attention: one transformers attention implementation, `asyncrl`, that attends within each
sample of a packed micro-batch (a variable-length kernel) and runs PyTorch's sdpa on padded ones.

A packed forward passes `cu_seq_lens_q` (sample boundaries, [S+1] int32) and `max_length_q` through the
model's keyword arguments, which transformers hands to every attention call; a padded forward passes the
usual 2-D attention mask instead. Kernels for the packed path, the first that applies:
- flash-attn's `flash_attn_varlen_func`, when installed and on a GPU in bf16/fp16;
- PyTorch's own `torch.nn.attention.varlen.varlen_attn` (FlashAttention inside), on a GPU in bf16/fp16;
- sdpa per sample (`per_sample_attention`), anywhere: the reference the others are tested against, and
  the CPU's path.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "asyncrl"  # the name models are loaded with (attn_implementation)
FLASH_DTYPES = (torch.bfloat16, torch.float16)

# (query [N, Hq, D], key [N, Hk, D], value [N, Hk, D], cu_seq_lens [S+1] int32, longest sample, scale) → [N, Hq, D]
VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, int, float], Tensor]


def attention_forward(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: query [B, Hq, T, D], key/value [B, Hk, T, D] → ([B, T, Hq, D], None)."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [N, H, D] each (packed: B = 1)
    kernel = varlen_kernel(q.device, q.dtype)
    return kernel(q, k, v, cu_seq_lens, int(kwargs["max_length_q"]), scale).unsqueeze(0), None  # [1, N, Hq, D]


def attention_mask(*args, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """No mask for a packed forward (the sample boundaries travel as cu_seq_lens); sdpa's otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make `IMPLEMENTATION` known to transformers (idempotent); returns the name to load models with."""
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)
    return IMPLEMENTATION


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> VarlenKernel:
    """The fastest packed-attention kernel for tensors on `device` in `dtype`."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return per_sample_attention
    return _flash_attn_kernel() or _torch_varlen_kernel() or per_sample_attention


def per_sample_attention(q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, longest: int, scale: float) -> Tensor:
    """Causal sdpa on each sample's own rows: [N, Hq, D] → [N, Hq, D]."""
    bounds = cu_seq_lens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        sample = [tensor[start:end].transpose(0, 1).unsqueeze(0) for tensor in (q, k, v)]  # [1, H, L, D] each
        out = torch.nn.functional.scaled_dot_product_attention(*sample, is_causal=True, scale=scale, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))  # [L, Hq, D]
    return torch.cat(outputs)


@functools.cache
def _flash_attn_kernel() -> VarlenKernel | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None

    def kernel(q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, longest: int, scale: float) -> Tensor:
        return flash_attn_varlen_func(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, softmax_scale=scale, causal=True)

    return kernel


@functools.cache
def _torch_varlen_kernel() -> VarlenKernel | None:
    """PyTorch's varlen_attn, whose keywords changed between releases: causality is `is_causal=True` in some
    and `window_size=(-1, 0)` in others; grouped-query heads are native only with `enable_gqa`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in parameters
    takes_scale = "scale" in parameters
    options = causal | ({"enable_gqa": True} if native_gqa else {})

    def kernel(q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, longest: int, scale: float) -> Tensor:
        if not takes_scale and scale != q.shape[-1] ** -0.5:  # a release without `scale` applies 1/sqrt(D) only
            return per_sample_attention(q, k, v, cu_seq_lens, longest, scale)
        if not native_gqa and k.shape[1] != q.shape[1]:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)  # [N, Hq, D]
        scaling = {"scale": scale} if takes_scale else {}
        return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, **scaling, **options)

    return kernel
