"""Per-server rollout metrics from the servers' telemetry: interval rates, in-flight, version lag."""

import pytest

from asyncrl.weight_transfer.control_messages import ServerTelemetry
from learner.weight_sync.server_metrics import ServerMetrics
from waiting import wait_until


def beat(server: str, version: int, tokens: int, idle_s: float, uptime_s: float, inflight: int = 0) -> ServerTelemetry:
    return ServerTelemetry(server, version, tokens_generated=tokens, idle_seconds=idle_s, uptime_seconds=uptime_s,
                           inflight=inflight)


def test_rates_cover_the_interval_since_the_previous_reading():
    metrics = ServerMetrics()
    first = metrics.metrics([beat("server-0", 3, tokens=100, idle_s=5.0, uptime_s=10.0)], {}, learner_version=3)
    assert first["rollout/server-0/tokens_per_s"] == pytest.approx(10.0)
    assert first["rollout/server-0/idle_ratio"] == pytest.approx(0.5)
    later = metrics.metrics([beat("server-0", 3, tokens=400, idle_s=5.5, uptime_s=15.0)], {}, learner_version=3)
    assert later["rollout/server-0/tokens_per_s"] == pytest.approx(60.0)
    assert later["rollout/server-0/idle_ratio"] == pytest.approx(0.1)


def test_a_report_read_again_keeps_its_rates_and_the_servers_rates_add_up():
    # the learner steps faster than servers report (heartbeat_s): a step that finds no new report must not read 0
    metrics = ServerMetrics()
    reports = [beat("server-0", 3, tokens=100, idle_s=5.0, uptime_s=10.0), beat("server-1", 3, tokens=40, idle_s=0.0, uptime_s=4.0)]
    first = metrics.metrics(reports, {}, learner_version=3)
    again = metrics.metrics(reports, {}, learner_version=3)
    assert first["rollout/tokens_per_s"] == again["rollout/tokens_per_s"] == pytest.approx(10.0 + 10.0)
    assert again["rollout/server-0/idle_ratio"] == pytest.approx(0.5)
    idle = metrics.metrics([beat("server-0", 3, tokens=100, idle_s=6.0, uptime_s=11.0), reports[1]], {}, learner_version=3)
    assert idle["rollout/server-0/tokens_per_s"] == 0.0  # a new report with no new tokens: truly idle
    assert idle["rollout/tokens_per_s"] == pytest.approx(10.0)


def test_a_restarted_server_is_measured_from_its_new_start():
    metrics = ServerMetrics()
    metrics.metrics([beat("server-0", 0, tokens=1000, idle_s=1.0, uptime_s=100.0)], {}, learner_version=0)
    restarted = metrics.metrics([beat("server-0", 0, tokens=30, idle_s=1.0, uptime_s=2.0)], {}, learner_version=0)
    assert restarted["rollout/server-0/tokens_per_s"] == pytest.approx(15.0)
    assert restarted["rollout/server-0/idle_ratio"] == pytest.approx(0.5)


def test_version_lag_and_inflight_per_server_and_over_servers():
    beats = [beat("server-0", 4, 0, 0.0, 1.0, inflight=8), beat("server-1", 1, 0, 0.0, 1.0, inflight=2)]
    # the coordinator knows server-0 loaded version 5 in a round after its last heartbeat
    values = ServerMetrics().metrics(beats, {"server-0": 5}, learner_version=6)
    assert values["rollout/server-0/version_lag"] == 1.0 and values["rollout/server-1/version_lag"] == 5.0
    assert values["rollout/version_lag/max"] == 5.0 and values["rollout/version_lag/mean"] == 3.0
    assert values["rollout/server-0/inflight"] == 8.0 and values["rollout/inflight"] == 10.0


def test_work_the_servers_threw_away_adds_up_over_their_restarts_and_departures():
    metrics = ServerMetrics()

    def thrown(server: str, tokens: int, uptime_s: float) -> ServerTelemetry:
        return ServerTelemetry(server, 0, uptime_seconds=uptime_s, thrown_away_tokens=tokens)

    assert metrics.thrown_away_tokens([thrown("server-0", 100, 10.0), thrown("server-1", 7, 3.0)]) == 107
    # server-0 stopped with 150 cut and came back counting from 0; server-1 stopped (its last report stays)
    assert metrics.thrown_away_tokens([thrown("server-0", 150, 11.0), thrown("server-1", 7, 3.0)]) == 157
    assert metrics.thrown_away_tokens([thrown("server-0", 20, 1.0), thrown("server-1", 7, 3.0)]) == 150 + 20 + 7
    assert metrics.thrown_away_tokens([thrown("server-0", 20, 1.0)]) == 177, "a report read again counts once"


def test_no_servers_no_aggregates():
    assert ServerMetrics().metrics([], {}, learner_version=3) == {}


def test_coordinator_reports_telemetry_counters_per_server():
    import zmq

    from asyncrl.messages import encode
    from asyncrl.weight_transfer.backends import GLOO
    from learner.weight_sync.coordinator import SyncCoordinator
    from learner.weight_sync.sending_ends import SendingEnds

    coordinator = SyncCoordinator("tcp://127.0.0.1:0", "127.0.0.1", 0, SendingEnds("gloo", lambda name: GLOO.sending_end()),
                                  timeout_s=5.0, liveness_s=5.0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(coordinator.address)
    try:
        telemetry = beat("server-7", 2, tokens=50, idle_s=0.0, uptime_s=5.0, inflight=3)
        telemetry.chat_sessions, telemetry.chat_waiting, telemetry.chat_dropped_idle, telemetry.chat_lost = 4, 2, 3, 5
        sock.send(encode(telemetry))  # no heartbeat: telemetry is logged whatever weight sync is doing

        def heard() -> dict[str, float] | None:
            metrics = coordinator.rollout_metrics(learner_version=5)
            return metrics if "rollout/server-7/inflight" in metrics else None

        values = wait_until(heard, 10.0, "the server's telemetry")
        assert values["rollout/server-7/version_lag"] == 3.0 and values["rollout/server-7/inflight"] == 3.0
        assert values["rollout/server-7/tokens_per_s"] == pytest.approx(10.0)
        assert (values["rollout/chat_sessions"], values["rollout/chat_waiting"], values["rollout/chat_dropped_idle"],
                values["rollout/chat_lost"]) == (4.0, 2.0, 3.0, 5.0)
    finally:
        sock.close(0)
        coordinator.close()
