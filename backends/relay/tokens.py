"""Rollout registration: who may call which route, until when, and where their calls go.

A token is a random secret bound to one rollout id. The relay's route carries the rollout id,
so a token is checked against exactly one expected value: a token of rollout A is refused on
rollout B's route, and ``end`` forgets the token so it is refused from then on.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import quote

from backends.relay.trace import RawCall
from backends.relay.upstream import Upstream

TOKEN_PREFIX = "rlt-"
# A rollout id travels in a URL path: no separators, no spaces, bounded.
_ROLLOUT_ID = re.compile(r"[^/\\\s?#%]{1,256}")


class UnknownRolloutError(KeyError):
    """No live rollout with that id is registered with this relay."""

    def __str__(self) -> str:
        return f"no live rollout {self.args[0]!r} is registered with the relay"


@dataclass(frozen=True)
class Grant:
    """What a rollout needs to reach its policy: a token and its own OpenAI base URL.

    ``token`` is the API key the agent uses (``Authorization: Bearer <token>``). It is valid only
    on this rollout's route and only until the rollout ends. It is not the upstream key.
    """

    rollout_id: str
    token: str = field(repr=False)
    base_url: str  # http://<relay host>:<port>/rollouts/<id>/v1

    @property
    def path(self) -> str:
        """The base URL's path, for building it against another origin."""
        return rollout_path(self.rollout_id)

    def url_at(self, origin: str) -> str:
        """This rollout's base URL as seen from ``origin`` (e.g. ``http://127.0.0.1:8765``
        inside a sandbox with a forwarder, or a remote sandbox's advertised relay URL)."""
        return origin.rstrip("/") + self.path


def rollout_path(rollout_id: str) -> str:
    return f"/rollouts/{quote(rollout_id, safe='')}/v1"


@dataclass(slots=True, eq=False)
class RolloutState:
    rollout_id: str
    token: bytes
    upstream: Upstream
    policy_version: str | None
    registered_at: float
    calls: list[RawCall] = field(default_factory=list)
    in_flight: int = 0  # calls admitted and not yet answered


class Registry:
    """The live rollouts of one relay. Not thread-safe: used from the relay's event loop."""

    def __init__(self, *, remember_ended: int = 100_000) -> None:
        self.live: dict[str, RolloutState] = {}
        # Remembered so a late call gets "rollout ended" (403) rather than "unknown" (404).
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._remember_ended = remember_ended

    def register(
        self, rollout_id: str, upstream: Upstream, policy_version: str | None
    ) -> tuple[RolloutState, str]:
        """Add a rollout and return its state and fresh token.

        Raises ``ValueError`` if the id cannot travel in a URL path or is already live. An id
        that has ended may be registered again (a retried rollout), with a new token.
        """
        if not _ROLLOUT_ID.fullmatch(rollout_id):
            raise ValueError(
                f"rollout id {rollout_id!r} cannot be used in a URL path: "
                "use 1-256 characters with no '/', '\\', '?', '#', '%' or whitespace"
            )
        if rollout_id in self.live:
            raise ValueError(f"rollout {rollout_id!r} is already registered with the relay")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        state = RolloutState(
            rollout_id=rollout_id,
            token=token.encode(),
            upstream=upstream,
            policy_version=policy_version,
            registered_at=time.time(),
        )
        self._ended.pop(rollout_id, None)
        self.live[rollout_id] = state
        return state, token

    def end(self, rollout_id: str) -> RolloutState:
        """Revoke the rollout's token and return its state. Raises ``UnknownRolloutError``."""
        state = self.live.pop(rollout_id, None)
        if state is None:
            raise UnknownRolloutError(rollout_id)
        self._ended[rollout_id] = None
        if len(self._ended) > self._remember_ended:
            self._ended.popitem(last=False)
        return state

    def get(self, rollout_id: str) -> RolloutState:
        state = self.live.get(rollout_id)
        if state is None:
            raise UnknownRolloutError(rollout_id)
        return state

    def has_ended(self, rollout_id: str) -> bool:
        return rollout_id in self._ended
