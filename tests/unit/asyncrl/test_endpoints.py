"""The learner's services keep their ports across its restarts: the run's ports file, and the choice of the port
to bind (configured, the run's own while free, else a free one)."""

import logging
import socket
import threading

import zmq

from asyncrl.endpoints import port_to_bind, remember_ports, remembered_ports
from asyncrl.messages import StatsRequest, decode, encode
from asyncrl.net import LOOPBACK, port_is_free
from asyncrl.transport.sockets import ServingRouter, connect_dealer

MAX_MESSAGE_BYTES = 2**20
REPLY_WAIT_MS = 5_000


def test_the_first_start_has_no_ports_and_a_restart_reads_those_kept(tmp_path):
    assert remembered_ports(tmp_path) == {}
    remember_ports(tmp_path, {"buffer": "tcp://127.0.0.1:41001", "sync": "tcp://127.0.0.1:41002"})
    assert remembered_ports(tmp_path) == {"buffer": 41001, "sync": 41002}


def test_a_configured_port_wins_and_port_0_takes_the_runs_own(tmp_path):
    assert port_to_bind("buffer", LOOPBACK, 5555, 41001) == 5555
    assert port_to_bind("buffer", LOOPBACK, 0, None) == 0  # the first start: any free port
    free = _closed_listener_port()
    assert port_to_bind("buffer", LOOPBACK, 0, free) == free


def test_a_port_taken_by_another_process_gives_way_to_a_free_one(caplog):
    with socket.socket() as holder:
        holder.bind((LOOPBACK, 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with caplog.at_level(logging.INFO, logger="asyncrl.endpoints"):
            assert port_to_bind("weight-sync coordinator", LOOPBACK, 0, taken, wait_s=0.5) == 0
    assert f"the weight-sync coordinator's port of this run, {taken}, is taken" in caplog.text  # each try
    assert f"{taken}, is still taken after 0.5s: binding a free one" in caplog.text  # the last word


def test_a_port_held_by_a_predecessor_still_exiting_is_waited_for():
    holder = socket.socket()
    holder.bind((LOOPBACK, 0))
    holder.listen()
    port = holder.getsockname()[1]
    closer = threading.Timer(0.5, holder.close)  # the killed learner's buffer, gone a moment later
    closer.start()
    try:
        assert port_to_bind("buffer", LOOPBACK, 0, port, wait_s=30) == port
    finally:
        closer.join()


def test_a_killed_services_port_binds_again_while_its_connections_linger():
    # the service side closes first, as a killed learner's does: its end of the connection sits in TIME_WAIT
    first = ServingRouter(LOOPBACK, 0, MAX_MESSAGE_BYTES)
    port = int(first.endpoint.rpartition(":")[2])
    context = zmq.Context()
    client = connect_dealer(context, first.endpoint)
    try:
        client.send(encode(StatsRequest()))
        assert first.socket.poll(REPLY_WAIT_MS), "the request never arrived"
        identity, frame = first.socket.recv_multipart()
        assert isinstance(decode(frame), StatsRequest)
        first.close()
        assert port_is_free(LOOPBACK, port)
        assert port_to_bind("buffer", LOOPBACK, 0, port) == port
        second = ServingRouter(LOOPBACK, port, MAX_MESSAGE_BYTES)  # the restarted service, same address
        try:
            assert second.endpoint == f"tcp://{LOOPBACK}:{port}"
            client.send(encode(StatsRequest()))  # the client's socket reconnects by itself
            assert second.socket.poll(REPLY_WAIT_MS), "the old client did not reach the service at its old address"
        finally:
            second.close()
    finally:
        client.close()
        context.term()


def _closed_listener_port() -> int:
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen()
        return listener.getsockname()[1]
