"""asyncrl: asynchronous RL post-training for LLMs. Generation never waits for training."""

__version__ = "0.1.0"
