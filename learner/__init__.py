"""The learner role: FSDP2 training with importance-corrected PPO, weight broadcast, checkpoints."""
