"""The learner role: FSDP2 training with importance-corrected PPO, weight broadcast, checkpoints.

Its rooms, each standing on those before it: `maths/` (the step's pure tensor maths), `policy/` (the sharded model,
the train step, memory, checkpoints, export), `services/` and `weight_sync/` (what rank 0 does facing the job).
Here: the entry point (`main.py`), the loop that composes the rooms, its state, and the process group."""
