"""A rollout server killed with SIGKILL mid-generation, under the real supervisor and a real buffer
process: it is restarted after the back-off, and every prompt it had in flight reaches the buffer
exactly once (regenerated: the same prompt under the same record id), with none lost and none twice.

Real processes all the way (supervisor, server, vLLM engine, buffer), so this test starts its own
engine twice (the first server's and the restarted one's): the slowest rollout test.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from collections import Counter
from pathlib import Path

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.data import PromptMixture, encode_prompt, write_rows
from demo.tasks import arithmetic
from asyncrl.transport import BufferConsumer
from buffer_helpers import drain, free_port
from rollout_servers.prompt_stream import PromptStream
from rollout_servers.supervisor import STATE_DIR, supervise
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


def test_killed_server_regenerates_its_in_flight_prompts_exactly_once(tmp_path, buffer_process, tiny_models):
    buffer = buffer_process("buffer.batch_groups=1000", "buffer.max_staleness=0")
    run_dir = tmp_path / "run"
    config = load_config(None, [
        f"model.path={tiny_models.served_dir}", f"data.train_files=[{write_data(tmp_path / 'train.jsonl')}]",
        "data.val_files=[]", "validation.every=0", f"run.seed={SEED}",
        f"buffer.address={buffer.address}", f"rollout.weight_sync.control_address=tcp://127.0.0.1:{free_port()}",
        "rollout.max_inflight=8", "rollout.sampling.n=2", "rollout.sampling.max_tokens=24",
        "rollout.engine.dtype=float32", f"rollout.restart_backoff_s={BACKOFF_S}", "rollout.stop_timeout_s=20",
    ])
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
    at_stop = read_state(state_path)
    owed_at_stop, drawn_at_stop = in_flight(at_stop), at_stop["drawn"]

    received = drain(BufferConsumer(buffer.address, "learner"))
    numbers = Counter(int(group.record_id.rsplit("-", 1)[1]) for group in received)
    assert restart_delay >= BACKOFF_S * 0.9, "restarted only after the back-off"
    assert lost_if_not_regenerated, "the kill came while prompts were in flight"
    assert lost_if_not_regenerated <= set(numbers), "every prompt in flight at the kill was delivered"
    assert max(numbers.values()) == 1, "no prompt delivered twice"
    assert set(numbers) | owed_at_stop == set(range(drawn_at_stop)), "no prompt skipped: delivered or still owed"
    # ...and prompt k is the k-th prompt of the server's stream, regenerated ones included (no re-draws)
    expected = PromptStream(PromptMixture(config.data.train_files, seed=SEED, shuffle=config.data.shuffle))
    prompts = [expected.take(lambda rows: encode_prompt(tiny_models.tokenizer, next(rows)))[1]
               for _ in range(drawn_at_stop)]
    by_number = {int(g.record_id.rsplit("-", 1)[1]): g for g in received}
    assert all(by_number[k].trajectories[0].prompt_ids == prompts[k] for k in numbers)
