"""The clients' request channel against a scripted buffer (a ROUTER socket the test drives): a request
whose reply never comes is resent on a fresh socket, a late reply to an earlier copy is never taken for
a later request's, and an admission request keeps its id across resends. With a restart watch (the
learner's own buffer), a request outlives its deadline while the buffer is restarted, is retried against
the restarted one, and ends with the watch's reason once no buffer will serve again."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

from asyncrl.messages import AdmissionGrant, AdmissionRequest, BufferPosition, PolicyVersion, decode, encode
from asyncrl.transport import AdmissionClient, BufferTimeout, RequestChannel
from asyncrl.transport.sockets import bind_router

RESEND_S = 0.05  # short: the scripted buffer holds back replies until the resend it waits for arrives
TIMEOUT_S = 60.0  # never reached: every test answers
RECEIVE_MS = 10_000  # the scripted buffer's longest wait for a copy


@pytest.fixture
def router():
    socket, endpoint = bind_router(zmq.Context.instance(), "127.0.0.1", 0, 2**20, None)
    yield socket, endpoint
    socket.close()


def receive(socket: zmq.Socket) -> tuple[bytes, Any]:
    assert socket.poll(RECEIVE_MS), "no request arrived"
    identity, frame = socket.recv_multipart()
    return identity, decode(frame)


def in_thread(call) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", call()), daemon=True)
    thread.start()
    return thread, result


def position(read_offset: int) -> bytes:
    return encode(BufferPosition(read_offset, 0, 0, 0))


def test_an_unanswered_request_is_resent_and_a_late_reply_is_never_taken(router):
    socket, endpoint = router
    channel = RequestChannel(endpoint, timeout_s=TIMEOUT_S, resend_s=RESEND_S)
    thread, result = in_thread(lambda: channel.request(PolicyVersion(3), BufferPosition))
    first, request = receive(socket)  # the buffer "dies" with this copy: no reply for now
    second, again = receive(socket)
    assert request == again == PolicyVersion(3) and first != second  # the same request, from a fresh socket
    socket.send_multipart([first, position(111)])  # the late reply to the lost copy
    socket.send_multipart([second, position(222)])
    thread.join(timeout=RECEIVE_MS / 1000)
    assert result["value"].read_offset == 222 and channel.resends >= 1

    thread, result = in_thread(lambda: channel.request(PolicyVersion(4), BufferPosition))
    identity, request = receive(socket)
    assert request == PolicyVersion(4)
    socket.send_multipart([identity, position(333)])
    thread.join(timeout=RECEIVE_MS / 1000)
    assert result["value"].read_offset == 333  # not the stale 111


def test_no_reply_within_the_deadline_is_a_timeout(router):
    _, endpoint = router
    channel = RequestChannel(endpoint, timeout_s=0.2, resend_s=RESEND_S)
    with pytest.raises(BufferTimeout, match=r"no reply to PolicyVersion .* attempts"):
        channel.request(PolicyVersion(1), BufferPosition)


def test_a_resent_admission_request_keeps_its_id_and_the_next_gets_a_new_one(router):
    socket, endpoint = router
    client = AdmissionClient(endpoint, "server-0", timeout_s=TIMEOUT_S, resend_s=RESEND_S)
    thread, result = in_thread(lambda: client.request(wanted=4, finished=1))
    _, lost = receive(socket)
    identity, resent = receive(socket)
    assert isinstance(lost, AdmissionRequest) and lost == resent and lost.request_id
    socket.send_multipart([identity, encode(AdmissionGrant(4, 0, 1))])
    thread.join(timeout=RECEIVE_MS / 1000)
    assert result["value"].granted == 4

    thread, result = in_thread(lambda: client.request(wanted=2))
    identity, following = receive(socket)
    socket.send_multipart([identity, encode(AdmissionGrant(2, 0, 1))])
    thread.join(timeout=RECEIVE_MS / 1000)
    assert following.request_id != lost.request_id

    restarted = AdmissionClient(endpoint, "server-0", timeout_s=TIMEOUT_S, resend_s=RESEND_S)  # a new process
    thread, result = in_thread(lambda: restarted.request(wanted=4, finished=1))
    identity, first_again = receive(socket)  # its first request, as `lost` was the first of its predecessor
    socket.send_multipart([identity, encode(AdmissionGrant(4, 0, 1))])
    thread.join(timeout=RECEIVE_MS / 1000)
    assert result["value"].granted == 4 and first_again.request_id not in (lost.request_id, following.request_id)


@dataclass
class ScriptedWatch:
    """A buffer restarted under the channel, in the states the test sets; its methods in the order the channel calls them."""

    reason: Exception | None = None
    dead: bool = False
    restart_count: int = 0

    def check(self) -> None:
        if self.reason is not None:
            raise self.reason

    def restarting(self) -> bool:
        return self.dead

    def restarts(self) -> int:
        return self.restart_count


def test_a_request_waits_out_a_restart_and_is_retried_against_the_restarted_buffer(router, caplog):
    socket, endpoint = router
    timeout_s = 1.0
    watch = ScriptedWatch(dead=True)
    channel = RequestChannel(endpoint, timeout_s=timeout_s, resend_s=RESEND_S, watch=watch)
    with caplog.at_level(logging.WARNING):
        thread, result = in_thread(lambda: channel.request(PolicyVersion(5), BufferPosition))
        restart_ends = time.monotonic() + 2 * timeout_s
        while time.monotonic() < restart_ends:  # copies go unanswered past the deadline: the buffer is restarting
            receive(socket)
        assert thread.is_alive()
        watch.dead, watch.restart_count = False, 1
        while thread.is_alive():  # answer every copy: only one sent after the restart reaches the channel
            if socket.poll(10):
                identity, request = receive(socket)
                socket.send_multipart([identity, position(555)])
    assert result["value"].read_offset == 555
    retries = [m for m in caplog.messages if "retrying PolicyVersion against the restarted buffer" in m]
    assert len(retries) == 1 and "restart 1" in retries[0]


def test_a_request_ends_with_the_reason_once_no_buffer_will_serve_again(router):
    _, endpoint = router
    watch = ScriptedWatch(reason=RuntimeError("buffer.max_restarts=5 used up"))
    channel = RequestChannel(endpoint, timeout_s=TIMEOUT_S, resend_s=RESEND_S, watch=watch)
    with pytest.raises(RuntimeError, match=r"buffer\.max_restarts=5 used up"):
        channel.request(PolicyVersion(1), BufferPosition)
