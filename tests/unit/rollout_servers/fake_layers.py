"""A small model built like a vLLM model (unsharded), with loaders that copy as vLLM's standard layers' do, for the
weight load plan's tests: packed q/k/v and gate/up, a vocabulary padded past the checkpoint's, a norm without a
loader of its own, a layer whose loader transforms what it copies, and an output head tied to the embedding."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from rollout_servers.weight_load_plan import LayerKinds

HIDDEN, VOCAB, PADDED_VOCAB, FFN = 4, 13, 16, 6
QKV_SIZES = [4, 2, 2]  # q (two heads of 2), k and v (one head each)


def _with_loader(param: nn.Parameter, loader: object, **attrs: object) -> nn.Parameter:
    for key, value in {"weight_loader": loader, **attrs}.items():
        setattr(param, key, value)
    return param


class Plain(nn.Module):
    """A row- or column-parallel linear layer: its loader copies the whole tensor."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = _with_loader(nn.Parameter(torch.zeros(rows, columns)), self.weight_loader, output_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)


class Packed(nn.Module):
    """A merged layer: its loader copies shard i into the rows after those of the shards stacked before it, in the
    order `stacking` (the order of `output_sizes` unless a test says otherwise)."""

    def __init__(self, output_sizes: list[int], columns: int, bias: bool,
                 stacking: Sequence[int] | None = None) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.stacking = list(stacking or range(len(output_sizes)))
        self.weight = _with_loader(nn.Parameter(torch.zeros(sum(output_sizes), columns)), self.weight_loader,
                                   output_dim=0)
        if bias:
            self.bias = _with_loader(nn.Parameter(torch.zeros(sum(output_sizes))), self.weight_loader, output_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | str) -> None:
        index = "qkv".index(shard) if isinstance(shard, str) else shard
        place = self.stacking.index(index)
        start = sum(self.output_sizes[i] for i in self.stacking[:place])
        param.data[start:start + self.output_sizes[index]].copy_(loaded)


class Vocab(nn.Module):
    """A vocabulary embedding padded past the checkpoint's vocabulary: its loader fills the leading rows and zeroes
    the padding."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = _with_loader(nn.Parameter(torch.zeros(PADDED_VOCAB, HIDDEN)), self.weight_loader, output_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data[:loaded.shape[0]].copy_(loaded)
        param.data[loaded.shape[0]:].zero_()


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))  # no loader: vLLM's default loader copies it


def doubling_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A model's own loader that transforms what it copies: the plan must leave it to `load_weights`."""
    param.data.copy_(loaded * 2)


class OwnLoader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = _with_loader(nn.Parameter(torch.zeros(3)), doubling_loader)


KINDS = LayerKinds(plain=(Plain,), packed=(Packed,), vocab=(Vocab,))


class Attention(nn.Module):
    def __init__(self, stacking: Sequence[int] | None) -> None:
        super().__init__()
        self.qkv_proj = Packed(QKV_SIZES, HIDDEN, bias=True, stacking=stacking)
        self.o_proj = Plain(HIDDEN, HIDDEN)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = Packed([FFN, FFN], HIDDEN, bias=False)
        self.down_proj = Plain(HIDDEN, FFN)


class Layer(nn.Module):
    def __init__(self, stacking: Sequence[int] | None) -> None:
        super().__init__()
        self.attn = Attention(stacking)
        self.mlp = Mlp()
        self.norm = Norm()
        self.extra = OwnLoader()


class FakeModel(nn.Module):
    """Its `load_weights` maps checkpoint names as a vLLM model's does (shards into packed parameters, the tied
    head skipped); `qkv_stacking`: the order its q/k/v loader really stacks the shards in."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    shard_ids = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1}

    def __init__(self, qkv_stacking: Sequence[int] | None = None) -> None:
        super().__init__()
        self.embed = Vocab()
        self.layers = nn.ModuleList([Layer(qkv_stacking)])
        self.lm_head = self.embed  # tied: the head's parameter is the embedding's

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.startswith("lm_head."):
                continue  # tied: vLLM's loader skips the head
            module_path, _, leaf = name.rpartition(".")
            parent, _, child = module_path.rpartition(".")
            packed = next((key for key, shards in self.packed_modules_mapping.items() if child in shards), None)
            if packed is None:
                param = params[name]
                getattr(param, "weight_loader", _default_loader)(param, tensor)
            else:
                param = params[f"{parent}.{packed}.{leaf}"]
                param.weight_loader(param, tensor, self.shard_ids[child])
            loaded.add(name)
        return loaded


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


CHECKPOINT_SHAPES = {
    "embed.weight": (VOCAB, HIDDEN),
    "layers.0.attn.q_proj.weight": (4, HIDDEN), "layers.0.attn.q_proj.bias": (4,),
    "layers.0.attn.k_proj.weight": (2, HIDDEN), "layers.0.attn.k_proj.bias": (2,),
    "layers.0.attn.v_proj.weight": (2, HIDDEN), "layers.0.attn.v_proj.bias": (2,),
    "layers.0.attn.o_proj.weight": (HIDDEN, HIDDEN),
    "layers.0.mlp.gate_proj.weight": (FFN, HIDDEN), "layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
    "layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
    "layers.0.norm.weight": (HIDDEN,),
    "layers.0.extra.weight": (3,),
    "lm_head.weight": (VOCAB, HIDDEN),
}


def checkpoint(seed: int, fresh_biases: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor with values of its own (`fresh_biases`: biases zero and norms one, as a freshly
    initialised model sends them, where the values alone cannot tell places apart)."""
    generator = torch.Generator().manual_seed(seed)
    named = [(name, torch.randn(shape, generator=generator)) for name, shape in CHECKPOINT_SHAPES.items()]
    if fresh_biases:
        named = [(name, torch.zeros_like(t) if name.endswith(".bias") else torch.ones_like(t) if "norm" in name else t)
                 for name, t in named]
    return named
