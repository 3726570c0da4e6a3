"""Rollout servers: vLLM engines that generate continuously and take in-flight weight updates."""
