"""The contexts a workflow and a grader receive, and the ambient per-rollout context."""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from backends.rollout.sample import MessageDict, RolloutSample, check_reward


class SampleSource(ABC):
    """Something that holds a rollout's conversation, registered by an agent integration.

    ``get_preview`` is an optional, bounded, read-only snapshot for live previews.
    """

    @abstractmethod
    async def get_sample(self) -> RolloutSample:
        """Return the finished sample."""

    async def get_preview(self, max_messages: int) -> RolloutSample | None:
        """Return at most ``max_messages`` recent messages, or ``None`` for no preview."""
        return None


@dataclass
class AgentWorkflowContext[TConfig]:
    """What ``AgentWorkflow.run`` receives. The ground truth is never here."""

    prompt: list[MessageDict]
    config: TConfig | None = None
    metadata: dict[str, Any] | None = None
    artifacts_dir: Path | None = None


@dataclass
class GraderContext:
    """What ``Grader.grade`` receives: the sample, the ground truth (``label``) and row metadata."""

    label: str | None
    sample: RolloutSample | None
    metadata: dict[str, Any] | None = None
    artifacts_dir: Path | None = None

    def set_reward(self, reward: float) -> None:
        """Set the sample's reward. Raises ``ValueError`` for a missing sample or a non-finite value."""
        if self.sample is None:
            raise ValueError("cannot set a reward: there is no sample to grade")
        self.sample.reward = check_reward(reward)


log = logging.getLogger(__name__)

_current: ContextVar[RolloutContext | None] = ContextVar("backends_rollout_context", default=None)

# Inside a sandbox the runner learns its endpoint from these variables.
ENV_CHAT_COMPLETIONS_URL = "BACKENDS_CHAT_COMPLETIONS_URL"
ENV_API_KEY = "BACKENDS_API_KEY"
ENV_ROLLOUT_ID = "BACKENDS_ROLLOUT_ID"


@dataclass
class RolloutContext:
    """The ambient context of one rollout: its policy endpoint and its sample source.

    Agent integrations read ``chat_completions_url`` and ``api_key`` from here instead of a
    hard-coded provider, so every policy call is routed to the rollout-scoped endpoint.
    Entered as a context manager, it becomes what ``get_rollout_context()`` returns.
    """

    chat_completions_url: str | None = None
    api_key: str | None = None
    rollout_id: str | None = None
    preview_enabled: bool = True
    sample_source: SampleSource | None = field(default=None, repr=False)
    _token: Token[RolloutContext | None] | None = field(default=None, init=False, repr=False)
    _closers: list[Callable[[], Awaitable[object]]] = field(
        default_factory=list, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.chat_completions_url = self.chat_completions_url or os.environ.get(
            ENV_CHAT_COMPLETIONS_URL
        )
        self.api_key = self.api_key or os.environ.get(ENV_API_KEY)
        self.rollout_id = self.rollout_id or os.environ.get(ENV_ROLLOUT_ID)

    @property
    def base_url(self) -> str | None:
        """The OpenAI-style base URL (``.../v1``) for clients that append ``/chat/completions``."""
        url = self.chat_completions_url
        if url and url.rstrip("/").endswith("/chat/completions"):
            return url.rstrip("/").removesuffix("/chat/completions")
        return url

    def set_sample_source(self, source: SampleSource) -> None:
        """Register the rollout's one sample source; a second registration is an error."""
        if self.sample_source is not None and self.sample_source is not source:
            raise RuntimeError(
                "a sample source is already registered for this rollout; each rollout has one"
            )
        self.sample_source = source

    def call_on_close(self, closer: Callable[[], Awaitable[object]]) -> None:
        """Await ``closer`` when the rollout's workflow ends (an integration's HTTP client, say)."""
        self._closers.append(closer)

    @property
    def has_closers(self) -> bool:
        return bool(self._closers)

    async def aclose(self) -> None:
        """Run the closers, last registered first; a failing one is logged, not raised."""
        while self._closers:
            closer = self._closers.pop()
            try:
                await closer()
            except Exception:
                log.exception("closing a resource of rollout %s failed", self.rollout_id)

    async def get_sample(self) -> RolloutSample:
        if self.sample_source is None:
            raise LookupError("no sample source is registered on the rollout context")
        return await self.sample_source.get_sample()

    def __enter__(self) -> RolloutContext:
        self._token = _current.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None


def get_rollout_context() -> RolloutContext | None:
    """The rollout context of the code calling it, or ``None`` outside a rollout."""
    return _current.get()
