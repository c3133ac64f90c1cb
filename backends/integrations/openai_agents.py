"""The OpenAI Agents SDK on the rollout context.

Construct all three inside ``AgentWorkflow.run()``::

    agent = RolloutAgent(name="solver", instructions="...", model=RolloutModel(),
                         model_settings=ModelSettings(temperature=1.0), tools=[multiply])
    session = RolloutMemorySession()
    await Runner.run(agent, ctx.prompt, session=session)     # the workflow returns None

``RolloutModel`` is the SDK's chat-completions model on the rollout's route with its token (plain
chat completions, streamed or not, as the relay serves them). ``RolloutMemorySession`` keeps the
run's items in memory and is the rollout's sample source: the SDK's own conversion of the items
to chat-completions messages (assistant turns with their tool calls, tool outputs) is the
sample's ``messages``, and the native items themselves (reasoning included) are kept in
``sample.extra_fields["openai_agents_items"]``. ``RolloutAgent`` is an ``agents.Agent``
whose model, when left out or given as a name, is a ``RolloutModel``.

Importing this module turns the SDK's tracing off (it would upload traces to OpenAI's servers,
with no key and no network here); set ``BACKENDS_OPENAI_AGENTS_TRACING=1`` to keep it on. The
seed's names ``OsmosisAgent``, ``OsmosisRolloutModel`` and ``OsmosisMemorySession`` are aliases.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from agents import Agent, OpenAIChatCompletionsModel, TResponseInputItem, set_tracing_disabled
from agents.memory import SessionABC
from agents.models.chatcmpl_converter import Converter
from openai import AsyncOpenAI

from backends.integrations.context import active_route
from backends.rollout.context import SampleSource
from backends.rollout.sample import RolloutSample

log = logging.getLogger(__name__)

ENV_TRACING = "BACKENDS_OPENAI_AGENTS_TRACING"
DEFAULT_MODEL = "policy"  # the name sent to the policy; the trainer's server decides what answers
ITEMS_FIELD = "openai_agents_items"  # the session's native items, in the sample's extra_fields

if os.environ.get(ENV_TRACING) != "1":
    set_tracing_disabled(True)


class RolloutModel(OpenAIChatCompletionsModel):
    """The SDK's chat-completions model, resolved to the active rollout's policy route.

    Raises ``RuntimeError`` when constructed outside a rollout.
    """

    def __init__(self, model: str = DEFAULT_MODEL) -> None:
        rollout = active_route("RolloutModel")
        client = AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.api_key or "none")
        rollout.call_on_close(client.close)
        super().__init__(model=model, openai_client=client)


@dataclass
class RolloutAgent(Agent[Any]):
    """An ``agents.Agent`` on the rollout's policy: no model, or a model name, means a
    ``RolloutModel``. A model object is used as given (one that is not a ``RolloutModel``
    bypasses the relay, and its turns are flagged in the result)."""

    def __post_init__(self) -> None:
        if self.model is None or isinstance(self.model, str):
            self.model = RolloutModel(self.model or DEFAULT_MODEL)
        super().__post_init__()


class RolloutMemorySession(SessionABC):
    """An in-memory session that is the active rollout's sample source.

    Raises ``RuntimeError`` outside a rollout, and when the rollout already has a sample source.
    """

    def __init__(self, session_id: str | None = None) -> None:
        rollout = active_route("RolloutMemorySession")
        self.session_id = session_id or rollout.rollout_id or "rollout"
        self.session_settings = None
        self.items: list[TResponseInputItem] = []
        rollout.set_sample_source(SessionSampleSource(self))

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        items = self.items if limit is None else self.items[-limit:] if limit > 0 else []
        return copy.deepcopy(items)

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        self.items.extend(copy.deepcopy(items))

    async def pop_item(self) -> TResponseInputItem | None:
        return self.items.pop() if self.items else None

    async def clear_session(self) -> None:
        self.items.clear()


class SessionSampleSource(SampleSource):
    """A session's items as a rollout sample, with a bounded live preview."""

    def __init__(self, session: RolloutMemorySession) -> None:
        self.session = session

    async def get_sample(self) -> RolloutSample:
        items = _json(self.session.items)
        return RolloutSample(messages=_messages(items), extra_fields={ITEMS_FIELD: items})

    async def get_preview(self, max_messages: int) -> RolloutSample | None:
        if max_messages <= 0:
            return None
        return RolloutSample(messages=_messages(_json(self.session.items))[-max_messages:])


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # The SDK's own conversion: assistant tool calls and tool outputs become chat turns.
    try:
        return _json(Converter.items_to_messages(items))  # type: ignore[arg-type]
    except Exception as exc:
        log.warning("OpenAI Agents items kept without their tool turns: %s", exc)
        return [item for item in items if isinstance(item.get("role"), str)]


def _json(items: Any) -> list[dict[str, Any]]:
    # Items are TypedDicts that may hold SDK objects; the sample holds plain JSON.
    data: list[dict[str, Any]] = json.loads(json.dumps(items, default=_plain))
    return data


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else str(value)


# The seed's names, so its examples run with only the import changed.
OsmosisAgent = RolloutAgent
OsmosisRolloutModel = RolloutModel
OsmosisMemorySession = RolloutMemorySession

__all__ = [
    "ENV_TRACING",
    "ITEMS_FIELD",
    "OsmosisAgent",
    "OsmosisMemorySession",
    "OsmosisRolloutModel",
    "RolloutAgent",
    "RolloutMemorySession",
    "RolloutModel",
    "SessionSampleSource",
]
