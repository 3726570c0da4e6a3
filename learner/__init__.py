"""The learner: consumes trajectory batches, computes advantages and losses, trains with FSDP2."""
