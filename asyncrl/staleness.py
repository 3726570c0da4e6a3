"""The staleness rule, in one place: how stale a sample is, whether it may still be trained, how many groups
admission may let run, and when a server's weights lag too far to start new samples. Every role asks these
functions; nothing else compares versions with `buffer.max_staleness` (K), so a change of the rule, or of K
during a run, has one home (a test greps for comparisons elsewhere)."""

from __future__ import annotations


def staleness(policy_version: int, oldest_version: int) -> int:
    """Learner version minus the oldest trained token version; 0 when nothing is trained (version -1)."""
    if oldest_version < 0:
        return 0
    return policy_version - oldest_version


def trainable(policy_version: int, oldest_version: int, max_staleness: int) -> bool:
    """A sample whose oldest token is `oldest_version` may be trained at `policy_version`: staleness ≤ K."""
    return staleness(policy_version, oldest_version) <= max_staleness


def admission_capacity(policy_version: int, max_staleness: int, batch_groups: int, accepted: int, running: int) -> int:
    """Groups that may still start so that none can be staler than K when trained (AReaL's rule): by the time
    the learner reaches version v + K + 1, it will have consumed (v + K + 1) · batch_groups groups; the ones
    accepted or running already count against that."""
    return (max_staleness + policy_version + 1) * batch_groups - (accepted + running)


def weights_lag(learner_version: int, weights_version: int, max_staleness: int) -> bool:
    """A server holding `weights_version` is too far behind the learner to start samples that could be trained."""
    return not trainable(learner_version, weights_version, max_staleness)
