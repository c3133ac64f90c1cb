"""The upstream side of the relay: where calls go, with which key, and how the relay behaves.

The forwarding client is ``backends.relay.http1`` (see there for the measurement that chose it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from backends.relay.http1 import Target

CHAT_SUFFIX = "/chat/completions"


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
    # connection the upstream had closed). A call the upstream may have seen is not repeated.
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


@dataclass(frozen=True, slots=True)
class Upstream:
    """One OpenAI-compatible upstream: its base URL and the key the relay presents to it."""

    base_url: str
    api_key: str | None = field(repr=False)
    chat: Target
    models: Target

    @classmethod
    def parse(cls, url: str, api_key: str | None) -> Upstream:
        """Accept a base URL (``http://host:8000/v1``) or a full chat completions URL.

        Raises ``ValueError`` for anything that is not an absolute http(s) URL.
        """
        text = url.strip().rstrip("/")
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {url!r} is not an absolute http(s) URL")
        if api_key and (not api_key.isprintable() or " " in api_key):
            # It goes into a header line verbatim: no way to smuggle a second header.
            raise ValueError("the upstream API key holds spaces or control characters")
        if parts.query or parts.fragment:
            raise ValueError(f"upstream URL {url!r} must not carry a query or fragment")
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
        )

    def auth_line(self) -> bytes:
        """The ``Authorization`` header line the relay adds, or nothing without a key."""
        return b"Authorization: Bearer %s\r\n" % self.api_key.encode() if self.api_key else b""

    def scrub(self, body: bytes) -> bytes:
        """Remove the upstream key from bytes bound for a sandbox (error bodies may echo it)."""
        if self.api_key and self.api_key.encode() in body:
            return body.replace(self.api_key.encode(), b"***")
        return body


def error_body(message: str, code: str, kind: str = "policy_error") -> bytes:
    """An OpenAI-style error body, so SDK clients surface ``message`` as the error text."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}
    ).encode()
