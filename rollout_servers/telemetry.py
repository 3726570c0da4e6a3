"""A rollout server's reports to the learner: its counters (`ServerTelemetry`) and its latest validation pass
(`ValidationResult`), on a socket and a task of their own. The sync client's loop is busy for the whole of a weight-sync round (a server's update takes
its pause, a failing round up to the round's deadline); counters that rode its heartbeats stopped then,
just when the learner's metrics should show the servers' pause."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Sequence

from asyncrl.messages import encode
from asyncrl.transport.control import connect_control
from asyncrl.weight_transfer.control_messages import ServerTelemetry, ValidationResult

Report = ServerTelemetry | ValidationResult
LAST_REPORT_S = 1.0  # how long a stopping server tries to send its last reports


class TelemetrySender:
    def __init__(self, address: str, period_s: float, read: Callable[[], Sequence[Report]], curve_dir: str = "") -> None:
        """Sends the reports `read()` returns to the coordinator at `address` every `period_s`; `curve_dir`: the job's
        CURVE keys."""
        self.period_s, self.read = period_s, read
        self.socket = connect_control(address, curve_dir)

    async def run(self) -> None:
        """Send until cancelled."""
        while True:
            await self.send()
            await asyncio.sleep(self.period_s)

    async def send(self) -> None:
        for report in self.read():
            await self.socket.send(encode(report))

    async def send_last(self) -> None:
        """Send the reports once more, as a server stops (its counters now hold the work its stop threw away); given up
        after `LAST_REPORT_S` when the learner is away (a send with no one to take it waits)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.send(), LAST_REPORT_S)

    def close(self) -> None:
        self.socket.close()
