"""What a server asks buffer admission for, and what it reports with each ask.

A server asks for the prompt groups that fit its free sample slots plus places for the chat sessions
waiting to open, and reports the groups finished since its last ask and those still running, counting
the grants its open chat sessions hold as running (they stay within the staleness bound until closed).
"""

from __future__ import annotations

from rollout_servers.chat.admission import ChatAdmission
from rollout_servers.sample_slots import SampleSlots


class AdmissionAsks:
    def __init__(self, slots: SampleSlots, chat_places: ChatAdmission, group_size: int) -> None:
        self.slots = slots  # the server's capacity in samples
        self.chat_places = chat_places  # chat sessions' share of admission
        self.group_size = group_size  # rollout.sampling.n
        self._finished_since_ask = 0

    def group_finished(self) -> None:
        """A prompt group was sent and acknowledged: reported with the next ask."""
        self._finished_since_ask += 1

    def wanted(self, running: int) -> int:
        """Groups to ask for while `running` prompt groups are not done."""
        return self.slots.free_groups(self.group_size, running) + self.chat_places.wanted()

    def ask(self, wanted: int, running: int) -> tuple[int, int, int]:
        """The (wanted, finished, running) arguments of the next admission request; the finished count
        starts again from 0."""
        finished, self._finished_since_ask = self._finished_since_ask, 0
        return max(wanted, 0), finished, running + self.chat_places.held
