"""An external agent trains the policy through the chat endpoint of a running job (`asyncrl run` with
`rollout.chat.enabled=true`): its sessions get places from the buffer's admission through the server's
loop, beside the server's own prompt groups, their groups reach the learner, and no trained sample is
staler than K."""

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from run_helpers import RUN_TIMEOUT_S, kill_tree, prepare, tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_STALENESS = 1
SESSIONS_PER_GROUP = 2
TOTAL_STEPS = 6
CHAT_REWARD = 10.0  # far above the arithmetic task's rewards (0..1): a batch holding a chat group shows it
REQUEST_TIMEOUT_S = 120
POLL_S = 0.2


def overrides(tmp: Path) -> list[str]:
    return tiny_job(tmp, TOTAL_STEPS, "run.name=chat", "rollout.chat.enabled=true", "buffer.batch_groups=2",
                    f"buffer.max_staleness={MAX_STALENESS}", f"rollout.sampling.n={SESSIONS_PER_GROUP}",
                    "rollout.max_inflight=4", "validation.every=0")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def drive_sessions(chat_file: Path, run: subprocess.Popen, closes: list[dict]) -> None:
    """Play an agent until the run ends: open a group's sessions, one turn each, then close them with a reward."""
    while not chat_file.exists():
        if run.poll() is not None:
            return
        time.sleep(POLL_S)
    url = json.loads(chat_file.read_text())["url"]
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


def test_chat_sessions_are_admitted_and_trained_on_in_a_running_job(tmp_path):
    prepare(tmp_path, overrides(tmp_path))
    run_dir = tmp_path / "runs" / "chat"
    run = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "run", *overrides(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    closes: list[dict] = []
    agent = threading.Thread(target=drive_sessions, args=(run_dir / "rollout" / "server-0.chat.json", run, closes))
    agent.start()
    try:
        _, stderr = run.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        kill_tree(run.pid)
        agent.join(timeout=REQUEST_TIMEOUT_S)

    assert run.returncode == 0, stderr[-3000:]
    sent = [close for close in closes if close["sent"]]
    assert sent and all(close["record_id"].startswith("server-0-chat-g") for close in sent), closes
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    assert any(r["critic/score/mean"] > 1 for r in records), "no batch held a chat group"
    assert all(r["staleness/max"] <= MAX_STALENESS for r in records)
    assert all({"rollout/chat_sessions", "rollout/chat_waiting"} <= set(r) for r in records)
