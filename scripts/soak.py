"""Chaos soak of the two-command job on CPU.

`asyncrl learner` and `asyncrl rollout` run as a process manager runs them: each is started again when it exits
(the learner resuming from its newest checkpoint, `learner.resume=auto`). Every --kill-every seconds (a random
interval between the two bounds) one role is killed with SIGKILL: a rollout server, the rollout supervisor, the
buffer or a learner rank. After --minutes both commands are stopped with SIGTERM, and the soak reports:

  kills                  kills per role
  lost                   prompts a server had acknowledged (its prompt-stream state) that the buffer's log lacks
  duplicated             records the buffer's log holds twice, plus records trained twice by the final model: the
                         groups and drops of the steps that survived the learner's restarts against the count its
                         committed position says were consumed (negative counts would be records skipped)
  orphans                processes of this soak still alive after both commands stopped (each was SIGKILLed): any
                         process once seen below a command (vLLM's processes overwrite their environment with their
                         title), or one with this soak's marker in its environment or its run dir in its command line
  rss_growth_mb_per_h    per role, the largest slope of resident memory over one process's life (lives of at
                         least --min-life-s)
  val_gain               held-out `val/score/mean`, last pass minus first

Run from the repository root with scripts/cpu_env.sh sourced, after `asyncrl data` and `asyncrl init-model` of
the config. The last line is RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from asyncrl.config import load_config
from asyncrl.config_arguments import add_config_arguments
from buffer.group_summary import record_id_of
from asyncrl.metrics import read_metrics
from buffer.log import SegmentLog

DEFAULT_CONFIG = "configs/quickstart.yaml"
ROLES = ("server", "supervisor", "buffer", "learner_rank")
POLL_S = 1.0  # how often the manager looks at its commands and samples memory
STOP_TIMEOUT_S = 120.0  # a command stopped (SIGTERM) is killed after this
ORPHAN_GRACE_S = 30.0  # how long processes may take to go after both commands stopped (a dying process's children
# get their parent-death signal at once, but a loaded box takes seconds to tear a vLLM engine down)
BYTES_PER_MB = 2**20
S_PER_H = 3600.0


@dataclass
class Command:
    """One of the two commands, started again whenever it exits."""

    name: str  # "learner" or "rollout"
    args: list[str]
    log: Path
    process: subprocess.Popen | None = None
    starts: int = 0

    def ensure_running(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        if self.process is not None:
            print(f"{time.strftime('%H:%M:%S')} {self.name} exited with {self.process.returncode}: restarting", flush=True)
        with open(self.log, "ab") as output:
            self.process = subprocess.Popen([sys.executable, "-m", "launch.cli", self.name, *self.args], stdout=output,
                                            stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy())
        self.starts += 1

    def stop(self) -> None:
        """SIGTERM, as a process manager stops a service (a SIGINT would find it ignored when the soak itself was
        started in the background from a script: such a shell starts its background jobs ignoring SIGINT)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass
class MemoryTrace:
    """Resident memory of each process of a role over its life: (role, pid) -> [(seconds, bytes)]."""

    samples: dict[tuple[str, int], list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))

    def sample(self, roles: dict[str, list[psutil.Process]]) -> None:
        now = time.monotonic()
        for role, processes in roles.items():
            for process in processes:
                try:
                    self.samples[(role, process.pid)].append((now, process.memory_info().rss))
                except psutil.NoSuchProcess:
                    pass

    def growth_mb_per_h(self, min_life_s: float, warmup_s: float = 0.0) -> dict[str, float]:
        """Per role, the largest least-squares slope of RSS over a process life, its first `warmup_s` left out
        (loading a model, starting an engine), of at least `min_life_s` after that."""
        growth: dict[str, float] = {}
        for (role, _), life in self.samples.items():
            points = [(t, rss) for t, rss in life if t - life[0][0] >= warmup_s]
            if len(points) < 2 or points[-1][0] - points[0][0] < min_life_s:
                continue
            growth[role] = max(growth.get(role, float("-inf")), _slope(points) * S_PER_H / BYTES_PER_MB)
        return {role: round(value, 1) for role, value in sorted(growth.items())}


def _slope(points: list[tuple[float, int]]) -> float:
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else 0.0


@dataclass
class SeenProcesses:
    """Every process seen below the two commands, by (pid, start time): a pid reused later is another process."""

    seen: set[tuple[int, float]] = field(default_factory=set)  # (pid, create_time)

    def add_below(self, commands: list[subprocess.Popen | None]) -> None:
        for command in commands:
            for process in _descendants(command):
                try:
                    self.seen.add((process.pid, process.create_time()))
                except psutil.NoSuchProcess:
                    pass

    def alive(self) -> list[psutil.Process]:
        found = []
        for pid, started in self.seen:
            try:
                process = psutil.Process(pid)
                if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except psutil.NoSuchProcess:
                pass
        return found


def _descendants(process: subprocess.Popen | None) -> list[psutil.Process]:
    if process is None or process.poll() is not None:
        return []
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _children(process: subprocess.Popen | None, marker: str) -> list[psutil.Process]:
    """The live descendants of `process` whose command line contains `marker`."""
    found = []
    for child in _descendants(process):
        try:
            if marker in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def roles_now(learner: Command, rollout: Command) -> dict[str, list[psutil.Process]]:
    """Each role's live processes (a server's engine core counts as `engine_core`, for memory only)."""
    return {
        "server": _direct(rollout.process, _children(rollout.process, "spawn_main")),
        "supervisor": _alive(rollout.process),
        "engine_core": _children(rollout.process, "VLLM::EngineCore"),
        "buffer": _children(learner.process, "launch.cli buffer"),
        "learner_rank": _direct(learner.process, _children(learner.process, "spawn_main")),
    }


def _alive(process: subprocess.Popen | None) -> list[psutil.Process]:
    try:
        return [psutil.Process(process.pid)] if process is not None and process.poll() is None else []
    except psutil.NoSuchProcess:
        return []


def _direct(parent: subprocess.Popen | None, processes: list[psutil.Process]) -> list[psutil.Process]:
    """The processes that `parent` started itself (a supervisor's servers, a learner's ranks)."""
    direct = []
    for process in processes:
        try:
            if parent is not None and process.ppid() == parent.pid:
                direct.append(process)
        except psutil.NoSuchProcess:
            pass
    return direct


def kill_one(roles: dict[str, list[psutil.Process]], rng: random.Random) -> str | None:
    """SIGKILL one process of a random role that has one now; the role killed, or None."""
    candidates = [role for role in ROLES if roles[role]]
    if not candidates:
        return None
    role = rng.choice(candidates)
    victim = rng.choice(roles[role])
    try:
        victim.kill()
    except psutil.NoSuchProcess:
        return None
    print(f"{time.strftime('%H:%M:%S')} kill -9 {role} (pid {victim.pid})", flush=True)
    return role


def soak_processes(run_dir: Path, seen: SeenProcesses) -> list[psutil.Process]:
    """Every live process of this soak: one seen below a command, or one marked as the soak's (an asyncrl command
    of its run, or a process below one started between two looks)."""
    found = {process.pid: process for process in seen.alive()}
    for process in psutil.process_iter(["cmdline", "environ"]):
        try:
            text = " ".join(process.info["cmdline"] or [])
            if str(run_dir) in text or process.info["environ"] and process.info["environ"].get("ASYNCRL_SOAK") == str(run_dir):
                if process.status() != psutil.STATUS_ZOMBIE and process.pid != os.getpid():
                    found.setdefault(process.pid, process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return list(found.values())


def left_behind(run_dir: Path, seen: SeenProcesses) -> list[psutil.Process]:
    """The soak's processes still alive ORPHAN_GRACE_S after both commands stopped."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (found := soak_processes(run_dir, seen)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return found


def describe_orphan(orphan: psutil.Process) -> None:
    """One line on a process left behind: pid, parent, start, command line, and the pipes it holds open (a
    multiprocessing resource tracker lives until every holder of its pipe's other end is gone)."""
    try:
        started = time.strftime("%H:%M:%S", time.localtime(orphan.create_time()))
        targets = [os.readlink(fd) for fd in Path(f"/proc/{orphan.pid}/fd").iterdir()]
        pipes = sorted({target for target in targets if target.startswith("pipe:")})
        print(f"orphan: pid {orphan.pid} (parent {orphan.ppid()}, started {started}, pipes {' '.join(pipes)}) "
              f"{' '.join(orphan.cmdline())[:120]}", flush=True)
    except (psutil.NoSuchProcess, OSError):
        pass


def buffer_check(run_dir: Path, segment_bytes: int) -> tuple[int, int]:
    """(acknowledged prompts missing from the buffer's log, record ids the log holds more than once)."""
    log = SegmentLog(run_dir / "buffer", segment_bytes, "none")
    try:
        assert log.first_offset == 0, "retention deleted segments: the check needs the whole log"
        ids = Counter(record_id_of(frame) for _, frame in log.read_range(log.first_offset, log.end_offset))
    finally:
        log.close()
    lost = 0
    for state_file in (run_dir / "rollout").glob("*.prompts.json"):
        state = json.loads(state_file.read_text())
        server = state_file.name.removesuffix(".prompts.json")
        acknowledged = set(range(state["watermark"])) | set(state["acknowledged"])
        lost += sum(f"{server}-prompt-{number}" not in ids for number in acknowledged)
    return lost, sum(count - 1 for count in ids.values())


def trained_twice(run_dir: Path, samples_per_group: int) -> int:
    """Records the final model was trained on beyond once: the steps that survived (each step's last record)
    handed out more groups and drops than the newest checkpoint's position says were consumed."""
    survived = {record["step"]: record for record in read_metrics(run_dir)}
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir():  # no checkpoint yet: the final model was trained on nothing that counts
        return 0
    newest = max(checkpoints.iterdir())
    meta = json.loads((newest / "meta.json").read_text())
    consumed = meta["buffer_offset"] + len(meta["buffer_ahead"])
    handed = sum(r["batch/samples"] / samples_per_group + r["buffer/dropped_stale_in_batch"]
                 for step, r in survived.items() if step <= meta["step"])
    return round(handed - consumed)


def val_gain(run_dir: Path) -> float | None:
    passes = [r["val/score/mean"] for r in read_metrics(run_dir) if r.get("val/score/mean") is not None]
    return round(passes[-1] - passes[0], 3) if len(passes) >= 2 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the job runs under chaos")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(60.0, 180.0), metavar=("MIN_S", "MAX_S"),
                        help="seconds between kills, drawn uniformly")
    add_config_arguments(parser, DEFAULT_CONFIG, "config overrides for both commands")
    parser.add_argument("--name", default="soak", help="run.name of the job")
    parser.add_argument("--seed", type=int, default=0, help="seed of the chaos (which role, when)")
    parser.add_argument("--min-life-s", type=float, default=120.0, help="shortest process life measured for RSS growth")
    parser.add_argument("--warmup-s", type=float, default=120.0, help="start of each process life left out of RSS growth")
    args = parser.parse_args()
    job = ["--config", args.config, f"run.name={args.name}", "learner.total_steps=1000000", *args.overrides]
    config = load_config(args.config, job[2:])
    run_dir = Path(config.run.root_dir) / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ["ASYNCRL_SOAK"] = str(run_dir)  # inherited by every process of the soak: how orphans are found
    learner = Command("learner", job, run_dir / "soak_learner.out")
    rollout = Command("rollout", job, run_dir / "soak_rollout.out")
    rng, memory, kills, seen = random.Random(args.seed), MemoryTrace(), Counter(), SeenProcesses()
    deadline = time.monotonic() + args.minutes * 60
    next_kill = time.monotonic() + rng.uniform(*args.kill_every)
    try:
        while time.monotonic() < deadline:
            learner.ensure_running()
            rollout.ensure_running()
            roles = roles_now(learner, rollout)
            memory.sample(roles)
            seen.add_below([learner.process, rollout.process])
            if time.monotonic() >= next_kill and (role := kill_one(roles, rng)) is not None:
                kills[role] += 1
                next_kill = time.monotonic() + rng.uniform(*args.kill_every)
            time.sleep(POLL_S)
    finally:
        rollout.stop()
        learner.stop()
    orphans = left_behind(run_dir, seen)
    for orphan in orphans:
        describe_orphan(orphan)
        orphan.kill()
    lost, logged_twice = buffer_check(run_dir, config.buffer.segment_bytes)
    result = {
        "minutes": args.minutes, "kills": dict(kills), "restarts": {"learner": learner.starts - 1, "rollout": rollout.starts - 1},
        "lost": lost, "duplicated": logged_twice + trained_twice(run_dir, config.rollout.sampling.n),
        "orphans": len(orphans), "rss_growth_mb_per_h": memory.growth_mb_per_h(args.min_life_s, args.warmup_s),
        "val_gain": val_gain(run_dir), "steps": max((r["step"] for r in read_metrics(run_dir)), default=0),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
