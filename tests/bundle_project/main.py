"""Workflows that tests/test_bundle.py runs inside sandboxes from a rollout bundle.

Each asks the policy through the rollout context (so its calls land in the relay trace) and
returns its sample in one of the ways a workflow may.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from typing import Any

import anyio
from openai import AsyncOpenAI

from backends import (
    AgentWorkflow,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    RolloutSample,
    SampleSource,
    get_rollout_context,
)


async def ask(ctx: AgentWorkflowContext[Any]) -> dict[str, Any]:
    rollout = get_rollout_context()
    assert rollout is not None and rollout.base_url
    async with AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.api_key or "none") as client:
        reply = await client.chat.completions.create(model="policy", messages=ctx.prompt)  # type: ignore[arg-type]
    return reply.choices[0].message.model_dump(exclude_none=True)


class ReturnsOutput(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> AgentWorkflowOutput:
        reply = await ask(ctx)
        assert ctx.artifacts_dir is not None
        (ctx.artifacts_dir / "note.txt").write_text("written inside\n")
        return AgentWorkflowOutput(messages=[*ctx.prompt, reply], metrics={"shape": 1.0})


class ReturnsList(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> list[dict[str, Any]]:
        return [*ctx.prompt, await ask(ctx)]


class Conversation(SampleSource):
    """A custom integration's sample source; it also claims a reward the host must ignore."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def get_sample(self) -> RolloutSample:
        return RolloutSample(messages=self.messages, reward=1.0, label="planted")


class RegistersSource(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> None:
        source = Conversation()
        rollout = get_rollout_context()
        assert rollout is not None
        rollout.set_sample_source(source)
        source.messages = [*ctx.prompt, await ask(ctx)]


class LiveConversation(Conversation):
    async def get_preview(self, max_messages: int) -> RolloutSample:
        return RolloutSample(messages=self.messages[-max_messages:])


class Previewed(AgentWorkflow):
    """Shows its progress in a preview for a while before it answers."""

    async def run(self, ctx: AgentWorkflowContext[Any]) -> None:
        source = LiveConversation()
        source.messages = [*ctx.prompt, {"role": "assistant", "content": "thinking it over"}]
        rollout = get_rollout_context()
        assert rollout is not None
        rollout.set_sample_source(source)
        await anyio.sleep(3)
        source.messages = [*ctx.prompt, await ask(ctx)]


class Raises(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> None:
        await ask(ctx)
        raise ValueError("the workflow broke on purpose")


class DiesWithoutOutput(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> None:
        os._exit(0)  # no sample, no error: the host must not grade this


class Snoops(AgentWorkflow):
    """Searches the whole sandbox for canaries and tries the network; reports both."""

    async def run(self, ctx: AgentWorkflowContext[Any]) -> list[dict[str, Any]]:
        found = subprocess.run(  # noqa: ASYNC221 - a test workflow, nothing else runs
            "grep -rhoasE --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
            "'CAN[A]RY-[0-9a-f]{32}' / | sort -u",
            shell=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        found += [v for v in os.environ.values() if "CANARY-" in v]
        found += own_memory_canaries()  # the input came on stdin (forked) or in a file
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=2).close()
            network = "reached"
        except OSError as exc:
            network = f"unreachable: {exc}"
        report = {
            "role": "assistant",
            "content": f"canaries={sorted(set(found))} network={network}",
        }
        return [*ctx.prompt, report]


WARMED_UP = False


def warm_up() -> None:
    """pyproject.toml's [tool.backends] warm_up: run once in the warm runner."""
    global WARMED_UP
    WARMED_UP = True


class ReportsParent(AgentWorkflow):
    """The sample, and in its metrics whether the runner's parent is in its pid namespace
    (a shell's exec: yes; forked from a warm runner: no, its launcher is outside), whether
    it started from the project's warm-up, and how many processes the sandbox runs besides
    pid 1 and the runner's own (none: the relay's port is served from the host)."""

    async def run(self, ctx: AgentWorkflowContext[Any]) -> AgentWorkflowOutput:
        reply = await ask(ctx)
        own = {1, os.getpid(), os.getppid()}
        others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in own]
        metrics = {
            "parent_visible": float(os.getppid() != 0),
            "warmed_up": float(WARMED_UP),
            "other_processes": float(len(others)),
        }
        return AgentWorkflowOutput(messages=[*ctx.prompt, reply], metrics=metrics)


class ReportsIdentity(AgentWorkflow):
    """The sample, and in its metrics who the runner runs as (uid, euid), whether its parent
    is in its pid namespace (cold: yes; forked: no) and whether the host Python's prefix (the
    metadata's ``host_prefix``) is visible; in ``identity.json`` of its artifacts what
    ``identity()`` found."""

    async def run(self, ctx: AgentWorkflowContext[Any]) -> AgentWorkflowOutput:
        reply = await ask(ctx)
        found = identity(str((ctx.metadata or {}).get("host_prefix") or "/nonexistent"))
        assert ctx.artifacts_dir is not None
        (ctx.artifacts_dir / "identity.json").write_text(json.dumps(found))
        metrics = {
            "uid": float(os.getuid()),
            "euid": float(os.geteuid()),
            "parent_visible": float(os.getppid() != 0),
            "host_prefix_visible": float(found["host_prefix_visible"]),
        }
        return AgentWorkflowOutput(messages=[*ctx.prompt, reply], metrics=metrics)


def identity(host_prefix: str) -> dict[str, Any]:
    """What this process reaches: mounts under /root, the host's prefix, its interpreter's
    prefix, and which of its interpreter's, environment's and project's folders and files it
    could remount writable or write into (none should be: they are bound read-only)."""
    with open("/proc/self/mountinfo") as mounts:
        targets = [line.split()[4] for line in mounts]
    ours = (sys.prefix, sys.base_prefix, os.getcwd())  # the venv, the Python copy, the project
    remounted = [
        place
        for place in ours
        if subprocess.run(["mount", "-o", "remount,bind,rw", place], capture_output=True).returncode
        == 0
    ]
    places = [
        *ours,
        os.path.join(sys.prefix, "bin"),
        os.path.join(sys.base_prefix, "bin"),
        os.path.dirname(os.__file__),  # the standard library
        os.path.dirname(anyio.__file__),  # an installed dependency
    ]
    written = []
    for place in places:
        planted = os.path.join(place, "planted")
        try:
            with open(planted, "w") as handle:
                handle.write("x")
            os.remove(planted)
            written.append(place)
        except OSError:
            pass
    for existing in (os.path.realpath(sys.executable), os.__file__):
        try:  # opened for writing (nothing written: a success is the finding)
            os.close(os.open(existing, os.O_WRONLY))
            written.append(existing)
        except OSError:
            pass
    return {
        "under_root": [t for t in targets if t == "/root" or t.startswith("/root/")],
        "host_prefix_visible": os.path.exists(host_prefix),
        "prefix": sys.base_prefix,
        "remounted": remounted,
        "written": written,
    }


def own_memory_canaries() -> list[str]:
    """Every canary in this process's readable memory."""
    pattern = re.compile(rb"CAN[A]RY-[0-9a-f]{32}")
    found: set[str] = set()
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps.read().splitlines():
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if not perms.startswith("r") or line.endswith("[vvar]"):
                continue
            try:
                mem.seek(start)
                found.update(m.decode() for m in pattern.findall(mem.read(end - start)))
            except (OSError, OverflowError, ValueError):
                continue
    return sorted(found)


class NonEmptyAnswer(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        content = ctx.sample.messages[-1].get("content") or ""
        ctx.set_reward(0.5 if content and ctx.label == "expected" else 0.0)
