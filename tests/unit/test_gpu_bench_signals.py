"""scripts/gpu_bench.sh stopped by a signal (a command's time limit, Ctrl-C) stops its running stage's processes too,
children of children included, instead of leaving them to hold the GPU. The setup stage's first command, nvidia-smi,
is stood in for by a script that starts a grandchild and runs until it is stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from processes import alive
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # for a shell and two sleeps to start or end on a loaded box
STAND_IN = """#!/usr/bin/env bash
sleep 600 &  # the stage's job: its own children hold the GPU too
echo $! > "$PIDS/grandchild"
echo $$ > "$PIDS/child"
wait
"""


def default_stops() -> None:
    """The stop signals' default actions in the script, as a shell that starts it gives them: a signal ignored when
    bash starts cannot be trapped, and in the suite some earlier test may leave this process ignoring SIGTERM."""
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, signal.SIG_DFL)


def test_a_stopped_run_stops_its_stages_processes(tmp_path):
    bin_dir, pids = tmp_path / "bin", tmp_path / "pids"
    bin_dir.mkdir(), pids.mkdir()
    (bin_dir / "nvidia-smi").write_text(STAND_IN)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PIDS": str(pids), "OUT": str(tmp_path / "out")}
    script = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "setup"], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_stops)
    try:
        wait_until(lambda: (pids / "grandchild").is_file() and (pids / "child").is_file(), WAIT_S, "the stage's job")
        job = [int((pids / name).read_text()) for name in ("child", "grandchild")]
        script.send_signal(signal.SIGTERM)  # to the script alone, as `kill` or a supervisor sends it
        output, _ = script.communicate(timeout=WAIT_S)
        wait_until(lambda: not any(alive(pid) for pid in job), WAIT_S, "the stage's processes to end")
        assert script.returncode == 143
        assert "=== setup stopped by a signal" in output
    finally:  # nothing left behind by a failing run either
        for pid_file in pids.iterdir():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)


def test_the_unpacked_packages_are_byte_compiled_once_beside_the_stages(tmp_path):
    # a package directory on PYTHONPATH holding vllm sources without bytecode, as scripts/gpu_pack.sh ships them
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    for number in range(20):
        (site / "vllm" / f"module{number}.py").write_text(f"VALUE = {number}\n")
    env = os.environ | {"PYTHONPATH": str(site), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "no_such_stage"], env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=default_stops)
    assert f"=== byte-compiling {site} beside the stages" in done.stdout
    assert len(list((site / "vllm" / "__pycache__").glob("module*.pyc"))) == 20  # done before the script ended
    again = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "no_such_stage"], env=env,
                           capture_output=True, text=True, timeout=120, preexec_fn=default_stops)
    assert "byte-compiling" not in again.stdout  # compiled already: not again
