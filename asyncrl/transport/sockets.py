"""ZeroMQ plumbing shared by the buffer service and its clients: binding, connecting, CURVE keys,
and a request/reply channel where every wait has a deadline.

CURVE layout of a key directory (written by `asyncrl keygen`):
  server.key, server.key_secret     the service's certificate (clients need server.key)
  client.key, client.key_secret     the clients' certificate
  authorized_clients/               public certificates the service accepts
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Protocol, TypeVar

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from asyncrl.net import is_loopback
from asyncrl.config.loader import ConfigError
from asyncrl.messages import DecodeError, ErrorReply, decode, encode
from asyncrl.units import MS_PER_S

log = logging.getLogger(__name__)

SERVER_CERT = "server"
CLIENT_CERT = "client"
AUTHORIZED_DIR = "authorized_clients"
OVERSIZE_DISCONNECT_FACTOR = 4  # frames this many times over the limit are cut off by ZeroMQ itself (memory guard)
LINGER_MS = 0  # closing a socket drops unsent messages: every send is acknowledged or retried anyway

_T = TypeVar("_T")


class BufferTimeout(TimeoutError):
    """No reply from the buffer within the deadline."""


class BufferRequestError(RuntimeError):
    """The buffer answered a request with an error."""


def generate_curve_keys(curve_dir: str | Path) -> Path:
    """Write a server and a client certificate pair and authorise the client; return the directory."""
    directory = Path(curve_dir)
    authorized = directory / AUTHORIZED_DIR
    authorized.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(directory, SERVER_CERT)
    client_public, _ = zmq.auth.create_certificates(directory, CLIENT_CERT)
    shutil.copy(client_public, authorized / Path(client_public).name)
    for secret in directory.glob("*.key_secret"):
        secret.chmod(0o600)
    return directory


def load_key(curve_dir: str | Path, name: str) -> tuple[bytes, bytes | None]:
    """A certificate from the key directory; a missing or unreadable one is a ConfigError naming
    buffer.curve_dir (the usual cause: keys not generated, or not copied to this host)."""
    path = Path(curve_dir) / name
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"buffer.curve_dir: cannot read the CURVE key {path} ({error}); "
                          f"run `asyncrl keygen buffer.curve_dir={curve_dir}` and copy the directory to every host") from None


class ServerSecurity:
    """CURVE server setup plus the authenticator thread that admits only authorised client keys."""

    def __init__(self, context: zmq.Context, curve_dir: str) -> None:
        directory = Path(curve_dir)
        self.public, self.secret = load_key(directory, f"{SERVER_CERT}.key_secret")
        self.authenticator = ThreadAuthenticator(context)
        self.authenticator.start()
        self.authenticator.configure_curve(domain="*", location=str(directory / AUTHORIZED_DIR))

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def stop(self) -> None:
        self.authenticator.stop()


def bind_router(context: zmq.Context, host: str, port: int, max_message_bytes: int,
                security: ServerSecurity | None) -> tuple[zmq.Socket, str]:
    """A ROUTER socket bound at host:port (0 = any free port); returns it and its tcp:// endpoint."""
    if not is_loopback(host) and security is None:
        raise ValueError(f"refusing to bind non-loopback host '{host}' without CURVE keys (buffer.curve_dir)")
    socket = context.socket(zmq.ROUTER)
    socket.linger = LINGER_MS
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes * OVERSIZE_DISCONNECT_FACTOR)
    if security is not None:
        security.apply(socket)
    socket.bind(f"tcp://{host}:{port or '*'}")
    return socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)


class ServingRouter:
    """A ROUTER bound under the CURVE rule, on a context of its own: ZeroMQ runs one authenticator per
    context, so each service admits exactly its key directory's clients. `close()` releases the socket, the
    authenticator and the context; the context's term() waits until the listener is really closed, so a
    successor can bind the same address."""

    def __init__(self, host: str, port: int, max_message_bytes: int, curve_dir: str = "") -> None:
        self.context = zmq.Context()
        self.security = ServerSecurity(self.context, curve_dir) if curve_dir else None
        try:
            self.socket, self.endpoint = bind_router(self.context, host, port, max_message_bytes, self.security)
        except Exception:
            self._release()
            raise

    def close(self) -> None:
        self.socket.close()
        self._release()

    def _release(self) -> None:
        if self.security is not None:
            self.security.stop()
        self.context.term()


class RestartWatch(Protocol):
    """What a client may know of a buffer that is restarted under it (the learner's own buffer: its supervisor)."""

    def restarts(self) -> int:
        """Buffers started so far in place of one that died."""

    def restarting(self) -> bool:
        """Whether a buffer died and its successor does not serve yet."""

    def check(self) -> None:
        """Raise the reason once no buffer will serve again."""


def connect_dealer(context: zmq.Context, address: str, curve_dir: str = "") -> zmq.Socket:
    """A DEALER connected to `address`, with CURVE client keys when curve_dir is set."""
    keys = (load_key(curve_dir, f"{CLIENT_CERT}.key_secret"), load_key(curve_dir, f"{SERVER_CERT}.key")) if curve_dir else None
    socket = context.socket(zmq.DEALER)
    socket.linger = LINGER_MS
    if keys is not None:
        (socket.curve_publickey, socket.curve_secretkey), (socket.curve_serverkey, _) = keys
    socket.connect(address)
    return socket


class RequestChannel:
    """One request at a time to the buffer. A request unanswered for `resend_s` (beyond the time the buffer
    may hold it) is sent again, on a fresh socket, until `timeout_s` has passed without a reply: a request
    that died with a buffer reaches the buffer restarted on the same address, and a late reply to an
    earlier copy is never taken for a later request's reply (it goes to the closed socket). Every request
    the buffer takes is safe to repeat: batch requests carry the consumer's position, commits and versions
    are idempotent, and an admission request carries an id the buffer answers once.

    With a `watch` (a buffer that is restarted under this client), the deadline does not run out while the
    buffer is being restarted, and each restart gives the request a whole `timeout_s` again; once the watch
    says no buffer will serve again, its reason is raised at the next resend."""

    def __init__(self, address: str, curve_dir: str = "", timeout_s: float = 30.0,
                 context: zmq.Context | None = None, resend_s: float = 5.0, watch: RestartWatch | None = None) -> None:
        self.address, self.curve_dir, self.timeout_s, self.resend_s = address, curve_dir, timeout_s, resend_s
        self.context = context or zmq.Context.instance()
        self.socket = connect_dealer(self.context, address, curve_dir)
        self.resends = 0  # copies sent again because no reply came in time
        self.watch = watch
        self._restarts_seen = 0  # the watch's restarts when the request in flight was sent, or last retried

    def request(self, message: Any, expect: type[_T], wait_s: float = 0.0) -> _T:
        """Send `message`, return the reply of type `expect`. The buffer may hold the request up to `wait_s`
        (a batch request waiting for data); BufferTimeout after wait_s + timeout_s without a reply."""
        frame = encode(message)
        deadline = time.monotonic() + wait_s + self.timeout_s
        self._restarts_seen = self.watch.restarts() if self.watch is not None else 0
        attempts = refused = 0
        while True:
            refused += not self._send(frame)
            attempts += 1
            now = time.monotonic()
            until = min(deadline, now + wait_s + self.resend_s)
            if self.socket.poll(max(0, int((until - now) * MS_PER_S)), zmq.POLLIN):
                break
            self._reset()
            deadline = self._deadline_after_silence(message, deadline, wait_s)
            if time.monotonic() >= deadline:
                raise BufferTimeout(f"no reply to {type(message).__name__} from the buffer at {self.address} "
                                    f"within {wait_s + self.timeout_s:.1f}s ({attempts} attempts, {refused} of them "
                                    "refused by ZeroMQ: no connected peer or a full send queue)")
            self.resends += 1
        reply = decode(self.socket.recv())
        if isinstance(reply, ErrorReply):
            raise BufferRequestError(f"buffer at {self.address} refused {type(message).__name__}: {reply.error}")
        if not isinstance(reply, expect):
            raise DecodeError(f"expected {expect.__name__} from the buffer, got {type(reply).__name__}")
        return reply

    def _deadline_after_silence(self, message: Any, deadline: float, wait_s: float) -> float:
        """The request's deadline once a copy went unanswered: unchanged without a watch; raises the watch's reason
        once no buffer will serve again; not before a whole timeout from now while the buffer is being restarted,
        and a whole timeout from now at the first resend to a buffer restarted since the last copy."""
        if self.watch is None:
            return deadline
        self.watch.check()
        whole = time.monotonic() + wait_s + self.timeout_s
        if self.watch.restarting():
            return max(deadline, whole)
        if (restarts := self.watch.restarts()) != self._restarts_seen:
            self._restarts_seen = restarts
            log.warning("retrying %s against the restarted buffer at %s (restart %d; up to %.1fs more)",
                        type(message).__name__, self.address, restarts, wait_s + self.timeout_s)
            return whole
        return deadline

    def _send(self, frame: bytes) -> bool:
        """Queue the frame without blocking (a blocking send waits past any deadline when ZeroMQ has no
        peer to queue it for); False if ZeroMQ refused it. The caller then waits for a reply that cannot
        come and resends on a fresh socket, as for a lost request."""
        try:
            self.socket.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _reset(self) -> None:
        self.socket.close()
        self.socket = connect_dealer(self.context, self.address, self.curve_dir)

    def close(self) -> None:
        self.socket.close()
