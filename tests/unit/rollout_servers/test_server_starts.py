"""Which process a server starts in: the one started before the learner was up, when it is pinned where the
server's place says, else a fresh one (the warm one stopped unused); which GPUs a warm process is pinned to, from
what the config names before the learner's settings are adopted. The processes and the pipe are stand-ins."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.placement import ServerPlace
from rollout_servers import server_starts
from rollout_servers.learner_wait import Endpoints
from rollout_servers.server_starts import NOT_FINISHED, ServerStarts, WarmProcess, named_gpus

ENDPOINTS = Endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")


class StandInProcess:
    def __init__(self, target=None, args=(), alive=True, **_) -> None:
        self.target, self.args, self.alive, self.events = target, args, alive, []

    def start(self) -> None:
        self.events.append("start")

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.events.append("terminate")
        self.alive = False

    def join(self, timeout=None) -> None:
        self.events.append("join")


class StandInPipe:
    def __init__(self) -> None:
        self.sent, self.closed = [], False

    def send(self, value) -> None:
        self.sent.append(value)

    def close(self) -> None:
        self.closed = True


class StandInValue:
    def __init__(self, kind, value) -> None:
        self.value = value


class StandInContext:
    def __init__(self) -> None:
        self.started: list[StandInProcess] = []

    def Value(self, kind, value):  # noqa: N802 (multiprocessing's name)
        return StandInValue(kind, value)

    def Process(self, **kwargs):  # noqa: N802
        process = StandInProcess(**kwargs)
        self.started.append(process)
        return process


def starts_with_warm(gpus, alive=True) -> tuple[ServerStarts, WarmProcess]:
    starts = ServerStarts(StandInContext())
    warm = WarmProcess(StandInProcess(alive=alive), gpus, StandInPipe())
    starts.warm[0] = warm
    return starts, warm


def place(gpus: tuple[int, ...]) -> ServerPlace:
    return ServerPlace(gpus, "ipc", 0.4, True)


def test_the_warm_process_pinned_where_the_place_says_serves_and_gets_what_it_serves(tmp_path):
    config = load_config(None, [])
    starts, warm = starts_with_warm((0,))
    assert starts.job_end.value == NOT_FINISHED
    process = starts.start(0, config, ENDPOINTS, tmp_path, place((0,)))
    assert process is warm.process and warm.starts.sent == [(config, ENDPOINTS, place((0,)))] and warm.starts.closed
    assert starts.context.started == [] and starts.warm == {}  # no fresh process; the next start is a fresh one
    again = starts.start(0, config, ENDPOINTS, tmp_path, place((0,)))
    assert again is not warm.process and again.events == ["start"]


def test_a_warm_process_pinned_elsewhere_or_dead_is_left_and_the_server_starts_fresh(tmp_path):
    from rollout_servers.server_process import serve_one

    config = load_config(None, [])
    for warm_gpus, alive, server_place in (((0,), True, place((1,))), (None, True, place((0,))), ((0,), False, place((0,)))):
        starts, warm = starts_with_warm(warm_gpus, alive)
        process = starts.start(0, config, ENDPOINTS, tmp_path, server_place)
        assert warm.starts.sent == [] and warm.starts.closed and warm.process.events[-1] == "join"
        assert ("terminate" in warm.process.events) == alive  # a live one is stopped unused
        assert process.target is serve_one and process.args == (config, 0, ENDPOINTS, str(tmp_path), server_place,
                                                                 starts.job_end)


def test_closing_stops_every_warm_process_no_server_started_in():
    starts, warm = starts_with_warm(None)
    starts.close()
    assert warm.starts.closed and warm.process.events == ["terminate", "join"] and starts.warm == {}


def test_warm_processes_are_pinned_to_the_gpus_the_config_names_and_none_start_where_only_the_plan_can_say(monkeypatch):
    listed = load_config(None, ["rollout.num_servers=2", "rollout.gpus=[2,3,4,5]",
                                "rollout.engine.tensor_parallel_size=2"])
    assert named_gpus(listed) == [(2, 3), (4, 5)]
    assert named_gpus(load_config(None, ["rollout.num_servers=2", "rollout.gpus=[2,3,4]"])) is None  # refused later
    monkeypatch.setattr(server_starts, "visible_gpus", lambda: [])
    assert named_gpus(load_config(None, ["rollout.num_servers=3"])) == [None, None, None]  # no GPU: nothing to pin
    monkeypatch.setattr(server_starts, "visible_gpus", lambda: [0, 1])
    assert named_gpus(load_config(None, ["rollout.num_servers=2"])) is None
    assert ServerStarts.warm_up(load_config(None, ["rollout.num_servers=2"]), ".").warm == {}


@pytest.fixture(autouse=True)
def no_real_processes(monkeypatch):
    """A test that slipped through to multiprocessing would start a real server: fail instead."""
    def refuse(*args, **kwargs):
        raise AssertionError("a real process was started")

    monkeypatch.setattr("multiprocessing.context.SpawnProcess.start", refuse)
