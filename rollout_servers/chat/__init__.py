"""The OpenAI-compatible chat-completions endpoint of a rollout server: requests, sessions, streaming, tool
calls, admission and API keys (docs/multi_turn.md)."""
