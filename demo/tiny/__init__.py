"""The tiny default policy: a Qwen2-architecture model built locally, on a character-level tokenizer or Qwen3's
real tokenizer fetched at setup (`model.tiny.tokenizer`)."""
