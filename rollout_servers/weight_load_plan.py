"""Where each announced tensor lands in a vLLM model's parameters: resolved once, checked once against vLLM's own
loader, then used by every round to load all planned tensors with one batched copy.

vLLM's `load_weights` spends about 90 µs of Python per tensor in its per-parameter loaders (24-28 ms for a 0.5B
model's 291 tensors on an H100) to copy bytes that take about 1 ms on the GPU. Loading in place into one unsharded
model (tensor and pipeline parallel size 1), a standard layer's loader does nothing but copy the checkpoint tensor
into a fixed view of one parameter:
- a plain name: the whole parameter of that name;
- a packed shard (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, in the order of the model's
  `packed_modules_mapping`): the rows after those of the shards listed before it (the layer's `output_sizes`);
- a vocabulary embedding or output head: the leading rows of a parameter padded past the vocabulary.
A tied alias (the output head of a model whose head is its embedding) is the same tensor as a parameter the round
loads under its own name: vLLM's loaders skip it (0.32 raises when it comes without that parameter), and so does the
plan, unless that parameter loads through `load_weights`, where the alias goes along. Anything else keeps going
through `load_weights`: a name with no parameter (one the model's loader renames), a dtype other than the
parameter's, a parameter whose loader is not a standard layer's (a custom loader may transform what it copies), a
shape that does not fit, views that overlap.

A plan is trusted only once vLLM's loader agreed with it (`checked_plan`, on the plan's first round): the round is
loaded by `load_weights` alone, then every planned tensor is loaded again as distinct random values, and its view
must hold exactly those values (the round's own values could not tell places apart where they repeat: a fresh
model's zero biases and unit norms match each other everywhere). A tensor whose view does not goes to
`load_weights` for good, with a warning naming it. Last, the round is loaded through the plan, and every parameter
and buffer must hold exactly what `load_weights` alone left there: a loader that also wrote somewhere outside the
plan would leave its random values behind, and the whole plan is dropped.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch

from asyncrl.weight_transfer.protocol import TensorMeta
from rollout_servers.vllm_compat import WeightLoader

log = logging.getLogger(__name__)

NamedTensor = tuple[str, torch.Tensor]
Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # (name, dtype, shape) of each announced tensor

# While a plan is checked (once), device memory beyond what vLLM planned for: random values loaded at once (or one
# tensor's worth, where a tensor is larger), and elements fingerprinted at once (two int64 temporaries of 32 MiB).
PROBE_BATCH_BYTES = 64 * 2**20
FINGERPRINT_CHUNK = 2**22
PROBE_SEED = 0x5EED
NO_PARAMETER = "no parameter of that name (the model's loader may rename it)"


@dataclass(frozen=True)
class LayerKinds:
    """The layer types (exact, not subclasses) whose weight loaders only copy the checkpoint tensor into a view of
    their parameter when unsharded, by what that view may be. A parameter without a loader of its own is copied
    whole (vLLM's default loader)."""

    plain: tuple[type, ...]  # the whole parameter
    packed: tuple[type, ...]  # also rows of one shard, stacked in the order of `output_sizes`
    vocab: tuple[type, ...]  # also the leading rows of a parameter padded past the vocabulary


@functools.cache
def vllm_layers() -> LayerKinds:
    """vLLM's standard unquantized layers (the same classes in 0.24 and 0.32); imported when a plan is first made."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return LayerKinds(plain=(ReplicatedLinear, ColumnParallelLinear, RowParallelLinear),
                      packed=(MergedColumnParallelLinear, QKVParallelLinear),
                      vocab=(VocabParallelEmbedding, ParallelLMHead))


class Shard(NamedTuple):
    packed: str  # the packed module's name, e.g. "qkv_proj"
    index: int  # this shard's place among the packed module's shards
    count: int  # how many shards the packed module stacks


class Target(NamedTuple):
    param: str  # the vLLM parameter's name
    rows: tuple[int, int]  # [start, stop) along the parameter's dim 0


@dataclass(frozen=True)
class LoadPaths:
    """How a round's tensors were loaded."""

    batched: int  # copied by the one batched copy
    load_weights: int  # loaded by vLLM's `load_weights`
    tied: int = 0  # skipped: tied aliases of parameters the batched copy loads
    checked_plan: bool = False  # this round also checked the plan against `load_weights` (its first round)


@dataclass
class LoadPlan:
    """Destination views for the planned tensors of one announced layout in one model; the rest go to `load_weights`."""

    model: torch.nn.Module
    layout: Layout
    planned: list[int]  # indices (in the announced order) of the tensors the batched copy loads
    views: list[torch.Tensor]  # their destinations, in the same order
    fallback: dict[int, str]  # indices of the tensors `load_weights` loads, and why
    tied: dict[int, int]  # indices of the tied aliases skipped → the index of the tensor loaded in their place
    # (module, attribute, parameter, address) of every parameter a view points into: a plan whose parameters were
    # replaced or reallocated since would copy into memory the model no longer reads
    anchors: list[tuple[torch.nn.Module, str, torch.Tensor, int]]

    def fits(self, model: torch.nn.Module, layout: Layout) -> bool:
        """It was made for this model and layout, and the model still serves the parameters its views point into."""
        return (self.model is model and self.layout == layout and
                all(getattr(module, attr) is param and param.data_ptr() == address
                    for module, attr, param, address in self.anchors))

    def load(self, named: Sequence[NamedTensor], load_weights: WeightLoader) -> LoadPaths:
        """Load a round of this layout: the planned tensors in one batched copy, the rest through `load_weights`."""
        if self.planned:
            torch._foreach_copy_(self.views, [named[index][1] for index in self.planned])
        if self.fallback:
            load_all(load_weights, [named[index] for index in self.fallback])
        return self.paths()

    def paths(self, checked: bool = False) -> LoadPaths:
        return LoadPaths(len(self.planned), len(self.fallback), len(self.tied), checked)

    def without(self, indices: Iterable[int], reason: str) -> LoadPlan:
        """The same plan with the tensors at `indices`, and the tied aliases of those, loaded by `load_weights`
        instead (an alias goes in the same call as its parameter's tensor, as vLLM's loader expects it)."""
        dropped = set(indices)
        kept = [(index, view) for index, view in zip(self.planned, self.views) if index not in dropped]
        fallback, tied = _with_tied(self.fallback | {index: reason for index in dropped}, self.tied, self.layout)
        return LoadPlan(self.model, self.layout, [index for index, _ in kept], [view for _, view in kept], fallback,
                        tied, self.anchors)


def _with_tied(fallback: dict[int, str], tied: dict[int, int], layout: Layout) -> tuple[dict[int, str], dict[int, int]]:
    """The fallback with the tied aliases of its tensors added (an alias goes in the same `load_weights` call as its
    parameter's tensor, as vLLM's loader expects it), in announced order; the aliases still skipped."""
    untied = {alias: f"tied to {layout[index][0]}, which loads through load_weights"
              for alias, index in tied.items() if index in fallback}
    return (dict(sorted((fallback | untied).items())),
            {alias: index for alias, index in tied.items() if alias not in untied})


def layout_of(metas: Sequence[TensorMeta]) -> Layout:
    """What a plan is made for, from the update's announcement: reading it off the tensors would cost two torch
    calls per tensor each round, through vLLM's device mode on 0.24."""
    return tuple((meta.name, meta.dtype, tuple(meta.shape)) for meta in metas)


# resolving ---------------------------------------------------------------------------------------------------------

def resolve(model: torch.nn.Module, layout: Layout, kinds: LayerKinds) -> LoadPlan:
    """Where each announced tensor lands in `model`'s parameters, as far as names, shapes and loaders tell."""
    params = dict(model.named_parameters())  # each parameter under one name: a tied alias is absent
    modules = dict(model.named_modules())
    shards = _shards(getattr(model, "packed_modules_mapping", {}))
    tied = _tied(model, layout)
    targets: dict[int, Target] = {}
    fallback: dict[int, str] = {}
    for index, (name, dtype, shape) in enumerate(layout):
        if index in tied:
            continue
        target = _target(name, dtype, shape, params, modules, shards, kinds)
        if isinstance(target, Target):
            targets[index] = target
        else:
            fallback[index] = target
    for index in _overlapping(targets):
        fallback[index] = f"its rows of {targets.pop(index).param} overlap another tensor's"
    fallback, tied = _with_tied(fallback, tied, layout)
    return LoadPlan(model, layout, list(targets), [_view(params[t.param], t) for t in targets.values()], fallback,
                    tied, _anchors({t.param for t in targets.values()}, params, modules))


def _tied(model: torch.nn.Module, layout: Layout) -> dict[int, int]:
    """Announced tied aliases → the index of the announced tensor of the parameter they are the same tensor as."""
    canonical = {id(param): name for name, param in model.named_parameters()}
    announced = {name: index for index, (name, _, _) in enumerate(layout)}
    aliases = {name: canonical[id(param)] for name, param in model.named_parameters(remove_duplicate=False)}
    return {index: announced[aliases[name]] for name, index in announced.items()
            if name in aliases and aliases[name] != name and aliases[name] in announced}


def _shards(packed_modules_mapping: dict[str, list[str]]) -> dict[str, Shard]:
    """Each shard module's name (e.g. "k_proj") → where it goes; a name listed under two packed modules is left
    out."""
    listed = [(name, Shard(packed, index, len(names)))
              for packed, names in packed_modules_mapping.items() for index, name in enumerate(names)]
    counts = {name: sum(other == name for other, _ in listed) for name, _ in listed}
    return {name: shard for name, shard in listed if counts[name] == 1 and name != shard.packed}


def _target(name: str, dtype: torch.dtype, shape: tuple[int, ...], params: dict[str, torch.Tensor],
            modules: dict[str, torch.nn.Module], shards: dict[str, Shard], kinds: LayerKinds) -> Target | str:
    """The view `name` lands in, or why the plan leaves it to `load_weights`."""
    param_name, shard = (name, None) if name in params else _packed_parameter(name, shards)
    if param_name not in params:
        return NO_PARAMETER
    param, module = params[param_name], modules[param_name.rpartition(".")[0]]
    if not dtype.is_floating_point or dtype != param.dtype:
        return f"sent as {dtype}, served as {param.dtype}"
    kind = _kind(param, module, kinds)
    if kind is None:
        return f"{type(module).__name__} loads {param_name} with a loader of its own"
    rows = _rows(shape, param, module, kind, shard)
    if rows is None:
        return f"shape {list(shape)} does not fit {param_name} {list(param.shape)} as a {kind} tensor"
    return Target(param_name, rows)


def _packed_parameter(name: str, shards: dict[str, Shard]) -> tuple[str | None, Shard | None]:
    """"a.q_proj.weight" → ("a.qkv_proj.weight", its shard), where "q_proj" is a shard; else (None, None)."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, child = module_path.rpartition(".")
    shard = shards.get(child)
    if shard is None:
        return None, None
    return ".".join(part for part in (parent, shard.packed, leaf) if part), shard


def _kind(param: torch.Tensor, module: torch.nn.Module, kinds: LayerKinds) -> str | None:
    """"plain", "packed" or "vocab" where the parameter's loader is known to copy into a view, else None."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        return "plain"  # the model's loader falls back to vLLM's default loader: a copy of the same shape
    if getattr(loader, "__self__", None) is not module:
        return None
    layer = type(module)
    return next((kind for kind in ("plain", "packed", "vocab") if layer in getattr(kinds, kind)), None)


def _rows(shape: tuple[int, ...], param: torch.Tensor, module: torch.nn.Module, kind: str,
          shard: Shard | None) -> tuple[int, int] | None:
    """The rows [start, stop) of `param` a tensor of `shape` fills, or None where it does not fit."""
    if param.dim() == 0:
        return None
    if shard is not None:
        return _shard_rows(shape, param, module, kind, shard)
    if tuple(shape) == tuple(param.shape):
        return 0, param.shape[0]
    padded = (kind == "vocab" and getattr(param, "output_dim", None) == 0 and len(shape) == param.dim()
              and tuple(shape[1:]) == tuple(param.shape[1:]) and shape[0] < param.shape[0])
    return (0, shape[0]) if padded else None


def _shard_rows(shape: tuple[int, ...], param: torch.Tensor, module: torch.nn.Module, kind: str,
                shard: Shard) -> tuple[int, int] | None:
    """A packed layer stacks its shards' rows in the order of `output_sizes` (what its loader narrows to)."""
    sizes = list(getattr(module, "output_sizes", []))
    fits = (kind == "packed" and getattr(param, "output_dim", None) == 0 and len(sizes) == shard.count
            and sum(sizes) == param.shape[0] and tuple(shape) == (sizes[shard.index], *param.shape[1:]))
    start = sum(sizes[:shard.index])
    return (start, start + sizes[shard.index]) if fits else None


def _overlapping(targets: dict[int, Target]) -> list[int]:
    """Indices of the targets whose rows overlap another target's in the same parameter."""
    overlapping: set[int] = set()
    by_param = sorted(targets.items(), key=lambda item: item[1].param)
    for _, group in itertools.groupby(by_param, key=lambda item: item[1].param):
        furthest: tuple[int, int] | None = None  # (stop, index) of the span reaching furthest so far
        for (start, stop), index in sorted((rows, index) for index, (_, rows) in group):
            if furthest is not None and start < furthest[0]:
                overlapping |= {index, furthest[1]}
            if furthest is None or stop > furthest[0]:
                furthest = (stop, index)
    return sorted(overlapping)


def _view(param: torch.Tensor, target: Target) -> torch.Tensor:
    start, stop = target.rows
    return param.data[start:stop]  # the serving tensor itself, outside autograd


def _anchors(names: set[str], params: dict[str, torch.Tensor],
             modules: dict[str, torch.nn.Module]) -> list[tuple[torch.nn.Module, str, torch.Tensor, int]]:
    anchors = []
    for name in sorted(names):
        module_path, _, attr = name.rpartition(".")
        anchors.append((modules[module_path], attr, params[name], params[name].data_ptr()))
    return anchors


# checking ----------------------------------------------------------------------------------------------------------

def checked_plan(model: torch.nn.Module, named: Sequence[NamedTensor], layout: Layout, load_weights: WeightLoader,
                 kinds: LayerKinds) -> LoadPlan:
    """Resolve the plan for this round's tensors (announced as `layout`) and check it against `load_weights` (module
    docstring); the round is loaded either way. Costs `load_weights` two or three times over, once per plan."""
    plan = resolve(model, layout, kinds)
    load_all(load_weights, named)  # the round as vLLM's loader alone leaves it: the reference
    reference = fingerprints(model)
    misplaced = _misplaced(plan, named, load_weights)
    for index in misplaced:
        log.warning("weight load plan: vLLM's loader put '%s' elsewhere than the plan's view; it loads through "
                    "load_weights from now on", named[index][0])
    plan = plan.without(misplaced, "vLLM's loader put it elsewhere")
    plan.load(named, load_weights)  # the round's values again, through the plan
    changed = [name for name, print_ in fingerprints(model).items() if print_ != reference[name]]
    if changed:
        log.warning("weight load plan dropped: vLLM's loader also writes %s, where no planned view points; every "
                    "tensor loads through load_weights", changed)
        load_all(load_weights, named)
        plan = plan.without(plan.planned, f"vLLM's loader also writes {changed[0]}")
    _log_plan(plan)
    return plan


def _misplaced(plan: LoadPlan, named: Sequence[NamedTensor], load_weights: WeightLoader) -> list[int]:
    """The planned tensors whose view does not hold what `load_weights` wrote for them, loading distinct random
    values in their place (a batch of PROBE_BATCH_BYTES at a time)."""
    generators: dict[torch.device, torch.Generator] = {}
    misplaced = []
    for batch in _batches(list(zip(plan.planned, plan.views)), named):
        probes = [_probe(named[index][1], generators) for index, _ in batch]
        load_all(load_weights, [(named[index][0], probe) for (index, _), probe in zip(batch, probes)])
        misplaced += [index for (index, view), probe in zip(batch, probes) if not torch.equal(view, probe)]
    return misplaced


def _batches(planned: list[tuple[int, torch.Tensor]],
             named: Sequence[NamedTensor]) -> Iterable[list[tuple[int, torch.Tensor]]]:
    batch, size = [], 0
    for index, view in planned:
        tensor = named[index][1]
        if batch and size + tensor.numel() * tensor.element_size() > PROBE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append((index, view))
        size += tensor.numel() * tensor.element_size()
    if batch:
        yield batch


def _probe(like: torch.Tensor, generators: dict[torch.device, torch.Generator]) -> torch.Tensor:
    """Random values of `like`'s shape, dtype and device; no two tensors of a check get the same ones."""
    if like.device not in generators:
        generators[like.device] = torch.Generator(device=like.device).manual_seed(PROBE_SEED)
    return torch.randn(like.shape, dtype=like.dtype, device=like.device, generator=generators[like.device])


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprints(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Per parameter and buffer: the sums of its elements' bit patterns and of their squares (int64, wrapping). A
    write that changes its bytes changes them (bar a vanishing chance); NaNs compare equal, unlike their values."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return {name: _fingerprint(tensor.detach()) for name, tensor in tensors}


def _fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    as_int = _SAME_SIZE_INT.get(tensor.element_size(), torch.uint8)
    bits = tensor.reshape(-1).view(as_int)  # [numel] (uint8: [numel · itemsize])
    total = square = 0
    for chunk in bits.split(FINGERPRINT_CHUNK):
        wide = chunk.to(torch.int64)
        total += int(wide.sum())
        square += int((wide * wide).sum())
    return total, square


def _log_plan(plan: LoadPlan) -> None:
    reasons = [f"{plan.layout[index][0]}: {reason}" for index, reason in plan.fallback.items()]
    reasons += [f"{plan.layout[alias][0]}: tied to {plan.layout[index][0]}" for alias, index in plan.tied.items()]
    log.info("weight load plan checked against vLLM's loader: %d of %d tensors load in one batched copy, %d through "
             "load_weights, %d skipped as tied aliases%s", len(plan.planned), len(plan.layout), len(plan.fallback),
             len(plan.tied), f" ({'; '.join(reasons)})" if reasons else "")


# loading through vLLM ----------------------------------------------------------------------------------------------

def unread_after(load_weights: WeightLoader, named: Iterable[NamedTensor]) -> list[str]:
    """Feed `named` to `load_weights` as one iterator; the names it left unread, taken from the iterator all the same
    (a receiving end still receives each, so the trainer's round completes)."""
    remaining = iter(named)
    load_weights(remaining)
    return [name for name, _ in remaining]


def fail_if_unread(unread: list[str]) -> None:
    if unread:
        raise RuntimeError(f"load_weights stopped before {len(unread)} announced tensors, first '{unread[0]}'")


def load_all(load_weights: WeightLoader, named: Iterable[NamedTensor]) -> None:
    fail_if_unread(unread_after(load_weights, named))
