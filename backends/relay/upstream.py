"""The upstream side of the relay: where calls go, with which key, and how the relay behaves.

The forwarding client is ``backends.relay.http1`` (see there for the measurement that chose it).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from backends.relay.http1 import Target

CHAT_SUFFIX = "/chat/completions"


# The shortest secret masked in answers as well as in errors (real keys are far longer).
MIN_SCRUBBED_IN_ANSWERS = 16


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """How the relay forwards and records. Defaults suit a vLLM/SGLang upstream on a cluster."""

    # Ask the upstream for sampled token ids and logprobs on every chat call (vLLM/SGLang
    # fields; an upstream that rejects unknown fields, like OpenAI's API, must keep this off).
    request_token_ids: bool = False
    token_request_fields: dict[str, Any] = field(
        default_factory=lambda: {"logprobs": True, "return_token_ids": True}
    )
    max_request_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 10.0
    # A non-streaming call must finish within this; a streaming one must not go silent longer.
    response_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 300.0
    # Attempts for a request that never reached the upstream (connection refused, a pooled
    # connection the upstream had closed, seen closing right after the request was written). A
    # call the upstream may have worked on is not repeated.
    connect_attempts: int = 3
    # Response header an upstream may use to say which policy version answered.
    policy_version_header: str = "x-policy-version"
    # Request header carrying the rollout id upstream: sticky routing for prefix caches, and how
    # the scripted policy picks per-rollout scripts.
    session_header: str | None = "x-session-id"
    # Idle pooled connections are dropped before a typical upstream (uvicorn: 5 s) drops them.
    keepalive_timeout_s: float = 4.0
    # Extra CA certificates (PEM) trusted for https upstreams, besides the system's.
    upstream_ca_file: str | None = None
    # Agent formats the upstream speaks itself ("responses", "messages"): forwarded as they
    # come (to <base>/responses, <base>/messages) instead of translated to chat completions.
    # Nothing is added to such requests (no token-id fields: request_token_ids is for chat).
    native_apis: frozenset[str] = frozenset()
    # Calls one rollout may have in flight at once; more are refused with a 429 naming this
    # limit (SDKs retry those). It bounds the connections and upstream calls one sandbox can
    # hold open, whatever it does, so it cannot starve other rollouts.
    max_calls_in_flight: int = 64
    # Connections not serving a rollout's call (waiting for a request, idle between requests,
    # answering one without a rollout token) the relay keeps: past it, the oldest is closed.
    # None: a quarter of the process's open-file limit, at most 4,096.
    max_idle_connections: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.native_apis) - {"responses", "messages"}
        if unknown:
            raise ValueError(
                f"native_apis {sorted(unknown)}: an upstream may speak 'responses' or 'messages'"
            )
        if self.max_calls_in_flight < 1:
            raise ValueError(
                f"max_calls_in_flight must be at least 1, not {self.max_calls_in_flight}"
            )
        if self.max_idle_connections is not None and self.max_idle_connections < 1:
            raise ValueError(
                f"max_idle_connections must be at least 1, not {self.max_idle_connections}"
            )


@dataclass(frozen=True, slots=True)
class Upstream:
    """One OpenAI-compatible upstream: its base URL and the key the relay presents to it.

    Credentials in the URL (``http://user:password@host/v1``) are sent as HTTP Basic auth,
    unless an API key is given: then the key is sent (as a Bearer token) and they are unused.
    ``base_url`` never holds them, so it is safe in error messages and traces.
    """

    base_url: str  # without any user:password
    api_key: str | None = field(repr=False)
    chat: Target
    models: Target
    responses: Target
    messages: Target
    basic_auth: str | None = field(default=None, repr=False)  # "user:password" from the URL

    @classmethod
    def parse(cls, url: str, api_key: str | None) -> Upstream:
        """Accept a base URL (``http://host:8000/v1``) or a full chat completions URL.

        Raises ``ValueError`` for anything that is not an absolute http(s) URL.
        """
        text = url.strip().rstrip("/")
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # Not echoed: an unparsable URL may still carry a password.
            raise ValueError("the upstream URL is not an absolute http(s) URL")
        _check_key(api_key)
        if parts.query or parts.fragment:
            raise ValueError("the upstream URL must not carry a query or fragment")
        basic_auth = None
        if "@" in parts.netloc:
            if parts.username or parts.password:
                basic_auth = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            text = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        if text.endswith(CHAT_SUFFIX):
            text = text[: -len(CHAT_SUFFIX)]
        base_path = urlsplit(text).path
        default_port = 443 if parts.scheme == "https" else 80
        port = parts.port or default_port
        host_header = parts.hostname if port == default_port else f"{parts.hostname}:{port}"
        if ":" in parts.hostname:  # IPv6 literal
            host_header = f"[{parts.hostname}]" + ("" if port == default_port else f":{port}")

        def target(suffix: str) -> Target:
            return Target(
                parts.scheme,
                parts.hostname or "",
                port,
                (base_path + suffix).encode(),
                host_header.encode(),
            )

        return cls(
            base_url=text,
            api_key=api_key or None,
            chat=target(CHAT_SUFFIX),
            models=target("/models"),
            responses=target("/responses"),
            messages=target("/messages"),
            basic_auth=basic_auth,
        )

    def with_api_key(self, api_key: str | None) -> Upstream:
        """The same upstream with another key (or none: back to the URL's credentials)."""
        _check_key(api_key)
        return dataclasses.replace(self, api_key=api_key or None)

    def auth_line(self) -> bytes:
        """The ``Authorization`` header line the relay adds, or nothing without credentials."""
        if self.api_key:
            return b"Authorization: Bearer %s\r\n" % self.api_key.encode()
        if self.basic_auth is not None:
            return b"Authorization: Basic %s\r\n" % base64.b64encode(self.basic_auth.encode())
        return b""

    def anthropic_key_line(self) -> bytes:
        """The key as Anthropic's API takes it (``x-api-key``), for a native Messages upstream."""
        return b"x-api-key: %s\r\n" % self.api_key.encode() if self.api_key else b""

    def scrub(self, body: bytes, *, answer: bool = False) -> bytes:
        """Remove upstream secrets from bytes bound for a sandbox (error bodies may echo them).

        In an `answer` (not an error), only secrets long enough never to be ordinary text: a
        short dummy key ("k", "EMPTY") masked there would mangle the model's output and JSON.
        """
        for secret in self._secrets():
            if answer and len(secret) < MIN_SCRUBBED_IN_ANSWERS:
                continue
            if secret in body:
                body = body.replace(secret, b"***")
        return body

    def _secrets(self) -> list[bytes]:
        secrets = [self.api_key.encode()] if self.api_key else []
        if self.basic_auth is not None:
            secrets.append(base64.b64encode(self.basic_auth.encode()))
            password = self.basic_auth.partition(":")[2].encode()
            if len(password) >= 6:  # a shorter one would mask ordinary text
                secrets.append(password)
        return secrets


def _check_key(api_key: str | None) -> None:
    if api_key and (not api_key.isprintable() or " " in api_key):
        # It goes into a header line verbatim: no way to smuggle a second header.
        raise ValueError("the upstream API key holds spaces or control characters")


def error_body(message: str, code: str, kind: str = "policy_error") -> bytes:
    """An OpenAI-style error body, so SDK clients surface ``message`` as the error text."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}
    ).encode()
