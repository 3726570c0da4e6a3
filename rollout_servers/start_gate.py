"""Where a server applies the staleness rule: the start of a group, the one moment it is judged.

A group may start only while the server's weights are at most K versions behind the learner, both as the
server's latest admission answer gives them (`asyncrl/staleness.py`); once started it runs to its end and is
trained in full. Groups admitted while the weights lag (an update failed, or a restarted server has not caught
up yet), and those a restarted server owes from its previous process, wait here, still counted as running by
admission, until the weights are within the bound again.
"""

from __future__ import annotations

from typing import Protocol

from asyncrl.messages import AdmissionGrant
from asyncrl.staleness import starts_within_bound


class Weights(Protocol):
    """What the gate reads of the engine."""

    @property
    def current_version(self) -> int: ...

    @property
    def needs_catch_up(self) -> bool: ...


class StartGate:
    def __init__(self, owed: int) -> None:
        self.waiting = owed  # groups admitted and not started yet (at first: those the previous process owes)

    def is_open(self, grant: AdmissionGrant, weights: Weights) -> bool:
        """A group may start now: the weights are complete and within K (the grant's) of its learner version."""
        return not weights.needs_catch_up and starts_within_bound(grant.policy_version, weights.current_version,
                                                                  grant.max_staleness)

    def admit(self, granted: int) -> None:
        """`granted` more groups may start once the gate is open."""
        self.waiting += granted

    def release(self, grant: AdmissionGrant, weights: Weights) -> int:
        """How many groups start now: every waiting one while the gate is open, none while it is shut."""
        if not self.is_open(grant, weights):
            return 0
        released, self.waiting = self.waiting, 0
        return released
