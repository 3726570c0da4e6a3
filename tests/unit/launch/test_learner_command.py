"""`asyncrl learner` with one rank trains it in its own process: a spawned rank started a fresh interpreter and
imported torch and the learner again (the learner's addresses came 4 s later on a 2-core box, 10 s against 6 s from
launch). Several ranks are still spawned. The one rank's end maps to the command's exit as a spawned rank's did:
0 when trained, INTERRUPTED after a stop signal, 1 after an error, logged with the rank's name. Stand-ins for
training and the spawner record where each ran."""

import os

import pytest

import launch.commands.learner
import learner.main
from asyncrl.exit_codes import INTERRUPTED
from launch import cli

QUICKSTART = "configs/quickstart.yaml"


@pytest.fixture
def ran(monkeypatch) -> dict[str, object]:
    """Where training ran (`pid`), or the spawner's rank count (`spawned`), in place of each."""
    seen: dict[str, object] = {}

    def train(config, run_dir, buffer_command):
        seen["pid"] = os.getpid()
        outcome = seen.get("outcome")
        if isinstance(outcome, BaseException):
            raise outcome
        return None

    def spawn_ranks(target, args, size, run_dir, role, log):
        seen["spawned"] = size
        return 0

    monkeypatch.setattr(learner.main, "train", train)
    monkeypatch.setattr(launch.commands.learner, "spawn_ranks", spawn_ranks)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return seen


def _learner(tmp_path, *overrides: str) -> int:
    args = cli.parse(["learner", "--config", QUICKSTART, f"run.root_dir={tmp_path}", "run.name=one", *overrides])
    return launch.commands.learner.main(args)


def test_one_rank_trains_in_the_commands_own_process(tmp_path, ran):
    assert _learner(tmp_path) == 0
    assert ran == {"pid": os.getpid()}


def test_several_ranks_are_spawned(tmp_path, ran):
    assert _learner(tmp_path, "learner.nproc=2") == 0
    assert ran == {"spawned": 2}


@pytest.mark.parametrize("outcome, code", [(KeyboardInterrupt(), INTERRUPTED), (ValueError("bad batch"), 1)])
def test_the_ranks_end_is_the_commands_exit(tmp_path, ran, outcome, code, capsys):
    ran["outcome"] = outcome
    assert _learner(tmp_path) == code
    console = capsys.readouterr().err  # the command's logging is set up anew: the console is where it shows
    assert ("ERROR learner.main: learner rank 0 failed: ValueError: bad batch" in console) == (code == 1)
    assert ("stopped by a signal" in console) == (code == INTERRUPTED)
