"""The chat endpoint's API key, as OpenAI clients send it (`Authorization: Bearer <key>`).

Whoever can call the endpoint writes training data (a closed session is a trajectory with the reward the
caller names), so with a key configured every route answers HTTP 401 to a request without it, before
anything is read or stored. A non-loopback host without a key is refused by the config (`ChatEndpointConfig`)
and again when the endpoint binds (`refuse_open_bind`), as the buffer's ZeroMQ sockets refuse one without CURVE
keys: an endpoint built without the config's checks still never listens beyond this host unprotected.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from asyncrl.config.rollout import ChatEndpointConfig
from asyncrl.net import is_loopback

BEARER = "Bearer "
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiKeyError(ValueError):
    """The configured key cannot be read, or a non-loopback endpoint has none; the message names the config key."""


def load_api_key(settings: ChatEndpointConfig) -> str | None:
    """The key from `rollout.chat.api_key_file` or `api_key_env`; None when neither is set (loopback only)."""
    if settings.api_key_file:
        try:
            key = Path(settings.api_key_file).read_text().strip()
        except OSError as error:
            raise ApiKeyError(f"rollout.chat.api_key_file: cannot read '{settings.api_key_file}': {error}") from None
        if not key:
            raise ApiKeyError(f"rollout.chat.api_key_file: '{settings.api_key_file}' is empty")
        return key
    if settings.api_key_env:
        key = os.environ.get(settings.api_key_env, "").strip()
        if not key:
            raise ApiKeyError(f"rollout.chat.api_key_env: the environment variable {settings.api_key_env} is "
                              "not set or empty in the rollout server's environment")
        return key
    return None


def refuse_open_bind(host: str, key: str | None) -> None:
    """Raise unless listening on `host` is safe: a loopback address, or any address with an API key."""
    if not key and not is_loopback(host):
        raise ApiKeyError(f"rollout.chat.host: refusing to listen on non-loopback '{host}' without an API key; set "
                          "rollout.chat.api_key_file or rollout.chat.api_key_env, or use a loopback host (127.0.0.1)")


def require_key(key: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """aiohttp middleware answering 401 to every request that does not carry `key` as its bearer token."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        sent = request.headers.get("Authorization", "")
        # compare_digest: the time taken must not tell how much of a guessed key was right
        if not (sent.startswith(BEARER) and hmac.compare_digest(sent[len(BEARER):].strip().encode(), key.encode())):
            reason = "a wrong API key" if sent else "no API key (send 'Authorization: Bearer <key>')"
            return web.json_response({"error": {"message": f"the chat endpoint needs its API key: got {reason}",
                                                "type": "invalid_request_error", "param": None,
                                                "code": "invalid_api_key"}}, status=401)
        return await handler(request)

    return check
