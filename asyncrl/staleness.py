"""Staleness of a sample: how many optimizer steps behind the trained-on policy its oldest token is."""

from __future__ import annotations


def staleness(policy_version: int, oldest_version: int) -> int:
    """Learner version minus the oldest trained token version; 0 when nothing is trained (version -1)."""
    if oldest_version < 0:
        return 0
    return policy_version - oldest_version
