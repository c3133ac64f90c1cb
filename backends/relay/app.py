"""The relay's ASGI app: check the rollout's token, forward to its upstream, record the call.

A raw ASGI callable rather than a framework: two routes do not need a router, and every
microsecond here is added to every policy call of every rollout. The hot path appends bytes and
clock readings to the rollout's call list; parsing them into a trace happens when it is read.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable

import anyio

from backends.asgi import KEEP_CONNECTION, Receive, Scope, Send, send_json
from backends.relay.http1 import (
    ConnectionPool,
    Response,
    Target,
    UpstreamConnectError,
    UpstreamDisconnectedError,
    UpstreamError,
    UpstreamTimeoutError,
)
from backends.relay.tokens import Registry, RolloutState
from backends.relay.trace import CallError, RawCall
from backends.relay.upstream import RelaySettings, Upstream
from backends.relay.wire import BY_ROUTE, CHAT_WIRE, MESSAGES_WIRE, Translation, Wire, WireError

MODELS = "v1/models"
_PREFIX = "/rollouts/"
# Not forwarded back to the client: hop-by-hop, or recomputed by our server.
_DROP_RESPONSE = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"proxy-authenticate"}
)
# Client headers worth passing upstream; everything else (the sandbox's credentials above all)
# stays here.
_FORWARD_REQUEST = frozenset(
    {b"content-type", b"accept", b"user-agent", b"anthropic-version", b"anthropic-beta"}
)
# Statuses below 500 that OpenAI-style SDKs retry (5xx are retried too).
_RETRIED_STATUSES = frozenset({408, 409, 429})
_CLIENT_GONE = "the client disconnected before the answer ended; the upstream call was abandoned"
# A call still running after this long starts watching for the client to hang up.
_WATCH_AFTER_S = 0.02


# The longest line a stream's scrub holds back waiting for its newline.
_MAX_HELD_BYTES = 64 * 1024


class RelayApp:
    """ASGI app serving ``/rollouts/{rollout_id}/v1/{chat/completions,responses,messages,models}``.

    Responses and Messages calls are translated to chat completions (``backends.relay.wire``)
    unless ``settings.native_apis`` says the upstream speaks them; every answer to the agent,
    errors included, is in the format it spoke.
    """

    def __init__(
        self,
        registry: Registry,
        settings: RelaySettings,
        admin: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None,
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.pool = ConnectionPool(
            connect_timeout=settings.connect_timeout_s,
            keepalive_timeout=settings.keepalive_timeout_s,
            ca_file=settings.upstream_ca_file,
        )
        self._admin = admin
        self._version_header = settings.policy_version_header.lower().encode()
        self._session_header = (
            settings.session_header.encode() if settings.session_header is not None else None
        )

    def close(self) -> None:
        """Close pooled upstream connections."""
        self.pool.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # Not served: refused at the handshake (a 403), so a client that tries one first
            # (Codex's Responses over websocket) falls back to HTTP at once.
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return  # lifespan is off
        path: str = scope["path"]
        if path.startswith(_PREFIX):
            await self._rollout_call(scope, receive, send, path)
        elif path == "/health":
            await _reply(send, 200, b'{"status":"ok"}')
        elif self._admin is not None and path.startswith("/admin/"):
            await self._admin(scope, receive, send)
        else:
            await _reply_error(
                send, 404, f"no route {path}: use /rollouts/<id>/v1/...", "not_found"
            )

    async def _rollout_call(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        rollout_id, _, route = path[len(_PREFIX) :].partition("/")
        method: str = scope["method"]
        wire = BY_ROUTE.get(route)
        shape = wire or CHAT_WIRE  # errors answer in the format the agent speaks
        if wire is not None:
            if method != "POST":
                return await _reply_error(
                    send, 405, f"{method} not allowed: use POST", "bad_method", wire=wire
                )
        elif route == MODELS:
            if method != "GET":
                return await _reply_error(send, 405, f"{method} not allowed: use GET", "bad_method")
        else:
            return await _reply_error(
                send,
                404,
                f"/{route} is not relayed: use /v1/chat/completions, /v1/responses, "
                "/v1/messages or /v1/models",
                "not_found",
                # e.g. an Anthropic client's /v1/messages/count_tokens: told in its own shape
                wire=MESSAGES_WIRE if route.startswith("v1/messages/") else CHAT_WIRE,
            )

        token = b""
        length = -1
        retry = 0
        forward = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = value[7:] if value[:7].lower() == b"bearer " else value
            elif name == b"x-api-key" and not token:
                token = value
            elif name == b"content-length":
                length = int(value) if value.isdigit() else -1
            elif name == b"x-stainless-retry-count":
                retry = int(value) if value.isdigit() and len(value) < 4 else 0
            elif name in _FORWARD_REQUEST:
                forward += name + b": " + value + b"\r\n"

        state = self.registry.live.get(rollout_id)
        if state is None:
            if self.registry.has_ended(rollout_id):
                return await _reply_error(
                    send,
                    403,
                    f"rollout {rollout_id!r} has ended; its token is revoked",
                    "rollout_ended",
                    "authentication_error",
                    wire=shape,
                )
            return await _reply_error(
                send,
                404,
                f"no rollout {rollout_id!r} is registered with this relay",
                "unknown_rollout",
                wire=shape,
            )
        if not token:
            how = "x-api-key" if wire is MESSAGES_WIRE else "Authorization: Bearer"
            return await _reply_error(
                send,
                401,
                f"missing token: send '{how} <rollout token>'",
                "missing_token",
                "authentication_error",
                wire=shape,
            )
        if not hmac.compare_digest(token, state.token):
            return await _reply_error(
                send,
                403,
                f"this token is not valid for rollout {rollout_id!r}",
                "invalid_token",
                "authentication_error",
                wire=shape,
            )

        most = self.settings.max_calls_in_flight
        if state.in_flight >= most:
            return await _reply_error(
                send,
                429,
                f"rollout {rollout_id!r} already has {most} calls in flight, the relay's limit "
                "for one rollout (max_calls_in_flight): wait for one to finish",
                "too_many_calls_in_flight",
                "rate_limit_error",
                wire=shape,
            )
        # Admitted: the server no longer closes this connection to make room for new ones. What
        # one rollout holds that way is bounded by the limit above.
        keep = scope.get(KEEP_CONNECTION)
        if keep is not None:
            keep()
        state.in_flight += 1
        try:
            await self._admitted(state, send, receive, route, wire, shape, length, retry, forward)
        finally:
            state.in_flight -= 1

    async def _admitted(
        self,
        state: RolloutState,
        send: Send,
        receive: Receive,
        route: str,
        wire: Wire | None,
        shape: Wire,
        length: int,
        retry: int,
        forward: bytes,
    ) -> None:
        """A call whose token checked out: read its body, record it and forward it."""
        limit = self.settings.max_request_bytes
        if length > limit:
            return await _too_large(send, length, limit, shape)
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await _too_large(send, len(body), limit, shape)

        if route == MODELS:
            call = _record(state, "GET", "/models", body, False, retry)
            await self._forward(
                state, send, receive, call, b"GET", state.upstream.models, forward, b""
            )
            return
        try:
            request = json.loads(body)
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            return await _reply_error(
                send, 400, f"request body is not valid JSON: {exc}", "invalid_json", wire=shape
            )
        except RecursionError:
            return await _reply_error(
                send, 400, "request body is nested too deeply", "invalid_json", wire=shape
            )
        if not isinstance(request, dict):
            return await _reply_error(
                send, 400, "request body must be a JSON object", "invalid_json", wire=shape
            )
        stream = request.get("stream") is True
        if b"content-type" not in forward:
            forward += b"content-type: application/json\r\n"
        if wire is not None and wire is not CHAT_WIRE:
            return await self._other_wire(
                state, send, receive, wire, request, body, stream, retry, forward
            )
        upstream_body = body
        if self.settings.request_token_ids:
            request.update(self.settings.token_request_fields)
            upstream_body = json.dumps(request, separators=(",", ":")).encode()
        call = _record(state, "POST", "/chat/completions", body, stream, retry)
        await self._forward(
            state, send, receive, call, b"POST", state.upstream.chat, forward, upstream_body
        )

    async def _other_wire(
        self,
        state: RolloutState,
        send: Send,
        receive: Receive,
        wire: Wire,
        request: dict[str, object],
        body: bytes,
        stream: bool,
        retry: int,
        forward: bytes,
    ) -> None:
        """A Responses or Messages call: forwarded as is to an upstream that speaks it,
        else translated to chat completions (a request that cannot be is refused here)."""
        upstream = state.upstream
        if wire.name in self.settings.native_apis:
            target = upstream.responses if wire.path == "/responses" else upstream.messages
            if wire is MESSAGES_WIRE:
                forward += upstream.anthropic_key_line()
            call = _record(state, "POST", wire.path, body, stream, retry, wire.name, wire.name)
            await self._forward(
                state, send, receive, call, b"POST", target, forward, body, wire, None
            )
            return
        assert wire.translate is not None
        try:
            translation = wire.translate(request)
            chat = translation.chat_request
            recorded = json.dumps(chat, separators=(",", ":")).encode()
        except (WireError, RecursionError) as exc:
            problem = exc if isinstance(exc, WireError) else "it is nested too deeply"
            return await _reply_error(
                send, 400, f"invalid {wire.name} request: {problem}", "invalid_request", wire=wire
            )
        upstream_body = recorded
        if self.settings.request_token_ids:
            chat.update(self.settings.token_request_fields)
            upstream_body = json.dumps(chat, separators=(",", ":")).encode()
        call = _record(state, "POST", wire.path, recorded, stream, retry, wire.name)
        await self._forward(
            state, send, receive, call, b"POST", upstream.chat, forward, upstream_body, wire,
            translation,
        )  # fmt: skip

    async def _forward(
        self,
        state: RolloutState,
        send: Send,
        receive: Receive,
        call: RawCall,
        method: bytes,
        target: Target,
        headers: bytes,
        body: bytes,
        wire: Wire = CHAT_WIRE,
        translation: Translation | None = None,
    ) -> None:
        generation = call.generation
        # Watch for the agent hanging up during the whole call: cancelling closes the upstream
        # connection, which is how vLLM and SGLang learn to abort the generation and free the
        # GPU, whether it is still thinking, streaming, or building a non-streamed answer.
        with anyio.CancelScope() as gone:
            watch = _DisconnectWatch(receive, gone)
            try:
                await self._exchange(
                    state, send, call, generation, method, target, headers, body, wire, translation
                )
            finally:
                watch.stop()
        if gone.cancelled_caught and not call.done:
            # A stream's client got its status line; any other got nothing.
            status = call.upstream_status if call.stream else None
            _finish(call, generation, status, CallError.CLIENT_DISCONNECTED, _CLIENT_GONE)

    async def _exchange(
        self,
        state: RolloutState,
        send: Send,
        call: RawCall,
        generation: int,
        method: bytes,
        target: Target,
        headers: bytes,
        body: bytes,
        wire: Wire,
        translation: Translation | None,
    ) -> None:
        upstream = state.upstream
        settings = self.settings
        headers += upstream.auth_line()
        if self._session_header is not None:
            headers += self._session_header + b": " + state.rollout_id.encode() + b"\r\n"
        stream = call.stream
        timeout = settings.stream_idle_timeout_s if stream else settings.response_timeout_s

        response = None
        attempts = settings.connect_attempts
        for attempt in range(1, attempts + 1):
            try:
                response = await self.pool.request(target, method, headers, body, timeout)
                break
            except (UpstreamConnectError, UpstreamDisconnectedError) as exc:
                # Retry only what the upstream cannot have acted on: no connection at all, or
                # a pooled connection it had already closed. Anything else is the caller's call.
                unseen = isinstance(exc, UpstreamConnectError) or exc.stale
                if not unseen or attempt == attempts:
                    return await _fail(
                        send,
                        call,
                        generation,
                        CallError.CONNECTION,
                        *_describe(exc, upstream),
                        wire=wire,
                    )
                if isinstance(exc, UpstreamConnectError):
                    await asyncio.sleep(0.05 * attempt)
            except UpstreamTimeoutError as exc:
                return await _fail(
                    send, call, generation, CallError.TIMEOUT, *_describe(exc, upstream), wire=wire
                )
            except UpstreamError as exc:
                return await _fail(
                    send,
                    call,
                    generation,
                    CallError.CONNECTION,
                    *_describe(exc, upstream),
                    wire=wire,
                )
        assert response is not None

        ttfb = time.perf_counter() - call.t0  # the upstream's status line and headers are in
        try:
            status = response.status
            out_headers, version = self._response_headers(response.headers)
            if version is not None and call.generation == generation:
                call.policy_version = version
            if status in (401, 403):
                # The upstream refused the relay's own key: the sandbox cannot fix that, and the
                # upstream's error text may quote the key.
                response.release()
                if call.generation == generation:
                    call.upstream_status = status
                return await _fail(
                    send,
                    call,
                    generation,
                    None,
                    f"the policy upstream refused the relay's credentials (HTTP {status})",
                    http_status=502,
                    code="upstream_auth_rejected",
                    wire=wire,
                )
            # A translated stream the upstream refused is answered as one error body.
            if stream and (translation is None or status < 400):
                await self._pass_stream(
                    response, send, call, generation, out_headers, upstream, wire, translation
                )
                return
            # One deadline for the whole call, headers and body.
            payload = await response.read(max(0.0, settings.response_timeout_s - ttfb))
            payload = upstream.scrub(payload, answer=status < 400)  # an answer may echo it too
            answer = payload
            if translation is not None:
                if status >= 400:
                    answer = wire.upstream_error(status, payload)
                else:
                    try:
                        answer = translation.answer(json.loads(payload))
                    except (ValueError, RecursionError) as exc:  # not a chat completion
                        if call.generation == generation:
                            call.response_body = payload
                            call.upstream_status = status
                        return await _fail(
                            send,
                            call,
                            generation,
                            CallError.UNTRANSLATABLE,
                            f"the policy upstream's answer cannot be given as {wire.name}: {exc}",
                            http_status=502,
                            code="upstream_bad_answer",
                            wire=wire,
                        )
            out_headers.append((b"content-length", str(len(answer)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            await send({"type": "http.response.body", "body": answer})
            if call.generation == generation:
                call.response_body = payload
                call.upstream_status = call.status = status
                call.ttfb_s = ttfb
                call.latency_s = time.perf_counter() - call.t0
                call.done = True
        except UpstreamTimeoutError as exc:
            await _fail(
                send, call, generation, CallError.TIMEOUT, *_describe(exc, upstream), wire=wire
            )
        except UpstreamError as exc:
            await _fail(
                send, call, generation, CallError.CONNECTION, *_describe(exc, upstream), wire=wire
            )
        finally:
            response.release()

    async def _pass_stream(
        self,
        response: Response,
        send: Send,
        call: RawCall,
        generation: int,
        headers: list[tuple[bytes, bytes]],
        upstream: Upstream,
        wire: Wire,
        translation: Translation | None,
    ) -> None:
        status = response.status
        translated = translation.stream() if translation is not None else None
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if call.generation == generation:
            call.upstream_status = status
        chunks = call.chunks
        body = response.chunks(self.settings.stream_idle_timeout_s)

        # Bytes after a chunk's last newline wait for the next one, so no secret the upstream
        # echoes (an error inside a 200 stream, say) is split past the scrub; SSE events end
        # in a newline, so nothing an agent waits for is held back.
        pending = b""

        async def forward(chunk: bytes, last: bool = False) -> None:
            nonlocal pending
            chunk = pending + chunk
            cut = len(chunk) if last or len(chunk) > _MAX_HELD_BYTES else chunk.rfind(b"\n") + 1
            chunk, pending = upstream.scrub(chunk[:cut], answer=status < 400), chunk[cut:]
            if not chunk:
                return
            if call.generation == generation:
                chunks.append(chunk)  # the upstream's bytes: the trace parses those
            if translated is not None and not (chunk := translated.feed(chunk)):
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        failed: UpstreamError | None = None
        try:
            async for chunk in body:
                if call.ttfb_s is None and call.generation == generation:
                    call.ttfb_s = time.perf_counter() - call.t0
                await forward(chunk)
        except UpstreamError as exc:
            failed = exc
        await forward(b"", last=True)
        if failed is not None:
            # Headers are gone already: tell the client in-band, as an SSE error event that
            # OpenAI clients raise as an API error, and close the stream.
            kind = CallError.TIMEOUT if isinstance(failed, TimeoutError) else CallError.CONNECTION
            text, told = _describe(failed, upstream)
            code = f"upstream_{kind.value}"
            if translated is not None:
                event = translated.fail(told, code)
            else:
                event = wire.stream_error(told, code)
            await send({"type": "http.response.body", "body": event, "more_body": False})
            _finish(call, generation, status, kind, text)
            return
        tail = translated.finish() if translated is not None else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        _finish(call, generation, status, None, None)

    def _response_headers(
        self, raw: list[tuple[bytes, bytes]]
    ) -> tuple[list[tuple[bytes, bytes]], str | None]:
        headers = []
        version = None
        for name, value in raw:
            if name in _DROP_RESPONSE:
                continue
            if name == self._version_header:
                version = value.decode("latin-1")
            headers.append((name, value))
        return headers, version


class _DisconnectWatch:
    """Cancels ``scope`` when the client disconnects, until ``stop``.

    The watching task starts only once the call has run ``_WATCH_AFTER_S``: a task (let alone a
    task group) per call measurably slows quick answers, and a client that hung up earlier is
    still seen, as ``receive`` reports a past disconnect at once.
    """

    __slots__ = ("_receive", "_scope", "_task", "_timer")

    def __init__(self, receive: Receive, scope: anyio.CancelScope) -> None:
        self._receive = receive
        self._scope = scope
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._scope.cancel()

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


def _finish(
    call: RawCall,
    generation: int,
    status: int | None,
    error: CallError | None,
    message: str | None,
) -> None:
    if call.generation == generation:
        call.status = status
        call.error, call.error_message = error, message
        call.latency_s = time.perf_counter() - call.t0
        call.done = True


def _record(
    state: RolloutState,
    method: str,
    path: str,
    body: bytes,
    stream: bool,
    retry: int,
    api: str = CHAT_WIRE.name,
    upstream_api: str = CHAT_WIRE.name,
) -> RawCall:
    calls = state.calls
    if retry:
        # An SDK retry resends the same bytes after a failed attempt: fold it into that
        # attempt's record so the trace holds one call, the outcome the client finally got.
        # Only a finished attempt that failed the way SDKs retry, and has had as many attempts
        # as this retry's count, qualifies: an identical concurrent call keeps its own record
        # (and the completion the agent used). Folding clears ``done``, so one failed attempt
        # takes at most one retry.
        for previous in reversed(calls):
            if (
                previous.done
                and previous.attempts == retry
                and _retried(previous)
                and previous.path == path
                and previous.request_body == body
            ):
                previous.generation += 1
                previous.attempts += 1
                previous.t0 = time.perf_counter()
                previous.done = False
                previous.status = previous.upstream_status = None
                previous.error = previous.error_message = None
                previous.response_body = None
                previous.chunks = []
                previous.ttfb_s = previous.latency_s = None
                return previous
    call = RawCall(
        index=len(calls),
        method=method,
        path=path,
        started_at=time.time(),
        t0=time.perf_counter(),
        request_body=body,
        stream=stream,
        policy_version=state.policy_version,
        api=api,
        upstream_api=upstream_api,
    )
    calls.append(call)
    return call


def _retried(call: RawCall) -> bool:
    """The call failed in a way that OpenAI-style SDKs retry."""
    status = call.status
    return call.error is not None or (
        status is not None and (status >= 500 or status in _RETRIED_STATUSES)
    )


async def _fail(
    send: Send,
    call: RawCall,
    generation: int,
    error: CallError | None,
    message: str,
    told: str | None = None,
    *,
    http_status: int | None = None,
    code: str | None = None,
    wire: Wire = CHAT_WIRE,
) -> None:
    """Answer the agent with an error (``told``, else ``message``); the trace keeps ``message``."""
    if http_status is None:
        http_status = 504 if error is CallError.TIMEOUT else 502
    if code is None:
        code = "upstream_timeout" if error is CallError.TIMEOUT else "upstream_unreachable"
    body = wire.error_body(http_status, told or message, code, "policy_error")
    await _reply(send, http_status, body)
    if call.generation == generation:
        call.status = http_status
        call.error = error
        call.error_message = message
        call.latency_s = time.perf_counter() - call.t0
        call.done = True


def _describe(exc: BaseException, upstream: Upstream) -> tuple[str, str]:
    """An upstream failure twice: as the trace records it (for the operator, on the host) and
    as the agent is told. The agent never learns where the upstream is: connection errors
    name its host and port, so it gets a fixed text; a timeout's own text names only a
    duration."""
    recorded = f"policy upstream {upstream.base_url}: {exc}"
    if isinstance(exc, UpstreamTimeoutError):
        return recorded, f"the policy upstream timed out: {exc}"
    return recorded, "the policy upstream could not be reached or dropped the connection"


async def _too_large(send: Send, size: int, limit: int, wire: Wire) -> None:
    await _reply(
        send,
        413,
        wire.error_body(
            413,
            f"request body of {size} bytes exceeds the relay's limit of {limit} bytes",
            "request_too_large",
            "invalid_request_error",
        ),
        close=True,
    )


async def _reply_error(
    send: Send,
    status: int,
    message: str,
    code: str,
    kind: str = "invalid_request_error",
    *,
    wire: Wire = CHAT_WIRE,
) -> None:
    await _reply(send, status, wire.error_body(status, message, code, kind))


async def _reply(send: Send, status: int, body: bytes, *, close: bool = False) -> None:
    await send_json(send, status, body, close=close)
