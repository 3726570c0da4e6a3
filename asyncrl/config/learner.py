"""The `learner` section: training loop, optimizer, micro-batching, checkpoints, weight sync cadence."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.fields import bounded, one_of


@dataclass
class LearnerConfig:
    mode: str = one_of("async", "sync")  # async: train while servers generate; sync: generate, train, sync, repeat
    nproc: int = bounded(1, 1)  # local ranks spawned by `asyncrl learner` (ignored under torchrun)
    device: str = one_of("auto", "cpu", "cuda")  # auto = cuda when available
    total_steps: int = bounded(100, 1)  # optimizer steps to run (policy version at the end)
    lr: float = bounded(1e-5, 0.0, 1.0)  # AdamW learning rate (constant after warm-up)
    warmup_steps: int = bounded(0, 0)  # linear learning-rate warm-up, in optimizer steps
    weight_decay: float = bounded(0.0, 0.0)  # AdamW decoupled weight decay
    beta1: float = bounded(0.9, 0.0, 1.0)  # AdamW first-moment decay
    beta2: float = bounded(0.999, 0.0, 1.0)  # AdamW second-moment decay
    grad_clip: float = bounded(1.0, 0.0)  # max global gradient norm (0 = no clipping)
    micro_batch_tokens: int = bounded(8192, 1)  # padded tokens per forward/backward pass; bounds activation memory
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory, ~30% more compute)
    mixed_precision: bool = True  # GPU: forward/backward in bf16 (weights cast per pass), gradients reduced in fp32 (ignored on CPU)
    master_dtype: str = one_of("float32", "bfloat16", "float16")  # the learner's weights and optimizer state; bfloat16 halves their memory but rounds away updates under ~0.4 % of a weight (lr 1e-6 trains nothing)
    sync_every: int = bounded(1, 1)  # optimizer steps between weight broadcasts to the rollout servers
    checkpoint_every: int = bounded(50, 1)  # optimizer steps between checkpoints (model, optimizer, data, buffer offset)
    keep_checkpoints: int = bounded(2, 1)  # most recent checkpoints kept on disk
    resume: str = "auto"  # auto = continue the latest checkpoint in the run dir; never; or a checkpoint path
    max_bad_steps: int = bounded(3, 1)  # consecutive non-finite losses (each step skipped) before the run stops
    batch_timeout_s: float = bounded(600.0, 0.1)  # longest wait for one batch from the buffer before failing clearly
    torch_threads: int = bounded(0, 0)  # intra-op CPU threads per rank (0 = torch's default)
