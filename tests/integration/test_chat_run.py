"""An external agent trains the policy through the chat endpoint of a running job (`asyncrl run` with
`rollout.chat.enabled=true`): its sessions get places from the buffer's admission through the server's
loop, beside the server's own prompt groups, their groups reach the learner, every prompt group starts within
K and nothing is dropped. An agent that abandons its sessions does not stall the job: they are dropped once idle.

Both jobs are real jobs (conftest.py): they run beside the other tests, and these tests read what they left."""

import functools
import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from asyncrl.metrics import read_metrics
from run_helpers import RUN_TIMEOUT_S, kill_tree, tiny_job
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_STALENESS = 1
SESSIONS_PER_GROUP = 2
TOTAL_STEPS = 6
CHAT_REWARD = 10.0  # far above the arithmetic task's rewards (0..1): a batch holding a chat group shows it
REQUEST_TIMEOUT_S = 120
ABANDONED_SESSIONS = 8  # groups of 2: the whole in-flight budget of K = 1 and 2-group batches, twice over
IDLE_S = 5  # rollout.chat.session_idle_s of the abandoning agent's job
BATCH_TIMEOUT_S = 90  # a job whose learner starved behind the abandoned sessions fails in this time, not 600 s


def overrides(inputs: Path, tmp: Path, *extra: str) -> list[str]:
    """A job on the shared task files and model in `inputs`, its run under `tmp`."""
    return tiny_job(inputs, TOTAL_STEPS, "run.name=chat", "rollout.chat.enabled=true", "buffer.batch_groups=2",
                    f"buffer.max_staleness={MAX_STALENESS}", f"rollout.sampling.n={SESSIONS_PER_GROUP}",
                    "rollout.max_inflight=4", "validation.every=0", f"run.root_dir={tmp / 'runs'}", *extra)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def chat_url(chat_file: Path, run: subprocess.Popen) -> str | None:
    """The endpoint's address once the server has written it; None if the run ended first."""
    wait_until(lambda: chat_file.exists() or run.poll() is not None, RUN_TIMEOUT_S, "the chat endpoint's address")
    return json.loads(chat_file.read_text())["url"] if chat_file.exists() else None


def drive_sessions(chat_file: Path, run: subprocess.Popen, closes: list[dict]) -> None:
    """Play an agent until the run ends: open a group's sessions, one turn each, then close them with a reward."""
    url = chat_url(chat_file, run)
    if url is None:
        return
    group = 0
    while run.poll() is None:
        names = [f"g{group}-{member}" for member in range(SESSIONS_PER_GROUP)]
        try:
            for name in names:
                post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "1+1"}], "session_id": name})
            for name in names:
                closes.append(post(f"{url}/sessions/{name}/close", {"reward": CHAT_REWARD, "group_id": f"g{group}",
                                                                     "group_size": SESSIONS_PER_GROUP}))
        except (urllib.error.URLError, ConnectionError):  # the run stopped its servers
            return
        group += 1


@dataclass
class ChatRun:
    """A finished `asyncrl run` that agents played against, and what the agents saw."""
    returncode: int
    stderr: str
    run_dir: Path
    seen: list  # the agents' replies: the closes' replies (playing agent), or the answered sessions (abandoning)


def run_with_agents(overrides: list[str], run_dir: Path, agents: list[Callable[[Path, subprocess.Popen], None]]
                    ) -> tuple[int, str]:
    """`asyncrl run` to its end, each agent playing against its chat endpoint in a thread of its own."""
    run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", *overrides],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chat_file = run_dir / "rollout" / "server-0.chat.json"
    threads = [threading.Thread(target=agent, args=(chat_file, run)) for agent in agents]
    for thread in threads:
        thread.start()
    try:
        _, stderr = run.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        kill_tree(run.pid)
        for thread in threads:
            thread.join(timeout=REQUEST_TIMEOUT_S)
    return run.returncode, stderr


def playing_job(inputs: Path, tmp: Path) -> ChatRun:
    """A chat job whose agent plays groups of sessions until the job ends."""
    closes: list[dict] = []
    run_dir = tmp / "runs" / "chat"
    agent = functools.partial(drive_sessions, closes=closes)
    return ChatRun(*run_with_agents(overrides(inputs, tmp), run_dir, [agent]), run_dir, closes)


def abandon_session(chat_file: Path, run: subprocess.Popen, name: str, answered: list[str]) -> None:
    """An agent that crashes after its first turn: the session is opened, answered, and never heard of again."""
    url = chat_url(chat_file, run)
    if url is None:
        return
    try:
        post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "1+1"}], "session_id": name})
        answered.append(name)
    except (urllib.error.URLError, ConnectionError):  # the run stopped its servers
        return


def abandoning_job(inputs: Path, tmp: Path) -> ChatRun:
    """A chat job whose sessions idle out soon, against agents that each abandon a session after its first turn."""
    job = overrides(inputs, tmp, f"rollout.chat.session_idle_s={IDLE_S}", f"learner.batch_timeout_s={BATCH_TIMEOUT_S}")
    answered: list[str] = []
    run_dir = tmp / "runs" / "chat"
    agents = [functools.partial(abandon_session, name=f"lost-{index}", answered=answered)
              for index in range(ABANDONED_SESSIONS)]
    return ChatRun(*run_with_agents(job, run_dir, agents), run_dir, answered)


REAL_JOBS = [playing_job, abandoning_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def played(real_jobs) -> ChatRun:
    return real_jobs[playing_job].result()


@pytest.fixture(scope="module")
def abandoned(real_jobs) -> ChatRun:
    return real_jobs[abandoning_job].result()


def test_chat_sessions_are_admitted_and_trained_on_in_a_running_job(played):
    assert played.returncode == 0, played.stderr[-3000:]
    sent = [close for close in played.seen if close["sent"]]
    assert sent and all(close["record_id"].startswith("server-0-chat-g") for close in sent), played.seen
    records = read_metrics(played.run_dir)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    assert any(r["critic/score/mean"] > 1 for r in records), "no batch held a chat group"
    assert all(r.get("staleness/start_lag_max", 0) <= MAX_STALENESS and r["buffer/dropped_stale"] == 0 for r in records)
    assert all({"rollout/chat_sessions", "rollout/chat_waiting"} <= set(r) for r in records)


def test_sessions_an_agent_abandons_are_dropped_and_the_job_goes_on(abandoned):
    run_dir = abandoned.run_dir
    assert abandoned.returncode == 0, abandoned.stderr[-3000:]
    assert len(abandoned.seen) == ABANDONED_SESSIONS, "every abandoned session held a place"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    # heartbeats come once a second and the steps after the drop may all fall within one: the log counts exactly
    assert all(0 <= r["rollout/chat_dropped_idle"] <= ABANDONED_SESSIONS for r in records)
    dropped = re.findall(r"dropped (\d+) chat session\(s\) without a request", (run_dir / "logs" / "rollout0.log").read_text())
    # the sessions holding every place are dropped, or the job could not go on; sessions answered once places were
    # free again may outlive a job that no longer needs them (on a quiet box its 6 steps take a second)
    assert 1 <= sum(map(int, dropped)) <= ABANDONED_SESSIONS
