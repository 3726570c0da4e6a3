"""Trajectory buffer service: durable log, staleness policy, admission and batching over ZeroMQ."""
