"""`asyncrl rollout` starts its servers' processes (which import vLLM for seconds) before it imports torch itself:
on the race's GPU host the rollout command's own imports came first and the servers' began 10 s after launch.
What it knows of the GPUs then is what the config names (`asyncrl run` names them), or what `asyncrl.gpu_ids` finds,
which needs torch only to count the GPUs of a machine with an NVIDIA driver. A fresh interpreter runs the command (this one has torch loaded); the warm-up is stood in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import sys
from launch import cli
from launch.commands import rollout
from rollout_servers import server_starts

class Seen(Exception):
    pass

def warm_up(config, run_dir):
    raise Seen("torch loaded: %s" % ("torch" in sys.modules))

server_starts.ServerStarts.warm_up = staticmethod(warm_up)
try:
    rollout.main(cli.parse(["rollout", "--config", "configs/quickstart.yaml", "run.name=probe", "rollout.gpus=[0]",
                            "run.root_dir=" + sys.argv[1]]))  # the GPUs named, as `asyncrl run` names them
except Seen as seen:
    print(seen)
"""


def test_the_servers_processes_start_before_the_rollout_command_loads_torch(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.stdout.strip() == "torch loaded: False", done.stderr[-2000:]
