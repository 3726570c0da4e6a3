"""A pool of spawned scoring processes with a deadline on every call.

One dispatcher thread owns the workers. It hands queued requests to idle workers, collects results,
and kills a worker whose call runs past its deadline, failing that request and starting a replacement
so that the pool keeps its capacity. Processes rather than threads: math-verify times itself out with
signals, which work only in a process's main thread, and only a process can be stopped mid-call.
The spawn start method is used because fork is unsafe in processes that run CUDA or vLLM.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import SpawnContext
from multiprocessing.reduction import ForkingPickler
from typing import Any

from rollout_servers.rewards.results import RewardRequest, RewardResult, describe_exception
from rollout_servers.rewards.terms import RewardSpec
from rollout_servers.rewards.worker import STOP, WorkerReady, WorkerStartFailed, worker_main

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # spawn plus imports (sympy, math-verify) take seconds on a loaded 2-core machine
WORKER_STOP_GRACE_S = 2.0  # an idle worker asked to stop exits at once; one still alive after this is killed
_WAKE_BYTE = b"w"
_WAKE_READ_BYTES = 4096


class WorkerStartError(RuntimeError):
    """The scoring workers could not be started; the message holds the worker's own error."""


@dataclass
class _Task:
    payload: bytes  # the pickled RewardRequest
    future: Future[RewardResult]


class _Worker:
    """The pool's handle on one scoring process and the call it is running."""

    def __init__(self, context: SpawnContext, name: str, spec: RewardSpec) -> None:
        self.name = name
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=worker_main, args=(child_conn, spec), name=name, daemon=True
        )
        self.process.start()
        child_conn.close()  # only the worker holds its end now, so the worker's death reads as EOF here
        self.ready = False
        self.task: _Task | None = None
        self.deadline = time.monotonic() + WORKER_START_TIMEOUT_S  # for loading the function, then per call

    def mark_ready(self) -> None:
        self.ready = True
        self.deadline = math.inf

    @property
    def idle(self) -> bool:
        return self.ready and self.task is None

    def start_task(self, task: _Task, timeout_s: float) -> None:
        self.conn.send_bytes(task.payload)
        self.task = task
        self.deadline = time.monotonic() + timeout_s

    def finish_task(self) -> _Task | None:
        task, self.task, self.deadline = self.task, None, math.inf
        return task

    def exit_code(self) -> int | None:
        self.process.join(WORKER_STOP_GRACE_S)
        return self.process.exitcode

    def stop(self) -> None:
        """Ask an idle worker to exit; kill it if it is busy or starting, or does not exit in time."""
        if self.idle:
            try:
                self.conn.send(STOP)
                self.process.join(WORKER_STOP_GRACE_S)
            except OSError:  # already gone
                pass
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(WORKER_STOP_GRACE_S)
        self.conn.close()


class ScoringPool:
    """`num_workers` scoring processes running the reward `spec` describes, each call bounded by `timeout_s`.

    `submit` never blocks on scoring and its future always completes: with the function's result, or
    with a failure (exception, timeout, dead worker, pool closed).
    """

    def __init__(self, spec: RewardSpec, num_workers: int, timeout_s: float, wait_ready: bool = True) -> None:
        """`wait_ready`: return once the workers are ready (`wait_ready()`); False returns as soon as they are
        spawned, and requests wait in the queue until `wait_ready()` is called (the workers import meanwhile)."""
        self._context = multiprocessing.get_context("spawn")
        self._spec = spec
        self._timeout_s = timeout_s
        self._names = (f"asyncrl-reward-{index}" for index in itertools.count())
        self._pending: deque[_Task] = deque()
        self._lock = threading.Lock()  # guards _pending, _closing and the wake pipe
        self._closing = False
        self._last_start_error = ""
        self._wake_reader, self._wake_writer = self._open_wake_pipe()
        self._workers: list[_Worker] = []
        self._thread: threading.Thread | None = None  # the dispatcher, once the workers are ready
        try:
            self._workers += [self._spawn() for _ in range(num_workers)]
        except BaseException:
            self._abandon()
            raise
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every worker has loaded the reward function, then start handing out requests; raise
        WorkerStartError with a worker's own error (the pool is closed then). Does nothing once the pool runs."""
        if self._thread is not None:
            return
        try:
            self._await_workers()
        except BaseException:
            self._abandon()
            raise
        self._thread = threading.Thread(target=self._dispatch_loop, name="asyncrl-reward-dispatch", daemon=True)
        self._thread.start()

    def submit(self, request: RewardRequest) -> Future[RewardResult]:
        """Queue one request; the future completes when it is scored or has failed."""
        future: Future[RewardResult] = Future()
        try:
            # pickled here, in the caller, so that a request that cannot be sent fails alone
            payload = bytes(ForkingPickler.dumps(request))
        except Exception as error:
            error_text = f"request cannot be sent to a worker: {describe_exception(error)}"
            future.set_result(RewardResult.failure(error_text))
            return future
        with self._lock:
            if self._closing:
                raise RuntimeError("the reward scoring pool is closed")
            self._pending.append(_Task(payload, future))
            self._wake()
        return future

    def close(self) -> None:
        """Fail what is still queued or running, stop the workers and the dispatcher. Idempotent."""
        if self._thread is None:  # never ready: no dispatcher to stop them
            self._abandon()
            return
        with self._lock:
            if not self._closing:
                self._closing = True
                self._wake()
        self._thread.join(WORKER_STOP_GRACE_S * (len(self._workers) + 1))
        if self._thread.is_alive():
            logger.warning("reward dispatcher did not stop within its grace period")
            return
        with self._lock:
            self._close_wake_pipe()

    # ------------------------------------------------------------------------------------------
    # Starting workers

    def _spawn(self) -> _Worker:
        return _Worker(self._context, next(self._names), self._spec)

    def _await_workers(self) -> None:
        """Block until each spawned worker has loaded the reward function; raise with its error."""
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while starting := [worker for worker in self._workers if not worker.ready]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerStartError(f"reward workers not ready after {WORKER_START_TIMEOUT_S:g}s")
            for conn in wait([worker.conn for worker in starting], timeout=remaining):
                self._receive_start_message(next(worker for worker in starting if worker.conn is conn))

    def _abandon(self) -> None:
        """Before any dispatching (a failed start, or closed unused): fail what was queued, kill the workers,
        close the wake pipe. Idempotent."""
        with self._lock:
            if self._wake_reader < 0:
                return
            self._closing = True
        self._fail_pending("the reward scoring pool is closed")
        for worker in self._workers:
            worker.kill()
        self._workers.clear()
        with self._lock:
            self._close_wake_pipe()

    def _receive_start_message(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError) as error:
            exit_code = worker.exit_code()
            why = f"exited while starting (exit code {exit_code})"
            raise WorkerStartError(f"reward worker {worker.name} {why}") from error
        if isinstance(message, WorkerStartFailed):
            raise WorkerStartError(f"reward worker {worker.name} could not load the reward function: {message.error}")
        if isinstance(message, WorkerReady):
            worker.mark_ready()

    # ------------------------------------------------------------------------------------------
    # The dispatcher thread

    def _dispatch_loop(self) -> None:
        reason = "the reward scoring pool is closed"
        try:
            while not self._closing:
                self._start_pending_tasks()
                ready = wait(self._watched(), timeout=self._seconds_to_next_deadline())
                self._drain_wakeups(ready)
                for worker in list(self._workers):
                    self._service(worker, ready)
                self._expire_overdue()
                self._fail_pending_if_no_workers()
        except Exception as error:  # a bug here must not leave callers waiting forever
            logger.exception("reward dispatcher failed")
            reason = f"reward dispatcher failed: {error}"
        finally:
            self._shut_down(reason)

    def _start_pending_tasks(self) -> None:
        for worker in self._workers:
            if not worker.idle:
                continue
            task = self._next_task()
            if task is None:
                return
            try:
                worker.start_task(task, self._timeout_s)
            except OSError:  # the worker died since its last message: requeue; its EOF is handled next
                with self._lock:
                    self._pending.appendleft(task)

    def _next_task(self) -> _Task | None:
        """The oldest queued task whose caller still wants it (cancelled futures are dropped)."""
        with self._lock:
            while self._pending:
                task = self._pending.popleft()
                # a task requeued after a failed hand-over is already marked running
                if task.future.running() or task.future.set_running_or_notify_cancel():
                    return task
        return None

    def _watched(self) -> list[Any]:
        handles: list[Any] = [self._wake_reader]
        for worker in self._workers:
            handles += [worker.conn, worker.process.sentinel]
        return handles

    def _seconds_to_next_deadline(self) -> float | None:
        deadline = min((worker.deadline for worker in self._workers), default=math.inf)
        return None if deadline == math.inf else max(0.0, deadline - time.monotonic())

    def _service(self, worker: _Worker, ready: list[Any]) -> None:
        """Take a worker's message, or notice its death. A dying worker's last message is read first."""
        if worker.conn in ready:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                self._on_death(worker)
                return
            self._on_message(worker, message)
        elif worker.process.sentinel in ready:
            self._on_death(worker)

    def _on_message(self, worker: _Worker, message: Any) -> None:
        if isinstance(message, RewardResult):
            task = worker.finish_task()
            if task is not None:
                task.future.set_result(message)
        elif isinstance(message, WorkerReady):
            worker.mark_ready()
        elif isinstance(message, WorkerStartFailed):
            # not replaced: a replacement would fail the same way, again and again
            logger.error("reward worker %s could not start: %s", worker.name, message.error)
            self._last_start_error = message.error
            self._remove(worker)

    def _on_death(self, worker: _Worker) -> None:
        exit_code = worker.exit_code()
        if not worker.ready:
            logger.error("reward worker %s exited while starting (exit code %s)", worker.name, exit_code)
            self._last_start_error = f"worker exited while starting (exit code {exit_code})"
            self._remove(worker)
            return
        logger.warning("reward worker %s died (exit code %s); replacing it", worker.name, exit_code)
        self._fail_task(worker, f"reward worker died (exit code {exit_code})")
        self._replace(worker)

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.deadline > now:
                continue
            if worker.ready:
                logger.warning("reward call on %s ran past %gs; replacing the worker", worker.name, self._timeout_s)
                self._fail_task(worker, f"timeout after {self._timeout_s:g}s")
                self._replace(worker)
            else:
                logger.error("reward worker %s not ready after %gs", worker.name, WORKER_START_TIMEOUT_S)
                self._last_start_error = f"worker not ready after {WORKER_START_TIMEOUT_S:g}s"
                self._remove(worker)

    def _fail_pending_if_no_workers(self) -> None:
        if not self._workers:
            self._fail_pending(f"no reward workers left: {self._last_start_error}")

    def _fail_task(self, worker: _Worker, error: str) -> None:
        task = worker.finish_task()
        if task is not None:
            task.future.set_result(RewardResult.failure(error))

    def _fail_pending(self, error: str) -> None:
        while (task := self._next_task()) is not None:
            task.future.set_result(RewardResult.failure(error))

    def _replace(self, worker: _Worker) -> None:
        self._remove(worker)
        try:
            self._workers.append(self._spawn())
        except OSError as error:  # out of processes or memory: run on with fewer workers
            logger.error("cannot start a replacement reward worker: %s", error)
            self._last_start_error = f"cannot start a worker: {describe_exception(error)}"

    def _remove(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def _shut_down(self, reason: str) -> None:
        with self._lock:
            self._closing = True  # from now on submit() refuses, so nothing is queued behind this
        self._fail_pending(reason)
        for worker in self._workers:
            worker.stop()
            self._fail_task(worker, reason)

    # ------------------------------------------------------------------------------------------
    # Waking the dispatcher: a byte on a non-blocking pipe that it watches with the workers

    @staticmethod
    def _open_wake_pipe() -> tuple[int, int]:
        reader, writer = os.pipe()
        os.set_blocking(reader, False)
        os.set_blocking(writer, False)
        return reader, writer

    def _close_wake_pipe(self) -> None:
        if self._wake_reader >= 0:
            os.close(self._wake_reader)
            os.close(self._wake_writer)
            self._wake_reader = self._wake_writer = -1

    def _wake(self) -> None:
        try:
            os.write(self._wake_writer, _WAKE_BYTE)
        except BlockingIOError:  # the pipe is full of wake-ups the dispatcher has yet to read
            pass

    def _drain_wakeups(self, ready: list[Any]) -> None:
        if self._wake_reader not in ready:
            return
        try:
            while os.read(self._wake_reader, _WAKE_READ_BYTES):
                pass
        except BlockingIOError:
            pass
