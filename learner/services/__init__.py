"""What the learner does beside training, facing the job (mostly on rank 0): the buffer and its supervision, sending
the weights to the rollout servers, pacing, task weights, the safety guard and validation snapshots."""
