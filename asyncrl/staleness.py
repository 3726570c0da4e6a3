"""The staleness rule, in one place. K (`buffer.max_staleness`) bounds when a group may start, not how long it
may run: a group starts only from weights at most K versions behind the learner, and only within admission's
window of (K + v + 1) · batch groups (AReaL's rule); once started it is trained in full, however many versions
pass while it generates, every token corrected by the loss with its own version and behaviour log-prob. So a
long response is never stopped, sampled again or dropped because its first token got old, and the learner trains
the length distribution the policy generates. An optional per-token bound M (`algorithm.max_token_staleness`)
masks out of the loss, and counts, the tokens sampled more than M versions before the step that trains them; it
never drops a sample.

Every role asks these functions; nothing else compares versions with K, so a change of the rule, or of K
during a run, has one home (a test greps for comparisons elsewhere)."""

from __future__ import annotations

TOKEN_BOUND_OFF = -1  # algorithm.max_token_staleness: no per-token bound


def staleness(policy_version: int, oldest_version: int) -> int:
    """Learner version minus the oldest trained token version; 0 when nothing is trained (version -1)."""
    if oldest_version < 0:
        return 0
    return policy_version - oldest_version


def starts_within_bound(learner_version: int, start_version: int, max_staleness: int) -> bool:
    """A group whose first tokens are sampled by the weights of `start_version` while the learner is at
    `learner_version` starts within the bound: learner version − start version ≤ K. Judged once, for the
    start; a group with no trained token (start -1) or an unknown learner version (-1) is within it."""
    return staleness(learner_version, start_version) <= max_staleness


def admission_capacity(policy_version: int, max_staleness: int, batch_groups: int, accepted: int, running: int) -> int:
    """Groups that may still start (AReaL's rule): by the time the learner reaches version v + K + 1 it will
    have consumed (v + K + 1) · batch_groups groups; the ones accepted or running already count against that,
    so generation runs at most K batches ahead of training."""
    return (max_staleness + policy_version + 1) * batch_groups - (accepted + running)


def drained_version(version: int, max_staleness: int) -> int:
    """The learner version once K + 1 batches are taken at `version` without the version moving: admission's
    window then holds no more than those batches, so they consume every group started by then, long ones
    included (the safety guard drains them so, and restores its weights as this version)."""
    return version + max_staleness + 1


def oldest_trained_token_version(policy_version: int, max_token_staleness: int) -> int | None:
    """The oldest token version a step at `policy_version` trains under the per-token bound M: older tokens
    are masked out of the loss. None when the bound is off (TOKEN_BOUND_OFF)."""
    if max_token_staleness == TOKEN_BOUND_OFF:
        return None
    return policy_version - max_token_staleness
