"""The time-to-score race's records in --out-dir: each run's launch and engine start, the ceiling, their archive."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from asyncrl.learner_plan import PLAN_FILE
from asyncrl.metrics import METRICS_FILE
from launch.mps import LOG_DIR as MPS_LOG_DIR, SERVING_FILE as MPS_SERVING_FILE
from asyncrl.snapshots import EVALUATION_FILE, INDEX_FILE, SNAPSHOTS_DIR
from asyncrl.whole_files import write_json_whole

RUN_PREFIX = "tts-"  # every run directory's name starts with it (Mode.run_name)
# what --archive keeps of a run (the learner's plan: its `auto` settings as resolved, which `asyncrl tune` advises from)
RECORDS = ("config.yaml", METRICS_FILE, EVALUATION_FILE, f"{SNAPSHOTS_DIR}/{INDEX_FILE}", PLAN_FILE)
LAUNCH_SUFFIX = ".launch.json"  # beside each run directory: when the bench launched it (Unix time), on how many GPUs
GPU_FACTS = "name,power.limit,clocks.max.sm"  # nvidia-smi's fields recorded per GPU of the host a run launches on
GPU_QUERY_TIMEOUT_S = 20
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")  # one per boot of the machine's kernel
CPUINFO_FILE = Path("/proc/cpuinfo")
CPU_STAT_FILE = Path("/proc/stat")  # the kernel's CPU time counters since boot, in ticks; its first line: all CPUs
CPU_TIMES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")  # that line's first fields, in order
CEILING = "ceiling"  # in --modes: measure the engine kept full (scripts/engine_ceiling.py) into CEILING_FILE
CEILING_FILE = "ceiling.json"  # in --out-dir
ENGINE_LOGS = ("reference*.log", "rollout[0-9]*.log")  # the logs of the roles that start an engine (logs/ of a run)
ENGINE_STARTED = re.compile(r"vLLM engine on \S+ started in ([0-9.]+)s")  # rollout_servers.engine's line
LOGGED_AT = re.compile(r"^(\d\d):(\d\d):(\d\d) ")  # a role's log line begins with its local time of day
DAY_S = 24 * 3600
# what add_log_readings adds to a run's launch record once it ends (cpu_shares the last two)
LOG_READINGS = ("engine_start_s", "engine_begins_s", "under_mps", "cpu_busy_share", "cpu_steal_share")

Launch = dict[str, Any]


def write_launch(root: Path, name: str, start_weights: str | None, gpus: int, steps: int) -> Launch:
    """Record the launch of run `name` on `gpus` GPUs for `steps` steps now, before it starts: its curve's clock runs
    from this time; its steps bound its due validations (a pace runs sync for half as many steps as async);
    `start_weights` is the digest of the model it starts from (`weights_sha256` of init-model's report), to tell
    whether two runs prepared on different hosts started from the same weights; `host`, the machine it runs on;
    `cpu_ticks`, the host's CPU time counters now (`add_log_readings` reads the run's share of them)."""
    launch = {"time": time.time(), "gpus": gpus, "steps": steps, "start_weights": start_weights, "host": host_facts(),
              "cpu_ticks": cpu_ticks()}
    write_json_whole(_launch_file(root, name), launch)  # a race stopped meanwhile leaves the old record or this one
    return launch


def host_facts() -> dict[str, Any]:
    """The machine a run launches on: its name, the kernel's boot id (containers on one machine share it, a container's
    name need not tell two machines apart), CPU model and count, and each GPU's name, power limit (W) and largest SM
    clock (MHz) as nvidia-smi reads them (none without it). Two sessions' hosts of one GPU model can run the same job
    at different paces (docs/benchmarks.md): the race compares modes run on one machine (`same_host`)."""
    return {"name": socket.gethostname(), "boot_id": _read_text(BOOT_ID_FILE), "cpu": _cpu_model(),
            "cpus": os.cpu_count(), "gpus": _gpu_facts()}


def machine_of(launch: Launch) -> str | None:
    """What tells the machine of a launch record apart: its boot id, else its host name (None in older records)."""
    host = launch.get("host", {})
    return host.get("boot_id") or host.get("name")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpu_model() -> str | None:
    lines = (_read_text(CPUINFO_FILE) or "").splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def _gpu_facts() -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_FACTS}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def cpu_ticks() -> dict[str, int] | None:
    """The host's CPU time counters (ticks since boot, all CPUs together) by name; None where /proc/stat is not read."""
    first_line = (_read_text(CPU_STAT_FILE) or "").partition("\n")[0].split()
    if first_line[:1] != ["cpu"] or len(first_line) <= len(CPU_TIMES):
        return None
    return dict(zip(CPU_TIMES, map(int, first_line[1:])))


def cpu_shares(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float | None]:
    """The host's CPU time between two readings of `cpu_ticks`: the share its processes ran (`cpu_busy_share`) and the
    share a virtual machine's hypervisor gave to other guests (`cpu_steal_share`, time this host's CPUs were ready to
    run but not running). Why one host of a GPU model runs a job at another's pace, where its recorded facts agree."""
    spent = {name: after[name] - before[name] for name in CPU_TIMES} if before and after else {}
    total = sum(spent.values())
    if total <= 0:  # a counter not read, or no time between the readings
        return {"cpu_busy_share": None, "cpu_steal_share": None}
    busy = total - spent["idle"] - spent["iowait"] - spent["steal"]
    return {"cpu_busy_share": round(busy / total, 3), "cpu_steal_share": round(spent["steal"] / total, 3)}


def add_log_readings(root: Path, name: str, launch: Launch) -> None:
    """Add to the finished run's launch file how long its engines took to start (`engine_start`), when, from its
    launch, the last of them began (`engine_begins`), whether its roles shared the GPU under CUDA MPS, and the host's
    CPU time over the run (`cpu_shares`)."""
    run_dir = root / name
    write_json_whole(_launch_file(root, name), launch | {"engine_start_s": engine_start(run_dir),
                                                         "engine_begins_s": engine_begins(run_dir, launch["time"]),
                                                         "under_mps": (run_dir / MPS_LOG_DIR / MPS_SERVING_FILE).is_file()}
                     | cpu_shares(launch.get("cpu_ticks"), cpu_ticks()))


def read_launch(root: Path, name: str) -> Launch:
    """What `write_launch` and `add_log_readings` recorded of run `name`."""
    return json.loads(_launch_file(root, name).read_text())


def _launch_file(root: Path, name: str) -> Path:
    return root / (name + LAUNCH_SUFFIX)


def engine_start(run_dir: Path) -> float | None:
    """Seconds the run's engines took to start, the slowest one's first start (its restarts left out), from the logs
    of the roles that own them: a compile the warm-up did not spare a job shows here (60 s on an H200, not 20)."""
    return max((seconds for _, seconds in _first_engine_starts(run_dir)), default=None)


def engine_begins(run_dir: Path, launched: float) -> float | None:
    """Seconds from the run's launch (Unix time `launched`) until the last of its engines began its first start: what
    a job spends before its engines start (imports; an async server waits for its learner's addresses). Whole seconds
    of the log lines' clock, this host's local time."""
    local = time.localtime(launched)
    launch_s = _second_of_day(local.tm_hour, local.tm_min, local.tm_sec) + launched % 1
    begun = [(logged_s - launch_s) % DAY_S - seconds for logged_s, seconds in _first_engine_starts(run_dir)]
    return round(max(begun), 1) if begun else None


def _first_engine_starts(run_dir: Path) -> list[tuple[int, float]]:
    """Each engine-owning role's first engine start: the local second of the day it was logged, and its seconds."""
    firsts = []
    for pattern in ENGINE_LOGS:
        for log in (run_dir / "logs").glob(pattern):
            for line in log.read_text(errors="replace").splitlines():
                started, logged = ENGINE_STARTED.search(line), LOGGED_AT.match(line)
                if started and logged:
                    firsts.append((_second_of_day(*(int(part) for part in logged.groups())), float(started.group(1))))
                    break
    return firsts


def _second_of_day(hours: int, minutes: int, seconds: int) -> int:
    return hours * 3600 + minutes * 60 + seconds


def read_ceiling(root: Path) -> float | None:
    """The measured ceiling's output tokens/s, if one was measured into `root`."""
    record = _ceiling_record(root)
    return record["ceiling_tokens_per_s"] if record is not None else None


def ceiling_engines(root: Path) -> int | None:
    """How many engines the ceiling measured into `root` kept full at once (1 in a record made before it was
    kept); None where no ceiling was measured."""
    record = _ceiling_record(root)
    return record.get("engines", 1) if record is not None else None


def _ceiling_record(root: Path) -> dict[str, Any] | None:
    """engine_ceiling.py's figures as measured into `root` (its RESULT), if one was."""
    path = root / CEILING_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def archive_records(root: Path, archive: Path) -> None:
    """Every run's records (RECORDS and its launch file, no weights) and the ceiling, into one .tar.gz, written
    whole beside the records first and then moved into place: one copied while it is written again is never cut."""
    names = [path.name for path in sorted(root.glob(RUN_PREFIX + "*")) if path.is_dir()]
    members = [root / name / record for name in names for record in RECORDS]
    members += [_launch_file(root, name) for name in names] + [root / CEILING_FILE]
    written = root / (archive.name + ".part")
    with tarfile.open(written, "w:gz") as tar:
        for member in members:
            if member.is_file():
                tar.add(member, arcname=str(member.relative_to(root)))
    shutil.move(written, archive)  # a rename where both lie on one file system


def restore_records(archives: list[str], root: Path) -> None:
    """Put archived records back into `root` (a run of the same name there is overwritten file by file)."""
    for archive in archives:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(root, filter="data")
