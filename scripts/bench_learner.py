"""Learner throughput: tokens/s of one optimizer step (`learner.train_step`) on a synthetic batch, and on
CUDA an MFU estimate.

The model is a randomly initialised Qwen2-architecture causal LM of the given shape (by default the
quickstart's tiny model), sharded with FSDP2 exactly as the learner does (one rank; bf16 mixed precision
on CUDA). The batch is `--batch` samples in groups of `--group-size` (GRPO), each `--seq-len` tokens of
random ids (`--prompt-len` prompt, the rest trained completion) with random 0/1 rewards, so every step
runs the full path: advantages, proximal pass, micro-batched loss and backward, clip, AdamW.

MFU = 6 · parameters · tokens / step time / peak FLOP/s: the usual forward + backward count; the
proximal forward of decoupled PPO (≈ 2 · parameters · tokens more) and attention FLOPs are not counted.
Qwen2.5-0.5B's shape: --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936.
Last line: RESULT {json} with learner_tok_s, mfu and peak_memory_gib (both null on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.sections import TinyModelConfig
from asyncrl.messages import Trajectory, TrajectoryGroup
from asyncrl.net import LOOPBACK, free_port
from asyncrl.tiny.tokenizer import build_char_tokenizer
from learner.batching import TrainBatch, collate
from learner.distributed import World, init_world
from learner.policy_model import DTYPES, attention_backend, shard_policy
from learner.train_step import train_step

GIB = 2**30
FLOPS_PER_PARAM_TOKEN = 6  # matmul FLOPs per parameter per token: forward 2, backward 4
TERA = 1e12
DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16
FIRST_TOKEN_ID = 4  # above the tiny tokenizer's special tokens
BEHAVIOUR_LOGPROB_RANGE = (-4.0, -0.5)  # typical log-probs of sampled tokens


def parse_args() -> argparse.Namespace:
    tiny = TinyModelConfig()
    learner = LearnerConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=tiny.hidden_size, help="hidden size")
    parser.add_argument("--layers", type=int, default=tiny.num_layers, help="decoder layers")
    parser.add_argument("--heads", type=int, default=tiny.num_heads, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=tiny.num_kv_heads, help="key/value heads")
    parser.add_argument("--intermediate", type=int, default=tiny.intermediate_size, help="MLP width")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (0 = the tiny character tokenizer's)")
    parser.add_argument("--seq-len", type=int, default=tiny.max_position, help="tokens per sample, prompt included")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sample (not trained)")
    parser.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt group (GRPO's n)")
    parser.add_argument("--micro-batch-tokens", type=int, default=learner.micro_batch_tokens, help="padded tokens per pass")
    parser.add_argument("--loss", default=AlgorithmConfig().loss, help="policy loss (algorithm.loss)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0 = torch's default)")
    parser.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS, help="peak dense TFLOP/s for MFU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    args = parser.parse_args()
    if args.batch % args.group_size or args.prompt_len >= args.seq_len:
        parser.error("--batch must be a multiple of --group-size, and --prompt-len below --seq-len")
    return args


def join_single_rank_world(device: str) -> World:
    """A one-rank world (gloo on CPU, NCCL on CUDA): FSDP2 needs a process group even alone."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()))
    return init_world(device)


def build_model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len,
        tie_word_embeddings=True, torch_dtype=args.dtype,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention_backend()).to(DTYPES[args.dtype])


def synthetic_batch(args: argparse.Namespace, vocab: int) -> TrainBatch:
    """`--batch` full-length samples (no padding) in groups of `--group-size`, random ids and rewards."""
    rng = random.Random(args.seed)
    completion = args.seq_len - args.prompt_len
    groups = []
    for g in range(args.batch // args.group_size):
        trajectories = [
            Trajectory(
                [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(args.prompt_len)],
                [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(completion)],
                [rng.uniform(*BEHAVIOUR_LOGPROB_RANGE) for _ in range(completion)],
                [0] * completion, [1] * completion, float(rng.random() < 0.5), f"g{g}", "synthetic", "length",
            )
            for _ in range(args.group_size)
        ]
        groups.append(TrajectoryGroup(f"r{g}", f"g{g}", "bench", trajectories))
    return collate(groups, pad_id=0)


def timed_steps(model: torch.nn.Module, batch: TrainBatch, args: argparse.Namespace, world: World) -> list[float]:
    """Seconds of each timed train_step, after the warm-up steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LearnerConfig().lr)
    algorithm = AlgorithmConfig(loss=args.loss)
    grad_clip = LearnerConfig().grad_clip
    seconds = []
    for index in range(args.warmup + args.steps):
        _synchronize(world)
        started = time.perf_counter()
        train_step(model, optimizer, batch, algorithm, args.micro_batch_tokens, grad_clip, world)
        _synchronize(world)
        if index >= args.warmup:
            seconds.append(time.perf_counter() - started)
    return seconds


def _synchronize(world: World) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


def report(args: argparse.Namespace, world: World, params: int, vocab: int, tokens: int, seconds: list[float]) -> dict:
    step_s = statistics.median(seconds)
    tok_s = tokens / step_s
    on_cuda = world.device.type == "cuda"
    mfu = FLOPS_PER_PARAM_TOKEN * params * tok_s / (args.peak_tflops * TERA) if on_cuda else None
    peak_gib = torch.cuda.max_memory_allocated(world.device) / GIB if on_cuda else None
    device_name = torch.cuda.get_device_name(world.device) if on_cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(f"model: hidden {args.hidden}, layers {args.layers}, heads {args.heads}/{args.kv_heads}, "
          f"intermediate {args.intermediate}, vocab {vocab}, {params / 1e6:.1f}M params, {args.dtype}, {device_name}")
    print(f"batch: {args.batch} samples x {args.seq_len} tokens ({tokens} tokens), groups of {args.group_size}, "
          f"loss {args.loss}, micro_batch_tokens {args.micro_batch_tokens}, warm-up {args.warmup} steps")
    print(f"{'step':>6} {'seconds':>9} {'tokens/s':>10}")
    for index, value in enumerate(seconds, 1):
        print(f"{index:>6} {value:>9.3f} {tokens / value:>10.0f}")
    print(f"{'median':>6} {step_s:>9.3f} {tok_s:>10.0f}" + (f"   MFU {mfu:.1%} of {args.peak_tflops:g} TFLOP/s, "
                                                             f"peak memory {peak_gib:.1f} GiB" if on_cuda else ""))
    return {"learner_tok_s": round(tok_s, 1), "mfu": None if mfu is None else round(mfu, 4), "step_s": round(step_s, 4),
            "peak_memory_gib": None if peak_gib is None else round(peak_gib, 1), "tokens_per_step": tokens,
            "params": params, "device": device_name, "loss": args.loss, "micro_batch_tokens": args.micro_batch_tokens}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    world = join_single_rank_world(args.device)
    try:
        vocab = args.vocab or len(build_char_tokenizer())
        model = build_model(args, vocab)
        params = sum(p.numel() for p in model.parameters())  # a tied head counts once
        settings = LearnerConfig(gradient_checkpointing=args.gradient_checkpointing)
        model = shard_policy(model, settings, world)
        batch = synthetic_batch(args, vocab)
        seconds = timed_steps(model, batch, args, world)
        result = report(args, world, params, vocab, batch.num_tokens(), seconds)
    finally:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
