"""The rollout server: a raw ASGI app speaking the trainer's wire protocol over a backend.

Endpoints (the reference protocol, section 4):

- ``GET /health``: backend health, ``instance_id``, ``process_id``, ``lifecycle``; ``status``
  is ``ok``, ``draining``, or ``unhealthy`` (with ``error``) once the state file fails.
- ``POST /rollout``: 202 with a polling lease; 409 duplicate id; 429 (``Retry-After``) when the
  backend is full; 503 while draining or unhealthy; 422 naming the bad field.
- ``GET /rollout/{id}/result``: long poll with the lease header; 404 unknown id; 403 wrong lease.
- ``POST /rollout/cancel``: ``{ids}``, ``{prefix}`` or ``{all: true}``.

No framework: routing four paths by hand costs nothing, and at a thousand rollouts a second
every layer of middleware shows. State lives in memory for speed and in a SQLite file
(``store.py``) for restarts; the server answers 202 only once acceptance is committed and
serves a final result only once it is committed, so nothing it has told a client is lost if
it dies. Work runs in a task group owned by the ASGI lifespan, so shutting the app down
cancels and finishes every rollout it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import anyio
from pydantic import ValidationError

from backends.asgi import Receive, Scope, Send, send_json
from backends.rollout.artifacts import ENV_HOME, default_rollout_root
from backends.rollout.backend import CancelDisposition, ExecutionBackend, start_backend
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure, describe
from backends.rollout.request import (
    POLICY_TRACE_FIELD,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
)
from backends.rollout.sample import utf8_json_text
from backends.server.protocol import (
    LEASE_HEADER,
    LEASE_HEADER_ALIAS,
    CancelRolloutsRequest,
    ProtocolError,
    RolloutInitRequest,
    from_validation_error,
    invalid,
    result_body,
)
from backends.server.store import Store
from backends.trajectory.redact import MIN_SECRET_LENGTH, REDACTED, redact_text
from backends.trajectory.save import TrajectoryWriter

if TYPE_CHECKING:
    from backends.relay import Relay

log = logging.getLogger(__name__)


ENV_STATE_FILE = "BACKENDS_SERVER_STATE"
ENV_PREVIEW_ROOT = "BACKENDS_PREVIEW_ROOT"
ENV_INSTANCE_ID = "BACKENDS_INSTANCE_ID"
RETRY_AFTER_SEC = 5
RECORD_ATTEMPTS = 3  # a final result that will not commit is retried this often, then failed
RECORD_RETRY_SEC = 0.2


def default_state_file() -> Path:
    """``$BACKENDS_SERVER_STATE``, else ``$BACKENDS_HOME/server-state.sqlite3``."""
    if path := os.environ.get(ENV_STATE_FILE):
        return Path(path)
    home = os.environ.get(ENV_HOME)
    return (Path(home) if home else Path.home() / ".backends") / "server-state.sqlite3"


@dataclass(slots=True, eq=False)
class _Rollout:
    """One rollout as the server tracks it (in memory; the durable copy is in the store)."""

    rollout_id: str
    lease_sha256: str
    lease_deadline: float = 0.0  # monotonic; renewed by every poll
    body: bytes | None = None  # the final result, as served (set once it is durable)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)  # long polls
    status: RolloutStatus = RolloutStatus.QUEUED
    finished_at: float | None = None  # wall clock, for retention
    scope: anyio.CancelScope | None = None
    cancel_requested: bool = False
    cancel_deadline: float | None = None
    started: bool = False  # handed to the backend: a cancel now stops a running rollout
    disposition: str | None = None  # what the first cancel answered; a repeat says the same
    lease_expired: bool = False
    delivered: bool = False


class RolloutServer:
    """The ASGI app ``create_rollout_server`` returns. See the module docstring."""

    def __init__(
        self,
        backend: ExecutionBackend,
        *,
        state_file: Path | str | None = None,
        api_key: str | None = None,
        result_wait_timeout_sec: float = 30.0,
        polling_lease_timeout_sec: float = 120.0,
        result_retention_sec: float = 900.0,
        artifacts_root: Path | str | None = "default",
        preview_root: Path | str | None = "env",
        preview_interval_sec: float = 3.0,
        max_body_bytes: int = 16 * 1024 * 1024,
        drain_timeout_sec: float = 30.0,
        cancel_grace_sec: float = 10.0,
        drain_linger_sec: float = 5.0,
        synchronous: str = "NORMAL",
        relay: Relay | bool | None = None,
    ) -> None:
        if not 0 < result_wait_timeout_sec < polling_lease_timeout_sec:
            raise ValueError(
                "need 0 < result_wait_timeout_sec < polling_lease_timeout_sec, so a client that "
                "keeps polling never loses its lease"
            )
        if result_retention_sec <= 0 or max_body_bytes <= 0:
            raise ValueError("result_retention_sec and max_body_bytes must be positive")
        self.relay: Relay | None = None
        self._owns_relay = relay is True
        if relay is True:
            from backends.relay import Relay

            relay = Relay()  # no upstream of its own: each request names its endpoint and key
        if relay:
            from backends.relayed import RelayedBackend

            self.relay = relay  # type: ignore[assignment]
            backend = RelayedBackend(backend, self.relay)  # type: ignore[arg-type]
        self.backend = backend
        self.state_file = Path(state_file) if state_file is not None else default_state_file()
        self._api_key = api_key.encode() if api_key else None
        self.result_wait_timeout_sec = result_wait_timeout_sec
        self.polling_lease_timeout_sec = polling_lease_timeout_sec
        self.result_retention_sec = result_retention_sec
        if artifacts_root == "default":
            artifacts_root = default_rollout_root()
        self.artifacts_root = Path(artifacts_root) if artifacts_root is not None else None
        self._trajectories = (
            TrajectoryWriter(self.artifacts_root) if self.artifacts_root is not None else None
        )
        if preview_root == "env":
            preview_root = os.environ.get(ENV_PREVIEW_ROOT) or None
        self.preview_root = Path(preview_root) if preview_root is not None else None
        self.preview_interval_sec = preview_interval_sec
        self.max_body_bytes = max_body_bytes
        self.drain_timeout_sec = drain_timeout_sec
        self.cancel_grace_sec = cancel_grace_sec
        self.drain_linger_sec = drain_linger_sec
        self.process_id = uuid.uuid4().hex
        self.instance_id = os.environ.get(ENV_INSTANCE_ID) or self.process_id

        self._store = Store(self.state_file, synchronous=synchronous)
        self._state_error: str | None = None  # set once a final result could not be committed
        self._admission_error: str | None = None  # the last admission's commit failed: why
        self._rollouts: dict[str, _Rollout] = {}
        self._active: dict[str, _Rollout] = {}
        self._keys: dict[str, str] = {}  # in memory only, while the rollout runs
        self._finished: deque[tuple[float, str]] = deque()
        self._tasks = _Tasks()
        self._running = False
        self._accepting = False
        self._drain_requested = anyio.Event()
        self._drained = anyio.Event()
        self._draining = False
        self._drain_listeners: list[Callable[[], None]] = []
        self._lease_header = LEASE_HEADER.encode()
        self._lease_alias = LEASE_HEADER_ALIAS.encode()
        self._init_response_tail = (
            f', "status": "queued", "result_wait_timeout_sec": {result_wait_timeout_sec}, '
            f'"polling_lease_timeout_sec": {polling_lease_timeout_sec}}}'
        ).encode()

    # -- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        started = False
        try:
            self._open()  # outside the task group, so a failure reads plainly
            async with contextlib.AsyncExitStack() as stack:
                if self._owns_relay:
                    assert self.relay is not None
                    await stack.enter_async_context(self.relay)
                # Warm-up before the first rollout is admitted; a backend that cannot start
                # fails the server's startup rather than every rollout.
                await start_backend(self.backend)
                if self._trajectories is not None:
                    self._trajectories.start()
                    stack.push_async_callback(self._close_trajectories)
                stack.push_async_callback(self._close_tasks)
                async with anyio.create_task_group() as tg:
                    self._running = self._accepting = True
                    tg.start_soon(self._sweep)
                    tg.start_soon(self._drain_on_request)
                    if self.preview_root is not None:
                        from backends.server.previews import publish_previews

                        tg.start_soon(publish_previews, self)
                    started = True
                    await send({"type": "lifespan.startup.complete"})
                    await receive()  # lifespan.shutdown
                    # HTTP has stopped by now: nobody could collect results, so no lingering.
                    await self.drain(linger=False)
                    tg.cancel_scope.cancel()
            await self._store.aclose()
        except BaseException as exc:
            await self._store.aclose()
            kind = "shutdown" if started else "startup"
            await send({"type": f"lifespan.{kind}.failed", "message": describe(exc)})
            if started:
                raise
            return
        await send({"type": "lifespan.shutdown.complete"})

    async def _close_tasks(self) -> None:
        self._running = self._accepting = False
        with anyio.CancelScope(shield=True):
            await self._tasks.aclose()

    async def _close_trajectories(self) -> None:
        assert self._trajectories is not None
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._trajectories.close, 60)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        try:
            if self._api_key is not None:
                self._authorize(scope)
            if not self._running:
                raise ProtocolError(503, "the server is not running (ASGI lifespan not started)")
            if path == "/rollout":
                _allow(method, "POST")
                await self._submit(scope, receive, send)
            elif path.startswith("/rollout/") and path.endswith("/result"):
                _allow(method, "GET")
                await self._result(scope, path[len("/rollout/") : -len("/result")], send)
            elif path == "/rollout/cancel":
                _allow(method, "POST")
                await self._cancel_route(scope, receive, send)
            elif path == "/health":
                _allow(method, "GET")
                await _respond(send, 200, _dumps(self.health()))
            else:
                raise ProtocolError(404, f"no route {path}")
        except ProtocolError as exc:
            headers = [(k.encode(), v.encode()) for k, v in exc.headers.items()]
            await _respond(send, exc.status, _dumps({"detail": exc.detail}), headers)
        except _ClientGone:
            return
        except Exception:
            log.exception("rollout server: %s %s failed", method, path)
            await _respond(send, 500, b'{"detail": "internal server error"}')

    def _authorize(self, scope: Scope) -> None:
        assert self._api_key is not None
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.partition(b" ")
        # Constant time, so the comparison leaks nothing about the key.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._api_key):
            raise ProtocolError(
                401, "missing or wrong bearer token", {"www-authenticate": "Bearer"}
            )

    # -- POST /rollout ---------------------------------------------------------------------

    async def _submit(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._accepting:
            raise ProtocolError(
                503,
                "the server is draining and admits no new rollouts",
                {"retry-after": str(RETRY_AFTER_SEC)},
            )
        if failure := self._state_failure():
            raise _unhealthy(failure)
        raw = await self._read_body(scope, receive)
        try:
            init = RolloutInitRequest.model_validate_json(raw)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        rid = init.rollout_id
        if (existing := self._rollouts.get(rid)) is not None and not _resubmittable(existing):
            raise ProtocolError(409, f"rollout {rid!r} already exists")
        if not self.backend.has_capacity():
            raise ProtocolError(
                429, "the backend is at capacity", {"retry-after": str(RETRY_AFTER_SEC)}
            )
        token = secrets.token_urlsafe(32)
        lease_sha = _sha256(token)
        request = init.to_request()
        entry = _Rollout(rid, lease_sha, time.monotonic() + self.polling_lease_timeout_sec)
        self._rollouts[rid] = entry
        self._active[rid] = entry
        if request.api_key and self.preview_root is not None:
            self._keys[rid] = request.api_key
        self._tasks.start(self._run(entry, request))
        try:
            await self._store.accept(rid, lease_sha, time.time(), _request_json(request))
        except Exception as exc:
            # Not durable, so not accepted: stop the work we started and free the id (or give
            # it back to the result it replaced).
            log.exception("could not record rollout %s", rid)
            self._abandon(entry, existing)
            if failure := self._state_failure():
                raise _unhealthy(failure) from None
            # Likely passing (a full disk, a busy file): say why, and when to come back.
            self._admission_error = (
                f"could not record a new rollout in the state file: {describe(exc)}"
            )
            raise ProtocolError(
                503, self._admission_error, {"retry-after": str(RETRY_AFTER_SEC)}
            ) from None
        self._admission_error = None
        body = b'{"rollout_id": ' + _dumps(rid) + b', "polling_lease_token": "'
        await _respond(send, 202, body + token.encode() + b'"' + self._init_response_tail)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise invalid([], f"request body is larger than the {limit}-byte limit")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise invalid([], f"request body is larger than the {limit}-byte limit")
            chunks.append(chunk)
            if not message.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _abandon(self, entry: _Rollout, previous: _Rollout | None = None) -> None:
        entry.cancel_requested = True
        if entry.scope is not None:
            entry.scope.cancel()
        self._active.pop(entry.rollout_id, None)
        self._keys.pop(entry.rollout_id, None)
        if previous is not None:
            self._rollouts[entry.rollout_id] = previous
        else:
            self._rollouts.pop(entry.rollout_id, None)

    # -- one rollout -----------------------------------------------------------------------

    async def _run(self, entry: _Rollout, request: RolloutRequest) -> None:
        result: RolloutResult | None = None
        try:
            with anyio.CancelScope() as scope:
                entry.scope = scope
                if entry.cancel_requested:
                    scope.cancel()
                entry.started = True
                try:
                    result = await self.backend.execute(request)
                except Exception as exc:
                    log.exception("backend crashed running rollout %s", entry.rollout_id)
                    result = RolloutResult.failed(
                        entry.rollout_id,
                        RolloutFailure(
                            category=ErrorCategory.INTERNAL_ERROR,
                            phase=Phase.AGENT,
                            message=f"the backend crashed: {describe(exc)}",
                        ),
                    )
        except BaseException:
            # Shutdown cancelled this task: still record a result, shielded and bounded.
            entry.scope = None
            if entry.rollout_id in self._rollouts:
                with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                    await self._publish(entry, request, self._final(entry, None))
            raise
        entry.scope = None
        if entry.rollout_id in self._rollouts:  # not abandoned
            await self._publish(entry, request, self._final(entry, result))

    def _final(self, entry: _Rollout, result: RolloutResult | None) -> RolloutResult:
        rid = entry.rollout_id
        if entry.lease_expired:
            return RolloutResult.failed(
                rid,
                RolloutFailure(
                    category=ErrorCategory.LEASE_EXPIRED,
                    phase=Phase.AGENT,
                    message=f"polling lease expired: no result poll for "
                    f"{self.polling_lease_timeout_sec:g}s, so the rollout was cancelled",
                ),
            )
        if result is None:
            return RolloutResult.failed(
                rid,
                RolloutFailure(
                    category=ErrorCategory.CANCELLED, phase=Phase.AGENT, message="rollout cancelled"
                ),
            )
        if result.rollout_id != rid:  # a backend bug must not file a result under another id
            result = result.model_copy(update={"rollout_id": rid})
        return result

    async def _publish(
        self, entry: _Rollout, request: RolloutRequest, result: RolloutResult
    ) -> None:
        rid = entry.rollout_id
        key = request.api_key
        body = result_body(result)
        if self.relay is not None and result.policy_trace is not None:
            # Token ids and logprobs, for the trainer.
            body[POLICY_TRACE_FIELD] = result.policy_trace.model_dump(mode="json")
        text, data = _result_json(body, key)
        finished_at = time.time()
        error = await self._record(rid, result.status.value, finished_at, text)
        if error is not None:
            # Never serve a result that is not committed: after a restart it would read as
            # an interrupted failure, and the trainer may already have trained on it. Serve a
            # failure instead (small, so it may still fit) and stop admitting rollouts.
            self._state_error = f"could not record a rollout's result in the state file: {error}"
            log.error("rollout server unhealthy: %s", self._state_error)
            result = RolloutResult.failed(
                rid,
                RolloutFailure(
                    category=ErrorCategory.INTERNAL_ERROR,
                    phase=Phase.AGENT,
                    message=f"the server could not record this rollout's result in its state "
                    f"file ({error}), so it withholds it; the rollout can be resubmitted under the same "
                    "id once the server is healthy",
                ),
            )
            text, data = _result_json(result_body(result), key)
            # Served even if this fails too: a restart reads the rollout as failed as well.
            await self._record(rid, result.status.value, finished_at, text, attempts=1)
        entry.body = data
        entry.status = result.status
        entry.finished_at = finished_at
        self._active.pop(rid, None)
        self._keys.pop(rid, None)
        self._finished.append((finished_at, rid))
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._trajectories is not None:
            # Saved in the background once the result is durable and served: a file never
            # delays a result, and a burst waits for the writer instead of being dropped.
            await self._trajectories.submit(result, secrets=[key])

    async def _record(
        self,
        rid: str,
        status: str,
        finished_at: float,
        text: str,
        attempts: int = RECORD_ATTEMPTS,
    ) -> str | None:
        """Commit a final result, retrying a few times; ``None`` once committed, else why not."""
        error = "not attempted"
        for attempt in range(1, attempts + 1):
            try:
                await self._store.finish(rid, status, finished_at, text)
                return None
            except Exception as exc:
                error = describe(exc)
                log.error(
                    "could not record the result of rollout %s (attempt %d of %d): %s",
                    rid, attempt, attempts, error,
                )  # fmt: skip
            if attempt == attempts or self._store.failure is not None:
                break  # a stopped writer does not come back
            await anyio.sleep(RECORD_RETRY_SEC * attempt)
        return error

    # -- GET /rollout/{id}/result ----------------------------------------------------------

    async def _result(self, scope: Scope, rid: str, send: Send) -> None:
        entry = self._rollouts.get(rid)
        if entry is None:
            raise ProtocolError(404, f"unknown rollout {rid!r}")
        lease = _header(scope, self._lease_header) or _header(scope, self._lease_alias)
        if lease is None or not hmac.compare_digest(
            _sha256(lease.decode("latin-1")), entry.lease_sha256
        ):
            raise ProtocolError(403, "missing or wrong polling lease for this rollout")
        wait = self.result_wait_timeout_sec
        if scope["query_string"]:
            wait = _wait_param(scope["query_string"], wait)
        if entry.body is None:
            entry.lease_deadline = time.monotonic() + self.polling_lease_timeout_sec
            await _wait_for_result(entry, wait)
            entry.lease_deadline = time.monotonic() + self.polling_lease_timeout_sec
        if entry.body is not None:
            entry.delivered = True
            await _respond(send, 200, entry.body)
            return
        live = self.backend.status(rid) or entry.status
        await _respond(send, 200, _dumps({"rollout_id": rid, "status": live.value}))

    # -- POST /rollout/cancel --------------------------------------------------------------

    async def _cancel_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await self._read_body(scope, receive)
        try:
            req = CancelRolloutsRequest.model_validate_json(raw)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        dispositions = self.cancel(ids=req.ids, prefix=req.prefix, all=req.all)
        await _respond(send, 200, _dumps({"dispositions": dispositions}))

    def cancel(
        self, ids: list[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, str]:
        """Cancel rollouts in flight; finished or unknown ids are ``not_found``."""
        if all:
            wanted = list(self._active)
        elif prefix is not None:
            wanted = [rid for rid in self._active if rid.startswith(prefix)]
        else:
            wanted = list(dict.fromkeys(ids or []))
        found = [self._active[rid] for rid in wanted if rid in self._active]
        out = {rid: CancelDisposition.NOT_FOUND.value for rid in wanted}
        out.update(self._cancel_entries(found))
        return out

    def _cancel_entries(self, entries: list[_Rollout]) -> dict[str, str]:
        if not entries:
            return {}
        ids = [e.rollout_id for e in entries]
        live = {rid: self.backend.status(rid) for rid in ids}
        try:
            # The backend's own cancel lets it tear down sandboxes and report the phase.
            answered = self.backend.cancel(ids=ids)
        except Exception:
            log.exception("backend cancel failed; cancelling the server's tasks instead")
            answered = {}
        deadline = time.monotonic() + self.cancel_grace_sec
        out: dict[str, str] = {}
        for entry in entries:
            rid = entry.rollout_id
            if entry.disposition is not None:  # a repeat: what it was when first cancelled
                out[rid] = entry.disposition
                continue
            entry.cancel_requested = True
            entry.cancel_deadline = deadline
            disposition = answered.get(rid)
            if disposition is None or disposition == CancelDisposition.NOT_FOUND:
                # The backend has not seen it yet (or cannot cancel): stop our own task.
                if entry.scope is not None:
                    entry.scope.cancel()
                # Unknown to the backend yet started: it ran, and may be finishing.
                queued = live[rid] is RolloutStatus.QUEUED or not entry.started
                disposition = (
                    CancelDisposition.CANCELLED_QUEUED
                    if queued
                    else CancelDisposition.CANCELLED_RUNNING
                )
            out[rid] = entry.disposition = CancelDisposition(disposition).value
        return out

    def active_ids(self) -> list[str]:
        """Ids of the rollouts in flight."""
        return list(self._active)

    def rollout_secrets(self, rollout_id: str) -> list[str]:
        """Secrets to redact from this rollout's previews (its LLM API key)."""
        key = self._keys.get(rollout_id)
        return [key] if key else []

    # -- health, leases, retention ---------------------------------------------------------

    def health(self) -> dict[str, Any]:
        try:
            backend = dict(self.backend.health())
        except Exception as exc:
            backend = {"backend_error": describe(exc)}
        failure = self._state_failure()
        if failure:
            status = "unhealthy"
        elif not self._accepting:
            status = "draining"
        else:
            status = "degraded" if self._admission_error else "ok"
        out = {
            "status": status,
            **backend,
            "instance_id": self.instance_id,
            "process_id": self.process_id,
            "lifecycle": {
                "accepting_rollouts": self._accepting and not failure,
                "active_rollouts": len(self._active),
            },
        }
        if failure or self._admission_error:
            out["error"] = failure or self._admission_error
        return out

    def _state_failure(self) -> str | None:
        """Why the state file can no longer be trusted with results, if it cannot."""
        return self._state_error or self._store.failure

    async def _sweep(self) -> None:
        period = min(1.0, self.polling_lease_timeout_sec / 4)
        while True:
            await anyio.sleep(period)
            now = time.monotonic()
            expired = [
                e for e in self._active.values() if not e.lease_expired and now > e.lease_deadline
            ]
            for entry in expired:
                log.warning("rollout %s: polling lease expired, cancelling", entry.rollout_id)
                entry.lease_expired = True
            self._cancel_entries([e for e in expired if not e.cancel_requested])
            for entry in self._active.values():
                # A backend that ignores its cancel loses the rollout's task after the grace.
                if (
                    entry.cancel_deadline is not None
                    and now > entry.cancel_deadline
                    and entry.scope
                ):
                    entry.scope.cancel()
            horizon = time.time() - self.result_retention_sec
            while self._finished and self._finished[0][0] < horizon:
                finished_at, rid = self._finished.popleft()
                kept = self._rollouts.get(rid)
                # Not a resubmission of the same id, which finishes later (or not yet).
                if kept is not None and kept.finished_at == finished_at:
                    del self._rollouts[rid]
                    self._store.forget(rid)

    # -- start-up and drain ----------------------------------------------------------------

    def _open(self) -> None:
        rows = self._store.open(
            retention_sec=self.result_retention_sec, interrupted=self._interrupted
        )
        for row in sorted(rows, key=lambda r: r.finished_at or 0.0):
            entry = _Rollout(row.rollout_id, row.lease_sha256)
            entry.body = (row.result or "{}").encode()
            entry.status = RolloutStatus(row.status)
            entry.finished_at = row.finished_at or time.time()
            self._rollouts[row.rollout_id] = entry
            self._finished.append((entry.finished_at, row.rollout_id))

    @staticmethod
    def _interrupted(rollout_id: str) -> tuple[str, str]:
        result = RolloutResult.infra_failure(
            rollout_id,
            "the rollout server stopped (crash, kill or power loss) while this rollout was in "
            "flight; its work was lost and it can be resubmitted under the same id",
            phase=Phase.AGENT,
        )
        return result.status.value, json.dumps(result_body(result))

    def request_drain(self) -> None:
        """Ask the server to drain (what SIGTERM does under ``backends serve``)."""
        self._accepting = False
        self._drain_requested.set()

    def add_drain_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the server has drained (e.g. to stop the HTTP server)."""
        self._drain_listeners.append(callback)

    async def _drain_on_request(self) -> None:
        await self._drain_requested.wait()
        await self.drain(linger=True)
        for callback in self._drain_listeners:
            callback()

    async def drain(self, *, linger: bool = True) -> None:
        """Stop admitting, let rollouts in flight finish for ``drain_timeout_sec``, cancel the
        rest (forcibly after ``cancel_grace_sec``), give clients up to ``drain_linger_sec`` to
        collect those results (``linger``), then close the backend. Safe to call again."""
        if self._draining:
            await self._drained.wait()
            return
        self._draining = True
        self._accepting = False
        try:
            with anyio.move_on_after(self.drain_timeout_sec):
                await self._until(lambda: not self._active)
            if self._active:
                log.warning("drain: cancelling %d rollout(s) still in flight", len(self._active))
                self.cancel(all=True)
                with anyio.move_on_after(self.cancel_grace_sec + 1):
                    await self._until(lambda: not self._active)
                for entry in self._active.values():
                    if entry.scope is not None:
                        entry.scope.cancel()
                with anyio.move_on_after(5):
                    await self._until(lambda: not self._active)
            recent = [e for e in self._rollouts.values() if e.finished_at and not e.delivered]
            with anyio.move_on_after(self.drain_linger_sec if linger else 0):
                await self._until(lambda: all(e.delivered for e in recent))
            with anyio.move_on_after(self.cancel_grace_sec + 5):
                await self.backend.aclose()
        finally:
            self._drained.set()

    @staticmethod
    async def _until(condition: Callable[[], bool]) -> None:
        # Draining happens once per process: polling a condition beats an event per change.
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.05)


def create_rollout_server(*, backend: ExecutionBackend, **options: Any) -> RolloutServer:
    """The trainer-facing ASGI app for ``backend``; run it with ``backends serve`` or uvicorn.

    Options (all keyword): ``state_file`` (SQLite state; default ``$BACKENDS_SERVER_STATE``
    or ``~/.backends/server-state.sqlite3``), ``api_key`` (bearer token for every route),
    ``result_wait_timeout_sec`` (30), ``polling_lease_timeout_sec`` (120),
    ``result_retention_sec`` (900), ``artifacts_root`` (where ``<id>/trajectory.json`` is
    saved; ``None`` saves none), ``preview_root`` (live previews; default
    ``$BACKENDS_PREVIEW_ROOT``, unset means off), ``preview_interval_sec`` (3),
    ``max_body_bytes``, ``drain_timeout_sec``, ``cancel_grace_sec``, ``drain_linger_sec``,
    ``synchronous`` (SQLite: NORMAL or FULL), ``relay`` (default ``None``: off).

    ``relay=True`` routes every rollout's policy calls through a rollout-scoped relay that
    the server starts and stops with itself: the agent gets its own route and a token, never
    the request's ``llm_api_key``; the relay forwards to the request's
    ``chat_completions_url`` with that key. ``relay=<Relay>`` does the same through a relay
    the caller serves (``async with relay:``) and stops. With a relay, each result body
    carries ``policy_trace``: every policy call, with token ids and logprobs when the
    upstream sent them.
    """
    return RolloutServer(backend, **options)


# -- small helpers --------------------------------------------------------------------------


class _Tasks:
    """The rollouts' tasks, owned by the lifespan as a task group would own them: nothing
    outlives the app, and ``aclose`` cancels every task still running and waits for its
    ``finally``. A task that fails is logged; it does not take the server down.

    Not an anyio task group because spawning into one costs 40-80 us of CPU per task since
    anyio 4.14 (each task gets a handle with its own cancel scope and event); at a thousand
    rollouts a second that alone is a tenth of a core. A plain asyncio task costs about 8 us.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("rollout task failed", exc_info=exc)

    async def aclose(self) -> None:
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)


async def _wait_for_result(entry: _Rollout, wait_sec: float) -> None:
    # A bare future and a timer: a tenth of the cost of an anyio event in a cancel scope.
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    entry.waiters.append(waiter)
    timer = loop.call_later(wait_sec, _settle, waiter)
    try:
        await waiter
    finally:
        timer.cancel()
        if waiter in entry.waiters:
            entry.waiters.remove(waiter)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _ClientGone(Exception):
    """The client disconnected before sending its whole request."""


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise ProtocolError(405, f"method {method} not allowed here", {"allow": allowed})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


def _wait_param(query: bytes, default: float) -> float:
    # ``?wait=SECONDS`` shortens the long poll (never lengthens it past the server's bound).
    values = parse_qs(query.decode("latin-1")).get("wait")
    if not values:
        return default
    try:
        wait = float(values[0])
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait) or wait < 0:  # nan would break the timer, inf ignore the bound
        raise ProtocolError(
            422,
            [
                {
                    "loc": ["query", "wait"],
                    "msg": "wait must be a finite number of seconds, 0 or more",
                    "type": "value_error",
                }
            ],
        )
    return min(wait, default)


# Failures that are the server's or the machinery's, not the rollout's: the same id may be
# submitted again (an interrupted rollout's message says so).
_RESUBMITTABLE = frozenset({ErrorCategory.INFRA_ERROR.value, ErrorCategory.INTERNAL_ERROR.value})


def _resubmittable(entry: _Rollout) -> bool:
    if entry.body is None:
        return False  # in flight
    try:
        failure = json.loads(entry.body).get("failure") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(failure, dict) and failure.get("category") in _RESUBMITTABLE


def _unhealthy(failure: str) -> ProtocolError:
    return ProtocolError(
        503,
        f"the server is unhealthy and admits no new rollouts: {failure}",
        {"retry-after": str(RETRY_AFTER_SEC)},
    )


def _sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _request_json(request: RolloutRequest) -> str:
    # The key is never stored: a restarted server cannot resume a rollout anyway.
    url = request.chat_completions_url
    if url and "@" in url:  # credentials in the URL's userinfo are not stored either
        request = request.model_copy(update={"chat_completions_url": redact_text(url)})
    text = request.model_dump_json(exclude={"api_key"})
    key = request.api_key
    if key and len(key) >= MIN_SECRET_LENGTH and key in text:
        text = text.replace(key, REDACTED)
    return text


def _dumps(value: Any) -> bytes:
    return utf8_json_text(json.dumps(value, ensure_ascii=False, default=str))[1]


def _result_json(body: dict[str, Any], key: str | None) -> tuple[str, bytes]:
    """A result body as stored (text) and as served (UTF-8); never fails on odd text."""
    text = json.dumps(body, ensure_ascii=False, default=str)
    if key and len(key) >= MIN_SECRET_LENGTH and key in text:
        text = text.replace(key, REDACTED)  # the key is never stored, nor echoed back
    return utf8_json_text(text)


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_json(send, status, body, headers or ())
