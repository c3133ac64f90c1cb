"""Strands Agents on the rollout context.

Construct both inside ``AgentWorkflow.run()``::

    agent = RolloutStrandsAgent(
        model=RolloutModel(params={"temperature": 1.0}),
        messages=ctx.prompt,          # chat-completions messages; system turns become the system prompt
        tools=[multiply],
        callback_handler=None,
    )
    await agent.invoke_async()        # continues from the prompt; the workflow returns None

``RolloutModel`` is Strands' OpenAI-compatible model pointed at the rollout's route with its
token. The agent registers itself as the rollout's sample source: its Strands history is the
sample's ``messages`` (graders read it), and an OpenAI chat-completions copy, made with Strands'
own request formatter, is ``trajectory_messages`` (the ATIF trajectory and the relay matching use
it). The seed's names ``OsmosisStrandsAgent`` and ``OsmosisRolloutModel`` are aliases.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from strands import Agent
from strands.models.openai import OpenAIModel

from backends.integrations.context import active_route
from backends.rollout.context import SampleSource
from backends.rollout.sample import RolloutSample

log = logging.getLogger(__name__)

# The model name sent to the policy; the trainer's server decides what actually answers.
DEFAULT_MODEL_ID = "policy"


class RolloutModel(OpenAIModel):
    """A Strands model that resolves to the current policy: the active rollout's route.

    ``params`` are chat-completions parameters (``temperature``, ``max_tokens``, ...); other
    keywords are Strands' ``OpenAIModel`` config (``stream``, ...). Raises ``RuntimeError`` when
    constructed outside a rollout.
    """

    def __init__(
        self,
        params: dict[str, Any] | None = None,
        *,
        model_id: str = DEFAULT_MODEL_ID,
        **config: Any,
    ) -> None:
        rollout = active_route("RolloutModel")
        client_args = {"base_url": rollout.base_url, "api_key": rollout.api_key or "none"}
        super().__init__(
            client_args=client_args, model_id=model_id, params=dict(params or {}), **config
        )


class RolloutStrandsAgent(Agent):
    """A ``strands.Agent`` that is the active rollout's sample source.

    ``messages`` may be chat-completions messages (``ctx.prompt``) or Strands messages; system
    messages become the system prompt unless ``system_prompt`` is given. ``model`` defaults to
    a fresh ``RolloutModel``. Raises ``RuntimeError`` outside a rollout.
    """

    def __init__(
        self,
        model: Any = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        system_prompt: Any = None,
        **kwargs: Any,
    ) -> None:
        rollout = active_route("RolloutStrandsAgent")
        history, system = to_strands_messages(messages or [])
        super().__init__(
            model=model if model is not None else RolloutModel(),
            messages=history,  # type: ignore[arg-type]
            system_prompt=system_prompt if system_prompt is not None else system,
            **kwargs,
        )
        rollout.set_sample_source(StrandsSampleSource(self))


class StrandsSampleSource(SampleSource):
    """A Strands agent's history as a rollout sample, with a bounded live preview."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def get_sample(self) -> RolloutSample:
        history = copy.deepcopy([dict(m) for m in self.agent.messages])
        try:
            system = self.agent.system_prompt
            normalized = OpenAIModel.format_request_messages(
                self.agent.messages, system if isinstance(system, str) else None
            )
            trajectory: list[dict[str, Any]] | None = json.loads(json.dumps(normalized))
        except Exception as exc:  # the sample stands; only the trajectory copy is skipped
            log.warning("no chat-completions copy of a Strands history: %s", exc)
            trajectory = None
        return RolloutSample(messages=history, trajectory_messages=trajectory)

    async def get_preview(self, max_messages: int) -> RolloutSample | None:
        if max_messages <= 0:
            return None
        recent = copy.deepcopy([dict(m) for m in self.agent.messages[-max_messages:]])
        return RolloutSample(messages=recent)


def to_strands_messages(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], str | None]:
    """Chat-completions messages as Strands messages, and the system turns' text.

    Text becomes ``{"text"}`` blocks, assistant ``tool_calls`` ``toolUse`` blocks and ``tool``
    turns ``toolResult`` blocks; content already in Strands blocks is kept.
    """
    history: list[dict[str, Any]] = []
    system: list[str] = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "system":
            system.append(_text(content))
            continue
        if role == "tool":
            block = {
                "toolResult": {
                    "toolUseId": str(message.get("tool_call_id")),
                    "status": "success",
                    "content": [{"text": _text(content)}],
                }
            }
            history.append({"role": "user", "content": [block]})
            continue
        blocks = _blocks(content)
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments") or "{}"
            blocks.append(
                {
                    "toolUse": {
                        "toolUseId": str(call.get("id")),
                        "name": str(function.get("name")),
                        "input": json.loads(arguments) if isinstance(arguments, str) else arguments,
                    }
                }
            )
        history.append({"role": str(role), "content": blocks})
    return history, "\n\n".join(system) if system else None


def _blocks(content: Any) -> list[dict[str, Any]]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"text": content}]
    blocks = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            blocks.append({"text": str(part.get("text", ""))})
        else:  # already a Strands block
            blocks.append(dict(part))
    return blocks


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b["text"] for b in _blocks(content) if "text" in b)


# The seed's names, so its examples run with only the import changed.
OsmosisStrandsAgent = RolloutStrandsAgent
OsmosisRolloutModel = RolloutModel

__all__ = [
    "OsmosisRolloutModel",
    "OsmosisStrandsAgent",
    "RolloutModel",
    "RolloutStrandsAgent",
    "StrandsSampleSource",
    "to_strands_messages",
]
