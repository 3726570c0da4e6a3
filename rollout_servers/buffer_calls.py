"""The one path of a rollout server's requests to its buffer: prompt groups, chat groups and admission asks alike.

Each request runs in a thread (the buffer's sockets block), one at a time (ZeroMQ sockets are not thread-safe), and
is made again while the buffer does not answer: its learner is away, and the server waits for it (`LearnerWait`).
A request stays counted until its thread is done, even when the task that made it was cancelled, so that a server
that leaves returns only once nothing is being sent any more (`stop`); after that no request is made.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable, TypeVar

from asyncrl.transport import BufferTimeout
from rollout_servers.learner_wait import LearnerWait

_T = TypeVar("_T")


class ServerStopping(RuntimeError):
    """The server is leaving: it sends nothing more to the buffer."""


class BufferCalls:
    def __init__(self, learner_wait: LearnerWait) -> None:
        self._learner_wait = learner_wait
        self._lock = threading.Lock()  # one request at a time on the buffer's sockets
        self._threads = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="buffer-io")
        self._running: set[concurrent.futures.Future] = set()  # requests whose thread may still run
        self._stopped = False

    async def call(self, request: Callable[..., _T], *args: object) -> _T:
        """`request(*args)` in a thread, made again while the buffer does not answer (BufferTimeout); its answer.
        LearnerMoved or LearnerFinished when the learner came back elsewhere or finished meanwhile; ServerStopping
        once `stop` began."""
        while True:
            if self._stopped:
                raise ServerStopping("the server is leaving: nothing more is sent to the buffer")
            running = self._threads.submit(self._locked, request, *args)
            self._running.add(running)
            try:
                answer = await asyncio.wrap_future(running)
            except BufferTimeout as error:
                self._learner_wait.silent(error)
                continue
            finally:
                if running.done():  # else its thread still runs it, cancelled or not: `stop` waits for it
                    self._running.discard(running)
            self._learner_wait.answered()
            return answer

    async def stop(self, timeout_s: float) -> None:
        """Make no new request, and wait up to `timeout_s` for those still running in their threads."""
        self._stopped = True
        running = [call for call in self._running if not call.done()]
        await asyncio.to_thread(concurrent.futures.wait, running, timeout_s)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _locked(self, request: Callable[..., _T], *args: object) -> _T:
        with self._lock:
            return request(*args)
