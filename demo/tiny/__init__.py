"""The tiny default policy: a Qwen2-architecture model with a character-level tokenizer, built locally."""
