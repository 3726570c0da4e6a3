"""The step's maths: pure tensor functions of a batch, with no process group, model loading or sockets: advantages,
policy losses and their terms, log-probs from hidden states, batching and packing into micro-batches, mini-batches,
the packed attention kernel, token staleness masks, the learning-rate schedule and the step's metrics."""
