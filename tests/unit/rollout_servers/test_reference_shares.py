"""Colocated synchronous ranks (`learner.mode=synchronous`, `learner.nproc` > 1): which of a step's prompts each rank
samples (`rank_share`). The shares, joined in rank order, are the step's prompts in stream order, each once: the batch
one rank would have sampled."""

import pytest

from rollout_servers.reference_sampler import rank_share


@pytest.mark.parametrize(("count", "ranks", "expected"), [
    (4, 1, [[0, 1, 2, 3]]),  # one rank samples the whole step, as the one-process reference does
    (4, 2, [[0, 1], [2, 3]]),
    (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (5, 2, [[0, 1, 2], [3, 4]]),  # 5 = 2·2 + 1: rank 0 takes the one left over
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
    (10, 4, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),  # 10 = 4·2 + 2: ranks 0 and 1 take one more
    (3, 3, [[0], [1], [2]]),
])
def test_each_rank_samples_a_consecutive_share_and_together_they_sample_the_step_once(count, ranks, expected):
    shares = [list(rank_share(count, rank, ranks)) for rank in range(ranks)]
    assert shares == expected
    assert [place for share in shares for place in share] == list(range(count))
