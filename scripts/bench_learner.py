"""Learner throughput: tokens/s, MFU and peak memory of the learner's real optimizer step
(`learner.policy.train_step`) on a synthetic RL batch, packed against padded micro-batches side by side.

The model is a randomly initialised Qwen2-architecture causal LM of a named shape (`--shape`, Qwen2.5's
dimensions; `tiny` is the quickstart's; `--layers`, `--hidden` and `--vocab` change one of them, e.g. a 20 M-parameter
tiny shape with Qwen's 151,936-token vocabulary: `--hidden 128 --vocab 151936`), sharded with FSDP2 exactly as the learner does it (one rank; bf16
mixed precision on CUDA; `--activation-checkpointing`, `--compile`, `--cpu-offload` as the learner's keys).
The batch holds `--batch` samples in groups of `--group-size` (GRPO) with random token ids: a
`--prompt-len` prompt and a trained completion whose length is log-normal (median `--median-tokens`,
`--sigma`, at most `--seq-len` in all; `--sigma 0` gives every sample the full length), random 0/1
rewards. Every step runs the whole path: advantages, the proximal pass up front where the loss needs one (m2po:
with one optimizer step per batch the other losses take π_prox from the training pass), the micro-batched loss
and backward, clipping, AdamW.

`--lora` trains LoRA adapters instead, the policy built as the learner builds it with `model.lora.enabled=true`
(`learner.policy.policy_model.build_policy`): adapters of rank `--lora-rank` on `model.lora`'s default target modules, in
the master dtype, on a base frozen in bf16 on CUDA (in the master dtype on CPU), sharded alike; only the adapters
go to AdamW, and `--reference` scores the base with the adapters off (no second model), as the learner's reference
does. Run the same command with and without `--lora` to set LoRA's throughput and MFU beside full fine-tuning's.

Each variant in `--variants` (packed, padded) trains the same model for `--warmup` + `--steps` steps with
its own optimizer; the table gives each variant's median step and the ratio to the last variant (padded:
what the learner did before packing). `--micro-batch-tokens auto` sizes each variant's micro-batches as
the learner does (`learner.policy.memory`).

FLOPs per step (model FLOPs, as MFU counts them: recomputation from activation checkpointing is not counted):
    forward  F = 2 · P · N + 2 · layers · d_attn · Σ L_i²
    step     = 3 · F (forward and backward) + F (the proximal forward up front, for losses that need one)
               + F (the reference model's forward, with --reference)
               - 2 · P · N with --lora (the frozen base's weight gradients, never computed)
with P the base model's parameters that multiply a vector per token (the output head included, an untied input
embedding left out: a lookup), N = Σ L_i the tokens of the step (prompt and completion, padding left out),
d_attn = heads · head_dim, and causal attention taking half of the L² scores. With --lora the backward computes
input gradients only, 2 · P · N for the weights plus attention's 2 · (2 · layers · d_attn · Σ L_i²) (both operands
of its products are activations): about 2 · F, not 3 · F. The adapters' FLOPs are left out in every pass (rank 16 on
the 7b shape: 0.6 % of P), so F is the same model's with and without --lora, and MFU = FLOPs / step time /
`--peak-tflops` counts, for both, only the work the step needs of that model.
Last line: RESULT {json} with learner_tok_s, mfu, peak_memory_gib, micro_batch_tokens, checkpointing (the mode it
trained with: auto's choice), params (the first variant's, with every variant's figures under "variants"),
trained_params (those AdamW steps: the adapters' with --lora) and lora (the rank, or null in full fine-tuning);
mfu and peak memory are null on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.sections import LoraConfig, TinyModelConfig
from asyncrl.logs import setup_logging
from asyncrl.memory_plan import GpuSplit
from asyncrl.messages import Trajectory, TrajectoryGroup
from demo.tiny.tokenizer import build_char_tokenizer
from learner.distributed import World, init_single_rank_world
from learner.maths import attention
from learner.maths.batching import TrainBatch, collate
from learner.policy.activation_checkpointing import AUTO, MODES, NONE, checkpointing_mode
from learner.policy.lora import AdaptersOff, is_adapter_weight
from learner.policy.memory import hold_to_part, resolve_micro_batch_tokens
from learner.policy.policy_model import DTYPES, build_policy, frozen_base_dtype, shard_policy
from learner.policy.train_step import Passes, proximal_pass_up_front, train_step

GIB = 2**30
TERA = 1e12
DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16
FIRST_TOKEN_ID = 4  # above the tiny tokenizer's special tokens
BEHAVIOUR_LOGPROB_RANGE = (-4.0, -0.5)  # typical log-probs of sampled tokens
QWEN_VOCAB = 151936


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # 0 = the tiny character tokenizer's
    tied: bool


_TINY = TinyModelConfig()
SHAPES = {  # Qwen2.5's published dimensions
    "tiny": Shape(_TINY.hidden_size, _TINY.num_layers, _TINY.num_heads, _TINY.num_kv_heads, _TINY.intermediate_size, 0, True),
    "0.5b": Shape(896, 24, 14, 2, 4864, QWEN_VOCAB, True),
    "1.5b": Shape(1536, 28, 12, 2, 8960, QWEN_VOCAB, True),
    "3b": Shape(2048, 36, 16, 2, 11008, QWEN_VOCAB, True),
    "7b": Shape(3584, 28, 28, 4, 18944, 152064, False),
    "14b": Shape(5120, 48, 40, 8, 13824, 152064, False),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="model dimensions (Qwen2.5's)")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0 = the shape's)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (0 = the shape's; a multiple of its heads)")
    parser.add_argument("--vocab", type=int, default=0,
                        help=f"vocabulary (0 = the shape's; {QWEN_VOCAB} gives a small shape a real model's output head)")
    parser.add_argument("--seq-len", type=int, default=_TINY.max_position, help="longest sample, prompt included")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sample (not trained)")
    parser.add_argument("--median-tokens", type=int, default=0, help="median completion length (0 = the longest)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of completion lengths (0 = fixed)")
    parser.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt group (GRPO's n)")
    parser.add_argument("--micro-batch-tokens", default="8192", help="tokens per pass, or auto (learner.micro_batch_tokens)")
    parser.add_argument("--variants", default="packed,padded", help="comma-separated: packed, padded (the last is the baseline)")
    parser.add_argument("--activation-checkpointing", default=LearnerConfig().activation_checkpointing,
                        choices=[*MODES, AUTO], help="learner.activation_checkpointing (auto: chosen per variant)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (learner.compile)")
    parser.add_argument("--cpu-offload", action="store_true", help="optimizer state in CPU memory (learner.cpu_offload)")
    parser.add_argument("--loss", default=AlgorithmConfig().loss, help="policy loss (algorithm.loss)")
    parser.add_argument("--reference", action="store_true",
                        help="a frozen reference model and the KL penalty (algorithm.use_reference): one more forward per step")
    parser.add_argument("--lora", action="store_true",
                        help="train LoRA adapters on a frozen base (model.lora.enabled=true; its default targets)")
    parser.add_argument("--lora-rank", type=int, default=LoraConfig().rank, help="model.lora.rank (with --lora)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="master weights' dtype")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, per variant")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0 = torch's default)")
    parser.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS, help="peak dense TFLOP/s for MFU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    args = parser.parse_args()
    if args.batch % args.group_size or args.prompt_len >= args.seq_len:
        parser.error("--batch must be a multiple of --group-size, and --prompt-len below --seq-len")
    if args.hidden % SHAPES[args.shape].heads:
        parser.error(f"--hidden must be a multiple of the {args.shape} shape's {SHAPES[args.shape].heads} heads")
    if set(args.variants.split(",")) - {"packed", "padded"}:
        parser.error("--variants takes packed and/or padded")
    return args


def model_shape(args: argparse.Namespace) -> Shape:
    shape = SHAPES[args.shape]
    vocab = args.vocab or shape.vocab or len(build_char_tokenizer())
    return Shape(args.hidden or shape.hidden, args.layers or shape.layers, shape.heads, shape.kv_heads, shape.intermediate,
                 vocab, shape.tied)


def build_model(shape: Shape, args: argparse.Namespace, world: World, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights in `dtype`, initialised straight on the rank's device (a 3B model takes minutes on a CPU)."""
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=args.seq_len, tie_word_embeddings=shape.tied,
    )
    torch.manual_seed(args.seed)
    with world.device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention.register(), dtype=dtype)
    return model


def frozen_reference(shape: Shape, args: argparse.Namespace, world: World, policy: torch.nn.Module) -> torch.nn.Module:
    """The reference model as the learner's `load_reference` makes it: with --lora the policy's base with its
    adapters off; else the policy's starting weights again, frozen in bf16 on CUDA (model.dtype of the GPU preset),
    sharded."""
    if args.lora:
        return AdaptersOff(policy)
    dtype = "bfloat16" if world.device.type == "cuda" else args.dtype
    model = build_model(shape, args, world, DTYPES[dtype]).requires_grad_(False)
    return shard_policy(model, LearnerConfig(activation_checkpointing=NONE, compile=args.compile), world)


def completion_lengths(args: argparse.Namespace, rng: random.Random) -> list[int]:
    """Per sample: log-normal around the median, between 1 and what the longest sample leaves after the prompt."""
    longest = args.seq_len - args.prompt_len
    median = args.median_tokens or longest
    if args.sigma <= 0:
        return [min(median, longest)] * args.batch
    return [min(longest, max(1, round(rng.lognormvariate(math.log(median), args.sigma)))) for _ in range(args.batch)]


def synthetic_batch(args: argparse.Namespace, vocab: int) -> TrainBatch:
    """`--batch` samples in groups of `--group-size`, random ids, rewards and behaviour log-probs."""
    rng = random.Random(args.seed)
    lengths = iter(completion_lengths(args, rng))
    groups = []
    for g in range(args.batch // args.group_size):
        trajectories = []
        for _ in range(args.group_size):
            completion = next(lengths)
            trajectories.append(Trajectory(
                [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(args.prompt_len)],
                [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(completion)],
                [rng.uniform(*BEHAVIOUR_LOGPROB_RANGE) for _ in range(completion)],
                [0] * completion, [1] * completion, float(rng.random() < 0.5), f"g{g}", "synthetic", "length",
            ))
        groups.append(TrajectoryGroup(f"r{g}", f"g{g}", "bench", trajectories))
    return collate(groups, pad_id=0)


def step_flops(model: torch.nn.Module, shape: Shape, batch: TrainBatch, loss: str, reference: bool, lora: bool) -> float:
    """Model FLOPs of one step (the formula in the module docstring)."""
    lengths = batch.attention_mask.sum(dim=1).double()  # [B]
    config = model.config
    attention_width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    weights = 2 * matmul_parameters(model, shape) * float(lengths.sum())  # per pass
    forward = weights + 2 * shape.layers * attention_width * float(lengths.square().sum())
    up_front = proximal_pass_up_front(model, AlgorithmConfig(loss=loss))
    passes = 3 + (1 if up_front else 0) + (1 if reference else 0)
    return passes * forward - (weights if lora else 0)  # a frozen base's backward has no weight gradients


def matmul_parameters(model: torch.nn.Module, shape: Shape) -> int:
    """Parameters of the base model a token is multiplied with: all of them, less an untied input embedding (a
    lookup) and LoRA's adapters (left out of the count, see the module docstring)."""
    total = sum(p.numel() for name, p in model.named_parameters() if not is_adapter_weight(name))  # tied: once
    return total if shape.tied else total - model.get_input_embeddings().weight.numel()


@dataclass
class VariantResult:
    name: str
    micro_batch_tokens: int
    checkpointing: str  # the mode it trained with (auto's choice)
    seconds: list[float]
    peak_gib: float | None


def run_variant(name: str, model: torch.nn.Module, reference: torch.nn.Module | None, batch: TrainBatch,
                args: argparse.Namespace, world: World, shape: Shape, split: GpuSplit | None) -> VariantResult:
    """`--warmup` then `--steps` timed train steps of one variant, with a fresh AdamW."""
    packed = name == "packed"
    settings = LearnerConfig(micro_batch_tokens=args.micro_batch_tokens, cpu_offload=args.cpu_offload,
                             activation_checkpointing=args.activation_checkpointing)
    tokens = resolve_micro_batch_tokens(model, settings, world, shape.vocab, args.seq_len, packed, split)
    checkpointing = checkpointing_mode(model, args.activation_checkpointing, world.device)
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]  # --lora: the adapters
    optimizer = torch.optim.AdamW(trained, lr=LearnerConfig().lr)
    passes = Passes(micro_batch_tokens=tokens, packed=packed)
    algorithm = AlgorithmConfig(loss=args.loss, use_reference=reference is not None)
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    seconds = []
    for index in range(args.warmup + args.steps):
        _synchronize(world)
        started = time.perf_counter()
        train_step(model, optimizer, batch, algorithm, passes, LearnerConfig().grad_clip, world, reference)
        _synchronize(world)
        if index >= args.warmup:
            seconds.append(time.perf_counter() - started)
        print(f"  {name} step {index + 1}/{args.warmup + args.steps}: {time.perf_counter() - started:.3f} s", flush=True)
    peak = torch.cuda.max_memory_allocated(world.device) / GIB if world.device.type == "cuda" else None
    del optimizer  # its state and the gradients must not count against the next variant
    model.zero_grad(set_to_none=True)
    gc.collect()
    if world.device.type == "cuda":
        torch.cuda.empty_cache()
    return VariantResult(name, tokens, checkpointing, seconds, peak)


def _synchronize(world: World) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


def trains(args: argparse.Namespace) -> str:
    """What the optimizer steps, for the table: every weight, or LoRA adapters of a rank."""
    return f"LoRA r{args.lora_rank}" if args.lora else "full"


def report(args: argparse.Namespace, world: World, shape: Shape, params: tuple[int, int], batch: TrainBatch,
           flops: float, results: list[VariantResult]) -> dict:
    """Print the model, the batch and the table; return RESULT's figures. `params`: (all, trained)."""
    on_cuda = world.device.type == "cuda"
    tokens = batch.num_tokens()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    device_name = torch.cuda.get_device_name(world.device) if on_cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(f"model: {args.shape} shape (hidden {shape.hidden}, layers {shape.layers}, heads {shape.heads}/{shape.kv_heads}, "
          f"intermediate {shape.intermediate}, vocab {shape.vocab}), {params[0] / 1e6:.1f}M params, "
          f"{_adapters(args, params[1], world)}master {args.dtype}, "
          f"activation checkpointing {args.activation_checkpointing}{', compiled' if args.compile else ''}"
          f"{', cpu offload' if args.cpu_offload else ''}{', reference model' if args.reference else ''}, {device_name}")
    print(f"batch: {len(lengths)} samples, {tokens} tokens (lengths median {int(statistics.median(lengths))}, "
          f"max {max(lengths)}), groups of {args.group_size}, loss {args.loss}, {flops / TERA:.1f} TFLOP per step")
    baseline = statistics.median(results[-1].seconds)
    print(f"{'variant':>8} {'trains':>9} {'checkpoint':>10} {'mb tokens':>10} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs ' + results[-1].name:>10}")
    figures = {}
    for result in results:
        step_s = statistics.median(result.seconds)
        mfu = flops / step_s / (args.peak_tflops * TERA) if on_cuda else None
        figures[result.name] = {
            "learner_tok_s": round(tokens / step_s, 1), "mfu": None if mfu is None else round(mfu, 4),
            "step_s": round(step_s, 4), "peak_memory_gib": None if result.peak_gib is None else round(result.peak_gib, 1),
            "micro_batch_tokens": result.micro_batch_tokens, "checkpointing": result.checkpointing,
            "speedup": round(baseline / step_s, 3),
        }
        shown_mfu = f"{mfu:.1%}" if mfu is not None else "-"
        shown_peak = f"{result.peak_gib:.1f}" if result.peak_gib is not None else "-"
        print(f"{result.name:>8} {trains(args):>9} {result.checkpointing:>10} {result.micro_batch_tokens:>10} {step_s:>8.3f} "
              f"{tokens / step_s:>10.0f} {shown_mfu:>7} {shown_peak:>9} {baseline / step_s:>9.2f}x")
    first = figures[results[0].name]
    return {**first, "variant": results[0].name, "params": params[0], "trained_params": params[1],
            "lora": args.lora_rank if args.lora else None, "shape": args.shape, "tokens_per_step": tokens,
            "tflop_per_step": float(f"{flops / TERA:.6g}"),  # significant digits, not decimals: a tiny shape's too
            "device": device_name, "loss": args.loss,
            "activation_checkpointing": args.activation_checkpointing, "compile": args.compile,
            "cpu_offload": args.cpu_offload, "reference": args.reference, "variants": figures}


def _adapters(args: argparse.Namespace, trained: int, world: World) -> str:
    """The model line's words on LoRA: its rank, targets, trained parameters and the frozen base's dtype (nothing
    in full fine-tuning)."""
    if not args.lora:
        return ""
    base = frozen_base_dtype(args.dtype, LearnerConfig(), world)
    return (f"LoRA rank {args.lora_rank} on {','.join(LoraConfig().target_modules)} ({trained / 1e6:.2f}M trained, "
            f"base frozen in {base}), ")


def main() -> None:
    args = parse_args()
    setup_logging("bench-learner")  # the learner's own lines: auto's micro-batch and checkpointing choices
    if args.threads:
        torch.set_num_threads(args.threads)
    world = init_single_rank_world(args.device)
    split = hold_to_part(world, 0.0, servers=0, server_share=0.0)  # the whole GPU, as a learner without servers has it
    try:
        shape = model_shape(args)
        settings = LearnerConfig(activation_checkpointing=args.activation_checkpointing, compile=args.compile,
                                 cpu_offload=args.cpu_offload)
        lora = LoraConfig(enabled=args.lora, rank=args.lora_rank)
        model = build_policy(lambda dtype: build_model(shape, args, world, dtype), args.dtype, settings, world, lora)
        # (all, trained): a sharded parameter's numel is its whole tensor's, and a tied head counts once
        params = (sum(p.numel() for p in model.parameters()),
                  sum(p.numel() for p in model.parameters() if p.requires_grad))
        batch = synthetic_batch(args, shape.vocab)
        flops = step_flops(model, shape, batch, args.loss, args.reference, args.lora)
        reference = frozen_reference(shape, args, world, model) if args.reference else None
        results = [run_variant(name, model, reference, batch, args, world, shape, split)
                   for name in args.variants.split(",")]
        result = report(args, world, shape, params, batch, flops, results)
    finally:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
