"""``Relay``: the host-side relay as an object the backend starts, registers rollouts with, and
stops; and the admin API that lets a standalone ``backends relay`` process do the same over HTTP.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ValidationError

from backends.asgi import Receive, Scope, Send
from backends.relay.app import RelayApp, _reply, _reply_error
from backends.relay.serving import Listening, Served, serve_asgi
from backends.relay.tokens import Grant, Registry, UnknownRolloutError, rollout_path
from backends.relay.trace import RolloutTrace, build_trace
from backends.relay.upstream import RelaySettings, Upstream


class RelayCore:
    """Registry, upstreams and the ASGI app, without any server: what ``Relay`` serves."""

    def __init__(
        self,
        upstream_url: str | None,
        upstream_api_key: str | None,
        settings: RelaySettings,
        *,
        admin_token: str | None = None,
    ) -> None:
        self.settings = settings
        self.registry = Registry()
        self._default = Upstream.parse(upstream_url, upstream_api_key) if upstream_url else None
        self.origin: str | None = None  # set once serving; used for grants' base URLs
        admin = _AdminApp(self, admin_token) if admin_token else None
        self.app = RelayApp(self.registry, settings, admin)

    def register(
        self,
        rollout_id: str,
        *,
        upstream_url: str | None = None,
        upstream_api_key: str | None = None,
        policy_version: str | None = None,
    ) -> Grant:
        if upstream_url is not None:
            upstream = Upstream.parse(upstream_url, upstream_api_key)
        elif self._default is not None:
            upstream = self._default
            if upstream_api_key is not None:
                upstream = upstream.with_api_key(upstream_api_key)
        else:
            raise ValueError(
                f"rollout {rollout_id!r} has no upstream: the relay was started without "
                "upstream_url, so register() must be given one"
            )
        _, token = self.registry.register(rollout_id, upstream, policy_version)
        return Grant(rollout_id=rollout_id, token=token, base_url=self.url_for(rollout_id))

    def end(self, rollout_id: str) -> RolloutTrace:
        state = self.registry.end(rollout_id)
        return build_trace(rollout_id, state.registered_at, state.calls, ended=True)

    async def aend(self, rollout_id: str) -> RolloutTrace:
        state = self.registry.end(rollout_id)  # revoked now, before any await
        calls = list(state.calls)
        return await anyio.to_thread.run_sync(
            lambda: build_trace(rollout_id, state.registered_at, calls, ended=True)
        )

    def trace(self, rollout_id: str) -> RolloutTrace:
        state = self.registry.get(rollout_id)
        return build_trace(rollout_id, state.registered_at, list(state.calls), ended=False)

    def url_for(self, rollout_id: str, origin: str | None = None) -> str:
        base = origin or self.origin
        if base is None:
            raise RuntimeError("the relay is not serving yet: enter `async with relay:` first")
        return base.rstrip("/") + rollout_path(rollout_id)


class Relay(Served):
    """The rollout-scoped policy relay, served from this process.

    ``async with Relay(upstream_url=..., upstream_api_key=...) as relay:`` serves on
    ``relay.base_url`` (TCP, 127.0.0.1 and a free port by default) and, if given, on
    ``unix_socket_path``; leaving the block stops the server and closes upstream connections.
    ``register`` / ``end`` are plain calls on the serving event loop (asyncio: uvicorn
    serves it). Raises ``OSError`` on entry if the port or socket path cannot be bound.
    """

    def __init__(
        self,
        upstream_url: str | None = None,
        upstream_api_key: str | None = None,
        *,
        request_token_ids: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        unix_socket_path: str | Path | None = None,
        advertised_url: str | None = None,
        settings: RelaySettings | None = None,
        admin_token: str | None = None,
        embedded: bool = True,
    ) -> None:
        if settings is None:
            settings = RelaySettings(request_token_ids=request_token_ids)
        elif request_token_ids and not settings.request_token_ids:
            raise ValueError("request_token_ids=True contradicts settings.request_token_ids")
        self.core = RelayCore(upstream_url, upstream_api_key, settings, admin_token=admin_token)
        self._host = host
        self._port = port
        self._unix = Path(unix_socket_path) if unix_socket_path is not None else None
        self._advertised = advertised_url.rstrip("/") if advertised_url else None
        self._embedded = embedded

    @property
    def app(self) -> RelayApp:
        return self.core.app

    @property
    def base_url(self) -> str:
        """The relay's TCP origin, e.g. ``http://127.0.0.1:41234``."""
        return self._serving().origin

    @property
    def port(self) -> int:
        return self._serving().port

    @property
    def unix_socket_path(self) -> Path | None:
        return self._unix

    @property
    def advertised_url(self) -> str | None:
        """The origin remote sandboxes use, if one was given."""
        return self._advertised

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        stack.callback(self.core.app.close)
        self._listening = await stack.enter_async_context(
            serve_asgi(
                self.core.app,
                host=self._host,
                port=self._port,
                unix_socket_path=self._unix,
                embedded=self._embedded,
                max_idle_connections=self.core.settings.max_idle_connections,
            )
        )
        self.core.origin = self._listening.origin

    async def serve_forever(self) -> None:
        """Serve until cancelled (the standalone process's main loop)."""
        await anyio.sleep_forever()

    def register(
        self,
        rollout_id: str,
        upstream_url: str | None = None,
        upstream_api_key: str | None = None,
        policy_version: str | None = None,
    ) -> Grant:
        """Admit a rollout; return its token and base URL (on this relay's TCP origin).

        ``upstream_url`` (a base URL or a full chat completions URL) and ``upstream_api_key``
        override the relay's upstream for this rollout only. ``policy_version`` is recorded on
        each call unless the upstream reports one in its policy-version header.
        Raises ``ValueError`` for an id that is already live or cannot be used in a URL, or when
        no upstream is known.
        """
        return self.core.register(
            rollout_id,
            upstream_url=upstream_url,
            upstream_api_key=upstream_api_key,
            policy_version=policy_version,
        )

    def end(self, rollout_id: str) -> RolloutTrace:
        """Revoke the rollout's token and return its trace. From now on its calls get 403.

        Calls still in flight are recorded as ``interrupted``. Raises ``UnknownRolloutError``
        (a ``KeyError``) if the rollout is not live.
        """
        return self.core.end(rollout_id)

    async def aend(self, rollout_id: str) -> RolloutTrace:
        """``end``, with the trace parsed in a worker thread.

        Parsing costs about 0.1 ms per call plus the JSON of long conversations; a rollout of
        hundreds of calls would otherwise hold up every other rollout's calls while it parses.
        The token is revoked before this first awaits.
        """
        return await self.core.aend(rollout_id)

    def trace(self, rollout_id: str) -> RolloutTrace:
        """A snapshot of a live rollout's trace. Raises ``UnknownRolloutError``."""
        return self.core.trace(rollout_id)

    def rollout_base_url(self, rollout_id: str, origin: str | None = None) -> str:
        """The rollout's OpenAI base URL at ``origin``: by default this relay's TCP origin.

        For a sandbox with the in-sandbox forwarder pass ``http://127.0.0.1:<forwarder port>``;
        for a remote sandbox pass the advertised URL (or use ``remote_base_url``).
        """
        return self.core.url_for(rollout_id, origin)

    def remote_base_url(self, rollout_id: str) -> str:
        """The rollout's base URL through the advertised URL. Raises ``RuntimeError`` if none."""
        if self._advertised is None:
            raise RuntimeError("the relay has no advertised_url for remote sandboxes")
        return self.core.url_for(rollout_id, self._advertised)

    def _serving(self) -> Listening:
        if self._listening is None:
            raise RuntimeError("the relay is not serving: use `async with Relay(...) as relay:`")
        return self._listening


class RegisterRequest(BaseModel):
    """Body of ``POST /admin/rollouts`` on a standalone relay."""

    rollout_id: str
    upstream_url: str | None = None
    upstream_api_key: str | None = None
    policy_version: str | None = None


class _AdminApp:
    """Register and end rollouts over HTTP, for a relay running as its own process.

    ``POST /admin/rollouts`` -> grant; ``GET /admin/rollouts/{id}/trace`` -> snapshot;
    ``DELETE /admin/rollouts/{id}`` -> end, returning the trace. Every call needs
    ``Authorization: Bearer <admin token>``; sandboxes never receive that token.
    """

    def __init__(self, core: RelayCore, token: str) -> None:
        self._core = core
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:]
        if not hmac.compare_digest(given, self._token):
            return await _reply_error(
                send,
                401,
                "admin routes need the relay's admin token",
                "bad_admin_token",
                "authentication_error",
            )
        parts = scope["path"].strip("/").split("/")  # admin, rollouts, [id, [trace]]
        method = scope["method"]
        try:
            if parts == ["admin", "rollouts"] and method == "POST":
                body = await _read_all(receive)
                request = RegisterRequest.model_validate_json(body)
                grant = self._core.register(
                    request.rollout_id,
                    upstream_url=request.upstream_url,
                    upstream_api_key=request.upstream_api_key,
                    policy_version=request.policy_version,
                )
                return await _reply(send, 201, _grant_json(grant))
            if len(parts) == 3 and parts[:2] == ["admin", "rollouts"] and method == "DELETE":
                trace = self._core.end(parts[2])
                return await _reply(send, 200, trace.model_dump_json().encode())
            if len(parts) == 4 and parts[3] == "trace" and method == "GET":
                trace = self._core.trace(parts[2])
                return await _reply(send, 200, trace.model_dump_json().encode())
        except UnknownRolloutError as exc:
            return await _reply_error(send, 404, str(exc), "unknown_rollout")
        except (ValueError, ValidationError) as exc:
            return await _reply_error(send, 400, str(exc), "invalid_request")
        await _reply_error(send, 404, f"no admin route {method} {scope['path']}", "not_found")


def _grant_json(grant: Grant) -> bytes:
    data: dict[str, Any] = {
        "rollout_id": grant.rollout_id,
        "token": grant.token,
        "base_url": grant.base_url,
        "path": grant.path,
    }
    return json.dumps(data).encode()


async def _read_all(receive: Receive) -> bytes:
    body = b""
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body
