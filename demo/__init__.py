"""The embedded default job's parts: the tiny Qwen2-architecture model with its character tokenizer and
warm start, and the synthetic tasks (arithmetic, scratchpad, calculator, guess_number) that it learns."""
