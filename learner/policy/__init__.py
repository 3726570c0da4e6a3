"""The policy and its memory: the sharded model (with LoRA adapters and activation checkpointing), its optimizer and
the learner step that trains it on every rank, GPU memory sizing, checkpoints and their export."""
