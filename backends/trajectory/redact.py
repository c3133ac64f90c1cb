"""Scrub credentials out of text and JSON-like values before they are published.

What is replaced: the exact secrets we were given (the rollout's LLM API key), ``Bearer`` and
``Basic`` authorization values, credentials in URL userinfo (``https://user:pass@host``),
``key=value`` / ``"key": "value"`` assignments whose key names a credential, well-known API key
shapes (``sk-...``, ``ghp_...``, ``AKIA...``), and in JSON-like values every item whose key
names a credential. Token *counts*, token ids and sampled tokens (``prompt_tokens``,
``token_ids``, a logprobs entry's ``token``) are data, not secrets, and are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "[REDACTED]"

# Shorter "secrets" would replace ordinary words; a real API key is never this short.
MIN_SECRET_LENGTH = 8

_CREDENTIAL_WORDS = r"(?:api[_-]?key|apikey|access[_-]?key|secret(?:[_-]?key)?|password|passwd|pwd|credentials?|authorization|auth[_-]?token|access[_-]?token|refresh[_-]?token|id[_-]?token|session[_-]?token|private[_-]?key|client[_-]?secret|cookie|x[_-]api[_-]key|token)"

_SENSITIVE_KEY = re.compile(
    rf"^(?:.*[_-])?{_CREDENTIAL_WORDS}$|^(?:.*[_-])?token$|^set[_-]cookie$", re.IGNORECASE
)

_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Authorization header values.
    (re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]{4,}", re.IGNORECASE), rf"\1 {REDACTED}"),
    # URL userinfo: scheme://user:password@host (or a bare token as user).
    (
        re.compile(
            r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]{0,30}://)[^/\s:@\"']{1,256}(?::[^/\s@\"']{0,256})?@"
        ),
        rf"\1{REDACTED}@",
    ),
    # "api_key": "value", api_key=value, Authorization: value, password: value.
    (
        re.compile(
            rf"(\"?(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{{0,40}}?{_CREDENTIAL_WORDS}\"?\s*[:=]\s*\"?)(?!\[REDACTED\])([^\s\"',;&}}]+)",
            re.IGNORECASE,
        ),
        rf"\1{REDACTED}",
    ),
    # Well-known key shapes. (Every repetition above is bounded or anchored: these patterns run
    # over whole tool outputs, and an unbounded one turns quadratic on a long run of letters.)
    (re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), REDACTED),
]


def is_sensitive_key(key: str) -> bool:
    # Real header and field names are short; a long "key" is data, and not worth a regex scan.
    return len(key) <= 128 and bool(_SENSITIVE_KEY.match(key))


class Redactor:
    """Replaces secrets in strings and, recursively, in dicts and lists."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        # Longest first, so a secret that contains another is replaced whole.
        self.secrets = sorted(
            {s for s in secrets if s and len(s) >= MIN_SECRET_LENGTH}, key=len, reverse=True
        )

    def text(self, value: str) -> str:
        for secret in self.secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        for pattern, replacement in _PATTERNS:
            value = pattern.sub(replacement, value)
        return value

    def secrets_only(self, value: str) -> str:
        """Replace only the exact secrets: cheap, and leaves every other byte as it was."""
        for secret in self.secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value

    def value(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, Mapping):
            # In a logprobs entry ({"token": ..., "logprob": ...}) "token" is sampled text.
            data_key = "token" if "logprob" in obj else None
            return {
                key: (
                    REDACTED
                    if isinstance(key, str) and key != data_key and is_sensitive_key(key) and item
                    else self.value(item)
                )
                for key, item in obj.items()
            }
        if isinstance(obj, list | tuple):
            # Numbers pass without a call: a long prompt's token ids are millions of them.
            return [item if type(item) in _SCALARS else self.value(item) for item in obj]
        return obj


_SCALARS = frozenset({int, float, bool, type(None)})


def redact_text(value: str, secrets: Iterable[str | None] = ()) -> str:
    return Redactor(secrets).text(value)


def redact_value(obj: Any, secrets: Iterable[str | None] = ()) -> Any:
    return Redactor(secrets).value(obj)
