"""Rank 0's side of weight sync: the coordinator that invites the rollout servers to each round over the
control channel and sends the weights, and what it gathers from their telemetry."""
