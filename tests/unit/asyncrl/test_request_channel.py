"""The clients' request channel against a scripted buffer (a ROUTER socket the test drives): a request
whose reply never comes is resent on a fresh socket, a late reply to an earlier copy is never taken for
a later request's, and an admission request keeps its id across resends."""

from __future__ import annotations

import threading
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
