"""The `learner` section: training loop, optimizer, micro-batching, checkpoints, weight sync cadence."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.config.fields import bounded, one_of

AUTO = "auto"


@dataclass
class LearnerConfig:
    mode: str = one_of("async", "synchronous")  # async: train while servers generate; synchronous: the reference, each of the nproc ranks owning an engine and an FSDP shard of the policy on its GPU (generate, train, load weights, repeat)
    nproc: int = bounded(1, 1)  # local ranks spawned by `asyncrl learner` (ignored under torchrun)
    gpus: list[int] = field(default_factory=list)  # GPU ids of the local ranks, one each; empty = `asyncrl run` splits the visible GPUs, a lone `asyncrl learner` uses what it sees (docs/placement.md)
    device: str = one_of("auto", "cpu", "cuda")  # auto = cuda when available
    total_steps: int = bounded(100, 1)  # learner steps to run, one batch and one policy version each (the version at the end); a step takes algorithm.mini_batches × epochs optimizer steps
    lr: float = bounded(1e-5, 0.0, 1.0)  # AdamW peak learning rate (reached at the end of the warm-up)
    warmup_steps: int = bounded(0, 0)  # linear learning-rate warm-up from lr/warmup_steps to lr, in learner steps (every optimizer step of a batch runs at its batch's rate)
    lr_schedule: str = one_of("constant", "cosine")  # after the warm-up: constant lr, or cosine decay to min_lr_ratio * lr at total_steps
    min_lr_ratio: float = bounded(0.0, 0.0, 1.0)  # cosine: the rate the decay reaches at total_steps, as a share of lr (the last step run, total_steps - 1, is one decay step above it)
    weight_decay: float = bounded(0.0, 0.0)  # AdamW decoupled weight decay
    beta1: float = bounded(0.9, 0.0, 1.0)  # AdamW first-moment decay
    beta2: float = bounded(0.999, 0.0, 1.0)  # AdamW second-moment decay
    grad_clip: float = bounded(1.0, 0.0)  # max global gradient norm (0 = no clipping)
    micro_batch_tokens: str = AUTO  # tokens per forward/backward pass (packed: real tokens; padded: rows x longest row); auto = the largest that fits the learner's part of the GPU (run.gpu_memory_gib), measured at start (8192 on CPU)
    packing: str = one_of(AUTO, "always", "never")  # samples back to back in one sequence (no padding FLOPs); auto = on GPU, padded on CPU
    activation_checkpointing: str = one_of(AUTO, "none", "selective", "full")  # recompute in backward: selective = elementwise ops only, full = whole layers (least memory, ~1/3 more compute); auto = the cheapest of none < selective < full whose passes fit the learner's part of the GPU, measured at start (none on CPU)
    compile: bool = False  # torch.compile each decoder layer (first steps slower while it compiles)
    cpu_offload: bool = False  # GPU: keep sharded weights, gradients and optimizer state in CPU memory (largest models; slower steps)
    mixed_precision: bool = True  # GPU: forward/backward in bf16 (weights cast per pass), gradients reduced in fp32 (ignored on CPU)
    master_dtype: str = one_of("float32", "bfloat16", "float16")  # the learner's weights and optimizer state; bfloat16 halves their memory but rounds away updates under ~0.4 % of a weight (lr 1e-6 trains nothing)
    sync_every: int = bounded(1, 1)  # learner steps (batches) between weight broadcasts to the rollout servers
    checkpoint_every: int = bounded(50, 1)  # learner steps (batches) between checkpoints (model, optimizer, data, buffer offset)
    keep_checkpoints: int = bounded(2, 1)  # most recent checkpoints kept on disk
    resume: str = "auto"  # auto = continue the latest checkpoint in the run dir; never; or a checkpoint path
    max_bad_steps: int = bounded(3, 1)  # consecutive non-finite losses (each step skipped) before the run stops
    batch_timeout_s: float = bounded(600.0, 0.1)  # longest wait for one batch from the buffer before failing clearly
    torch_threads: int = bounded(0, 0)  # intra-op CPU threads per rank (0 = torch's default)

    def micro_batch_budget(self) -> int | None:
        """`micro_batch_tokens` as a number, None for auto."""
        return None if self.micro_batch_tokens == AUTO else int(self.micro_batch_tokens)

    def packs(self, on_gpu: bool) -> bool:
        """Whether micro-batches are packed: `packing`, with auto meaning on a GPU."""
        return self.packing == "always" or (self.packing == AUTO and on_gpu)

    def cross_checks(self) -> list[tuple[str, str]]:
        problems = []
        value = self.micro_batch_tokens
        if value != AUTO and not (value.isdigit() and int(value) > 0):
            problems.append(("learner.micro_batch_tokens", f"'{value}' is neither 'auto' nor a positive number of tokens"))
        return problems
