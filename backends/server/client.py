"""A Python client for the rollout server's wire protocol (aiohttp: it keeps up under load).

    async with RolloutClient("http://127.0.0.1:8000", api_key=...) as client:
        handle = await client.submit(request)          # RolloutRequest with chat_completions_url
        result = await client.wait(handle, timeout_sec=600)
        await client.cancel(prefix="batch-7/")

Every call has a deadline: a server that accepts the connection and never answers costs
``timeout_sec`` (a long poll: its wait plus that), never a hang, and ``wait(timeout_sec=T)``
returns or raises ``TimeoutError`` within T plus ``WAIT_MARGIN_SEC``, retries included.

Retries are bounded. ``submit`` retries 429 and 503 after the server's ``Retry-After`` (clamped
to 0.05-60 s) and a connection that could not be opened (nothing was sent, so nothing can be
admitted twice). Result polls also retry transport errors and 502/503/504, since a poll
changes nothing. Everything else raises ``RolloutServerError`` with the status and detail.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
)
from tenacity.stop import stop_base

from backends.rollout.request import RolloutRequest
from backends.server.protocol import LEASE_HEADER, RolloutResultResponse

MIN_RETRY_AFTER_SEC = 0.05
MAX_RETRY_AFTER_SEC = 60.0
WAIT_MARGIN_SEC = 1.0  # what ``wait`` may take past its timeout, for the last poll's answer


class RolloutServerError(Exception):
    """The server refused a request: ``status`` and its ``detail`` say why."""

    def __init__(self, status: int, detail: Any, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.retry_after = retry_after


class _Retry(Exception):
    """An attempt worth repeating; ``retry_after`` comes from the server when it said."""

    def __init__(self, cause: BaseException, retry_after: float | None = None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.retry_after = retry_after


@dataclass(frozen=True)
class RolloutHandle:
    """What ``submit`` returns: the id and the lease that proves the caller may read it."""

    rollout_id: str
    lease: str
    result_wait_timeout_sec: float
    polling_lease_timeout_sec: float


class RolloutClient:
    """``timeout_sec`` bounds each call's answer (a long poll gets its wait on top);
    ``connect_timeout_sec`` bounds opening a connection."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        max_attempts: int = 6,
        timeout_sec: float = 30.0,
        connect_timeout_sec: float = 10.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        for name, value in (
            ("timeout_sec", timeout_sec),
            ("connect_timeout_sec", connect_timeout_sec),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        self.url = url.rstrip("/")
        self.max_attempts = max_attempts
        self.timeout_sec = timeout_sec
        self.connect_timeout_sec = connect_timeout_sec
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = session
        self._owns_session = session is None

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None

    # -- the protocol ----------------------------------------------------------------------

    async def submit(self, request: RolloutRequest | dict[str, Any]) -> RolloutHandle:
        """Start a rollout. Raises ``RolloutServerError`` (409 duplicate id, 422 bad field,
        429/503 once retries are spent), ``TimeoutError`` when the server does not answer in
        ``timeout_sec`` (it may have admitted the rollout: poll or resubmit to find out)."""
        body = _wire_request(request)
        data = await self._call("POST", "/rollout", json=body, expect=202, retry_transport=False)
        return RolloutHandle(
            rollout_id=data["rollout_id"],
            lease=data["polling_lease_token"],
            result_wait_timeout_sec=float(data["result_wait_timeout_sec"]),
            polling_lease_timeout_sec=float(data["polling_lease_timeout_sec"]),
        )

    async def poll(
        self, handle: RolloutHandle, *, wait: float | None = None
    ) -> RolloutResultResponse:
        """One long poll: the final result, or the live status when the wait ends first.
        Raises ``TimeoutError`` when the server does not answer in the wait plus
        ``timeout_sec``."""
        held = handle.result_wait_timeout_sec if wait is None else max(wait, 0.0)
        return await self._poll(handle, wait, _now() + held + self.timeout_sec)

    async def _poll(
        self, handle: RolloutHandle, wait: float | None, deadline: float
    ) -> RolloutResultResponse:
        path = f"/rollout/{handle.rollout_id}/result"
        if wait is not None:
            path += f"?wait={max(wait, 0.0)}"
        data = await self._call(
            "GET",
            path,
            headers={LEASE_HEADER: handle.lease},
            expect=200,
            retry_transport=True,
            deadline=deadline,
        )
        return RolloutResultResponse.model_validate(data)

    async def wait(
        self, handle: RolloutHandle, *, timeout_sec: float | None = None
    ) -> RolloutResultResponse:
        """Poll until the rollout finishes. Raises ``TimeoutError`` after ``timeout_sec`` seconds
        (plus at most ``WAIT_MARGIN_SEC``), whether the rollout is still running or the server
        stopped answering."""
        loop_deadline = math.inf if timeout_sec is None else _now() + timeout_sec
        while True:
            remaining = loop_deadline - _now()
            if remaining <= 0:
                raise TimeoutError(f"rollout {handle.rollout_id} did not finish in {timeout_sec}s")
            wait = min(remaining, handle.result_wait_timeout_sec)
            deadline = min(loop_deadline + WAIT_MARGIN_SEC, _now() + wait + self.timeout_sec)
            try:
                result = await self._poll(handle, wait, deadline)
            except TimeoutError:
                if _now() < loop_deadline:
                    raise  # the server stopped answering well before our own deadline
                raise TimeoutError(
                    f"rollout {handle.rollout_id} did not finish in {timeout_sec}s (the server "
                    "did not answer the last poll)"
                ) from None
            if result.status.terminal:
                return result

    async def run(
        self, request: RolloutRequest | dict[str, Any], *, timeout_sec: float | None = None
    ) -> RolloutResultResponse:
        """Submit and wait."""
        return await self.wait(await self.submit(request), timeout_sec=timeout_sec)

    async def cancel(
        self, ids: list[str] | None = None, *, prefix: str | None = None, all: bool = False
    ) -> dict[str, str]:
        """Cancel by ids, by prefix or all; returns each rollout's disposition."""
        body: dict[str, Any] = {}
        if ids is not None:
            body["ids"] = list(ids)
        if prefix is not None:
            body["prefix"] = prefix
        if all:
            body["all"] = True
        data = await self._call(
            "POST", "/rollout/cancel", json=body, expect=200, retry_transport=False
        )
        return dict(data["dispositions"])

    async def health(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/health", expect=200, retry_transport=True))

    # -- plumbing --------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        expect: int,
        retry_transport: bool,
        json: Any = None,
        headers: dict[str, str] | None = None,
        deadline: float | None = None,
    ) -> Any:
        """One call with bounded retries, each attempt and the whole of it ending by
        ``deadline`` (default: ``timeout_sec`` from now)."""
        deadline = deadline if deadline is not None else _now() + self.timeout_sec
        retrying = AsyncRetrying(
            stop=stop_any(
                stop_after_attempt(self.max_attempts),
                stop_after_delay(10 * MAX_RETRY_AFTER_SEC),
                _StopBefore(deadline),
            ),
            wait=_retry_wait,
            retry=retry_if_exception_type(_Retry),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    limits = aiohttp.ClientTimeout(
                        total=max(deadline - _now(), 0.001),
                        sock_connect=self.connect_timeout_sec,
                    )
                    return await self._once(
                        method, path, expect, retry_transport, json, headers, limits
                    )
        except _Retry as exc:  # attempts spent: raise what the last one met
            raise exc.cause from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _once(
        self,
        method: str,
        path: str,
        expect: int,
        retry_transport: bool,
        json: Any,
        headers: dict[str, str] | None,
        limits: aiohttp.ClientTimeout,
    ) -> Any:
        session = self._get_session()
        try:
            async with session.request(
                method,
                self.url + path,
                json=json,
                headers={**self._headers, **(headers or {})},
                allow_redirects=False,
                timeout=limits,
            ) as response:
                data = await _body(response)
                if response.status == expect:
                    return data
                detail = data.get("detail", data) if isinstance(data, dict) else data
                retry_after = _retry_after(response.headers.get("retry-after"))
                error = RolloutServerError(response.status, detail, retry_after)
                if response.status in (429, 503) or (
                    retry_transport and response.status in (502, 504)
                ):
                    raise _Retry(error, retry_after)
                raise error
        except aiohttp.ClientConnectorError as exc:
            raise _Retry(exc) from None  # never connected: nothing was sent
        except TimeoutError:
            unanswered = TimeoutError(
                f"{method} {path}: the rollout server at {self.url} did not answer in "
                f"{limits.total:.3g}s"
            )
            if retry_transport:
                raise _Retry(unanswered) from None
            raise unanswered from None
        except aiohttp.ClientError as exc:
            if retry_transport:
                raise _Retry(exc) from None
            raise

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Each request brings its own deadline (see ``_call``).
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_sec),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session


def _wire_request(request: RolloutRequest | dict[str, Any]) -> dict[str, Any]:
    if isinstance(request, dict):
        return request
    if not request.chat_completions_url:
        raise ValueError("the request needs a chat_completions_url for the server to route to")
    body: dict[str, Any] = {
        "rollout_id": request.rollout_id,
        "initial_messages": request.prompt,
        "chat_completions_url": request.chat_completions_url,
        "label": request.label,
        "metadata": request.metadata,
        "grade": request.grade,
        "agent_timeout_sec": request.agent_timeout_sec,
        "grader_timeout_sec": request.grader_timeout_sec,
        "extra_fields": request.extra_fields or None,
    }
    if request.api_key:
        body["llm_api_key"] = request.api_key
    return body


async def _body(response: aiohttp.ClientResponse) -> Any:
    try:
        return await response.json(content_type=None)
    except ValueError:
        return {"detail": (await response.text())[:500]}


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    if seconds is None or not math.isfinite(seconds):
        return None
    return min(max(seconds, MIN_RETRY_AFTER_SEC), MAX_RETRY_AFTER_SEC)


def _retry_wait(state: RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome else None
    if isinstance(exc, _Retry) and exc.retry_after is not None:
        return exc.retry_after
    return float(min(0.1 * 2 ** (state.attempt_number - 1), 8.0))


class _StopBefore(stop_base):
    """Stop retrying when the next attempt would start past ``deadline``."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        # Tenacity has computed the sleep before it asks.
        return _now() + retry_state.upcoming_sleep >= self.deadline


def _now() -> float:
    return time.monotonic()
