"""Harbor's conversion of an agent's logs, run in a worker thread instead of on the event loop.

After the agent of a trial runs, Harbor downloads its log folder, then calls the agent class's
``populate_context_post_run`` (Claude Code's and Codex's read each session ``*.jsonl`` line
and write trajectory.json) and reads per-model usage from trajectory.json: synchronous work,
on the loop. For sessions as large as the download allows (``unpack.PARSED_PATTERN_LIMITS``)
that is 1-3 s of CPU, and every other rollout and the relay stood still meanwhile.

The trial's ``AGENT_END`` event, which Harbor awaits just before, does the same steps in the
same order: Harbor's own download (after which Harbor does not download again), then the
conversion and the usage in a worker thread, at most ``CONVERSIONS`` at once. Harbor then
finds the agent's context filled and leaves it. The agent's own conversion is marked done, so
a context left empty (nothing to convert) is not converted a second time on the loop, and an
error the conversion raised is raised where Harbor would have raised it.

Single-step trials without a user agent only (all this package builds from a template, and
most of dataset mode); others convert on the loop, as Harbor does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
from harbor.agents.base import BaseAgent
from harbor.models.agent.context import AgentContext
from harbor.trial.single_step import SingleStepTrial
from harbor.trial.trial import Trial
from harbor.utils.trajectory_utils import load_model_usage_from_trajectory

# Conversions at once: CPU-bound under the GIL, so more would only slow the loop's turns.
CONVERSIONS = anyio.CapacityLimiter(2)


async def convert_off_the_loop(trial: Trial) -> None:
    """At the trial's ``AGENT_END``: its agent's logs downloaded and converted, off the loop."""
    context = trial.result.agent_result
    if (
        not isinstance(trial, SingleStepTrial)
        or trial.user_agent is not None
        or context is None
        or not context.is_empty()
    ):
        return
    await trial._download_agent_logs()  # Harbor's next step; it records that it is done
    agent = trial.agent
    error: Exception | None = None
    try:
        await _to_the_end(_convert, agent, context)
    except Exception as e:  # Harbor raises it from its own call, as if it had converted
        error = e
    finally:  # cancelled too: Harbor's clean-up finds the conversion done
        _mark_converted(agent, error)


def _convert(agent: BaseAgent, context: AgentContext) -> None:
    """What Harbor's ``Trial._sync_agent_output`` does after its download, in that order."""
    agent.populate_context_post_run(context)
    if context.model_usage is None:
        context.model_usage = load_model_usage_from_trajectory(agent.logs_dir / "trajectory.json")


def _mark_converted(agent: BaseAgent, error: Exception | None) -> None:
    def populate_context_post_run(context: AgentContext) -> None:
        if error is not None:
            raise error

    # This trial's agent only: Harbor calls it again when the context stayed empty.
    agent.populate_context_post_run = populate_context_post_run  # type: ignore[method-assign]


async def _to_the_end(fn: Any, *args: Any) -> None:
    """``fn(*args)`` in a worker thread, waited for even when the trial is cancelled meanwhile:
    its cleanup then reads what the conversion writes, and must not race it."""
    future = asyncio.ensure_future(anyio.to_thread.run_sync(fn, *args, limiter=CONVERSIONS))
    cancelled = False
    # The shield keeps an anyio scope's cancel from being re-sent on every wait (a busy loop);
    # asyncio's own task.cancel() (how Harbor's trial is cancelled) passes it, hence the loop.
    with anyio.CancelScope(shield=True):
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    await anyio.lowlevel.checkpoint()  # an anyio scope's cancel, raised as that scope expects
    future.result()
