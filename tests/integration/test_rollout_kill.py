"""A rollout server killed with SIGKILL mid-generation, under the real supervisor and a real buffer
process: it is restarted after the back-off, and every prompt it had in flight reaches the buffer
exactly once (regenerated: the same prompt under the same record id), with none lost and none twice.

Real processes all the way (supervisor, server, vLLM engine, buffer), so this test starts its own
engine twice (the first server's and the restarted one's): the slowest rollout test, so it is a real job
(conftest.py), run beside the other tests on the shared tiny model, and the test reads what it left.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from transformers import AutoTokenizer

from asyncrl.buffer_process import start_buffer
from asyncrl.config import load_config
from asyncrl.data import PromptMixture, encode_prompt, write_rows
from demo.tasks import arithmetic
from launch.commands.buffer import COMMAND_LINE
from asyncrl.transport import BufferConsumer
from buffer_helpers import drain, free_port
from rollout_servers.prompt_stream import PromptStream
from rollout_servers.server_process import STATE_DIR
from rollout_servers.supervisor import supervise
from waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BACKOFF_S = 3.0  # the supervisor's first restart delay
ACKED_BEFORE_KILL = 3  # the server has delivered this many groups when it is killed
SERVER_START_S = 600  # engine start plus first groups on a loaded 2-core box
POLL_S = 0.2
ROWS = 40
SEED = 3
STATE_FILE = "server-0.prompts.json"


def write_data(path: Path) -> str:
    rows = [arithmetic.make_row(f"{i}+{i % 7}=", str(i + i % 7), i, "train") for i in range(ROWS)]
    return str(write_rows(rows, path))


def read_state(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def in_flight(state: dict) -> set[int]:
    """Prompts drawn and not acknowledged according to a server's prompt-stream state."""
    return set(range(state["watermark"], state["drawn"])) - set(state["acknowledged"])


def server_processes(supervisor: psutil.Process) -> list[psutil.Process]:
    """The supervisor's server children (spawned Python processes other than the resource tracker)."""
    servers = []
    for child in supervisor.children():
        try:
            command = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in command and "resource_tracker" not in command:
            servers.append(child)
    return servers


def kill_clock() -> float:
    """Now, on the clock of process start times. psutil derives `create_time()` from the boot time, which the
    kernel gives in whole seconds, so it can read up to 1 s early against time.time(); a process started here
    carries the same error, and start times compared with its start time are exact to a clock tick."""
    marker = psutil.Popen(["sleep", "60"])
    try:
        return marker.create_time()
    finally:
        marker.kill()
        marker.wait()


@dataclass
class KilledServer:
    """What a server killed mid-generation and restarted left: what the test checks."""
    config: Any  # the supervisor's
    restart_delay: float  # from the kill to the restarted server's start
    lost_if_not_regenerated: set[int]  # the prompts in flight at the kill
    owed_at_stop: set[int]  # drawn and unacknowledged when the supervisor was stopped
    drawn_at_stop: int
    received: list  # every group the buffer holds, in order


def killed_server_job(inputs: Path, tmp: Path) -> KilledServer:
    """The supervisor's server on the shared tiny model killed once it has delivered ACKED_BEFORE_KILL groups with
    more in flight, then restarted; the buffer's groups once the restarted server is past every prompt drawn before."""
    buffer = start_buffer(COMMAND_LINE, tmp / "buffer", log_path=tmp / "buffer.log", timeout_s=60,
                          overrides=("buffer.batch_groups=1000", "buffer.max_staleness=0"))
    try:
        config = load_config(None, [
            f"model.path={inputs / 'model'}", f"data.train_files=[{write_data(tmp / 'train.jsonl')}]",
            "data.val_files=[]", "validation.every=0", f"run.seed={SEED}",
            f"buffer.address={buffer.address}", f"rollout.weight_sync.control_address=tcp://127.0.0.1:{free_port()}",
            "rollout.max_inflight=8", "rollout.sampling.n=2", "rollout.sampling.max_tokens=24",
            "rollout.engine.dtype=float32", f"rollout.restart_backoff_s={BACKOFF_S}", "rollout.stop_timeout_s=20",
        ])
        restart_delay, lost_if_not_regenerated, at_stop = kill_and_restart(config, tmp / "run")
        received = drain(BufferConsumer(buffer.address, "learner"))
    finally:
        buffer.stop()
    return KilledServer(config, restart_delay, lost_if_not_regenerated, in_flight(at_stop), at_stop["drawn"], received)


def kill_and_restart(config: Any, run_dir: Path) -> tuple[float, set[int], dict]:
    """Run the supervisor, kill its server mid-generation, stop it once the restarted one is past every prompt drawn
    before the kill: the restart's delay, the prompts in flight at the kill and the server's last state."""
    state_path = run_dir / STATE_DIR / STATE_FILE
    supervisor_process = multiprocessing.get_context("spawn").Process(target=supervise, args=(config, run_dir, run_dir))
    supervisor_process.start()
    supervisor = psutil.Process(supervisor_process.pid)
    started = []  # every process of ours below the supervisor, for the clean-up
    try:
        (first,) = wait_until(lambda: server_processes(supervisor), SERVER_START_S, "the first server", poll_s=POLL_S)
        started += [first, *first.children(recursive=True)]
        wait_until(lambda: (s := read_state(state_path)) and s["watermark"] >= ACKED_BEFORE_KILL and in_flight(s),
                   SERVER_START_S, f"{ACKED_BEFORE_KILL} acknowledged groups with more in flight", poll_s=POLL_S)
        started += first.children(recursive=True)
        first.send_signal(signal.SIGKILL)
        killed_at = kill_clock()
        first.wait(timeout=30)
        at_kill = read_state(state_path)
        lost_if_not_regenerated = in_flight(at_kill)

        (second,) = wait_until(lambda: [p for p in server_processes(supervisor) if p.pid != first.pid],
                               SERVER_START_S, "the restarted server", poll_s=POLL_S)
        started += [second]
        restart_delay = second.create_time() - killed_at
        wait_until(lambda: read_state(state_path)["watermark"] > at_kill["drawn"], SERVER_START_S,
                   "the restarted server past every prompt drawn before the kill", poll_s=POLL_S)
        started += second.children(recursive=True)
    finally:
        os.kill(supervisor_process.pid, signal.SIGTERM)
        supervisor_process.join(60)
        for process in [supervisor, *started]:
            if process.is_running():
                process.kill()
    # Stopped mid-work, the server may leave prompts drawn and unacknowledged: its state file keeps them
    # for the next start to regenerate, so they count as owed, not as skipped.
    return restart_delay, lost_if_not_regenerated, read_state(state_path)


REAL_JOBS = [killed_server_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def killed_server(real_jobs) -> KilledServer:
    return real_jobs[killed_server_job].result()


def test_killed_server_regenerates_its_in_flight_prompts_exactly_once(killed_server, tiny_job_inputs):
    run, received = killed_server, killed_server.received
    numbers = Counter(int(group.record_id.rsplit("-", 1)[1]) for group in received)
    assert run.restart_delay >= BACKOFF_S * 0.9, "restarted only after the back-off"
    assert run.lost_if_not_regenerated, "the kill came while prompts were in flight"
    assert run.lost_if_not_regenerated <= set(numbers), "every prompt in flight at the kill was delivered"
    assert max(numbers.values()) == 1, "no prompt delivered twice"
    assert set(numbers) | run.owed_at_stop == set(range(run.drawn_at_stop)), \
        "no prompt skipped: delivered or still owed"
    # ...and prompt k is the k-th prompt of the server's stream, regenerated ones included (no re-draws)
    tokenizer = AutoTokenizer.from_pretrained(tiny_job_inputs / "model")
    expected = PromptStream(PromptMixture(run.config.data.train_files, seed=SEED, shuffle=run.config.data.shuffle))
    prompts = [expected.take(lambda rows: encode_prompt(tokenizer, next(rows)))[1] for _ in range(run.drawn_at_stop)]
    by_number = {int(g.record_id.rsplit("-", 1)[1]): g for g in received}
    assert all(by_number[k].trajectories[0].prompt_ids == prompts[k] for k in numbers)
