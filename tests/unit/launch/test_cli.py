"""The command line: overrides wherever they stand after the command, clear errors for the rest, and the
buffer's and keygen's commands as a user meets them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch import cli

ROOT = Path(__file__).resolve().parents[3]


def test_overrides_may_follow_a_commands_options():
    args = cli.parse(["export", "runs/a", "model.path=/m", "--out", "/tmp/x", "model.dtype=bfloat16"])
    assert (args.run_dir, args.out) == ("runs/a", "/tmp/x")
    assert args.overrides == ["model.path=/m", "model.dtype=bfloat16"]


@pytest.mark.parametrize("argv, named", [
    (["export", "runs/a", "--out", "/tmp/x", "--bogus"], "--bogus"),
    (["export", "runs/a", "--out", "/tmp/x", "stray"], "stray"),
    (["plot", "runs/a", "run.seed=1"], "run.seed=1"),  # plot reads no config
])
def test_anything_else_is_an_error_that_names_it(argv, named, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.parse(argv)
    assert raised.value.code == 2
    assert f"unrecognized arguments: {named}" in capsys.readouterr().err


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_buffer_and_keygen_help_say_what_they_do():
    assert "fsync" in run_cli("buffer", "--help").stdout
    assert "CURVE" in run_cli("keygen", "--help").stdout


def test_keygen_writes_keys_and_names_the_missing_key(tmp_path):
    assert "buffer.curve_dir" in run_cli("keygen").stderr
    result = run_cli("keygen", f"buffer.curve_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert {p.name for p in tmp_path.iterdir()} >= {"server.key", "server.key_secret", "client.key",
                                                    "client.key_secret", "authorized_clients"}
