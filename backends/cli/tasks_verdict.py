"""What ``backends tasks check`` concludes about one task from its parse and its two trials.

A task passes when Harbor parses it, its oracle scores what it must (1, or the
``expected_oracle_reward`` its ``[metadata]`` declares for a task whose tests fail on purpose)
and nop scores 0. It is skipped, not failed, when the environment cannot run it here (the
sandbox refused it, naming why) or when its verifier failed while its tests reach for the
network and this machine has none. Everything else fails, with a reason to act on.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harbor.models.task.config import NetworkMode, TaskConfig, TaskOS
from harbor.models.task.task import Task
from pydantic import ValidationError

from backends.rollout.errors import Phase
from backends.rollout.request import RolloutResult
from backends.rollout.sample import validation_summary

# What the sandbox raises for a task it cannot run (compose, GPUs, TPUs, allowlists, Windows,
# a base image with no local substitute, a Dockerfile instruction it does not build): the
# task may be fine, this machine is not the place for it.
UNSUPPORTED_HERE = frozenset(
    {"UnsupportedTaskError", "BaseImageNotFoundError", "UnsupportedInstructionError"}
)
EXPECTED_ORACLE_KEY = "expected_oracle_reward"
# Commands in a test script that fetch from the network.
_NETWORK_COMMAND = re.compile(
    r"\b(curl|wget|uvx|npx|pip3? install|uv (?:pip install|sync|run|tool install|add)|"
    r"apt(?:-get)? (?:-\S+ )*(?:install|update)|npm (?:install|ci)|git clone|"
    r"go (?:get|mod download)|cargo install)\b"
)

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Verdict:
    task_id: str
    status: Status
    oracle: str  # the oracle's reward, or its failure category, or "-" when it did not run
    nop: str
    reason: str


@dataclass(frozen=True)
class Parsed:
    """A task as Harbor loads it, or what stops Harbor from loading it."""

    config: TaskConfig | None
    problem: str | None = None


def parse_task(task_dir: Path) -> Parsed:
    """Load ``task_dir`` with Harbor's own loader; a problem names the file and the field."""
    try:
        task = Task(task_dir)
    except tomllib.TOMLDecodeError as exc:
        return Parsed(None, f"task.toml is not valid TOML: {exc}")
    except ValidationError as exc:
        return Parsed(None, f"task.toml: {validation_summary(exc)}")
    except (OSError, ValueError, RuntimeError) as exc:
        return Parsed(None, str(exc) or type(exc).__name__)
    config = task.config
    if not config.steps and not (task_dir / "solution" / "solve.sh").is_file():
        return Parsed(config, "no solution/solve.sh: the oracle has nothing to run")
    expected = config.metadata.get(EXPECTED_ORACLE_KEY, 1.0)
    if isinstance(expected, bool) or not isinstance(expected, int | float):
        return Parsed(config, f"[metadata] {EXPECTED_ORACLE_KEY} = {expected!r} is not a number")
    return Parsed(config)


@dataclass(frozen=True)
class Need:
    """Something a task asks of the machine; ``phase`` is where its absence shows."""

    what: str
    phase: Phase


def task_needs(task_dir: Path, config: TaskConfig) -> list[Need]:
    """What the task asks for that some environments lack: accelerators, another OS, several
    containers, a network allowlist, and a verifier that fetches from the network."""
    env = config.environment
    needs = []
    if env.gpus or env.gpu_types:
        needs.append(Need(f"{env.gpus or 1} GPU(s) ([environment] gpus)", Phase.SETUP))
    if env.tpu is not None:
        needs.append(Need("a TPU ([environment] tpu)", Phase.SETUP))
    if env.os is TaskOS.WINDOWS:
        needs.append(Need("Windows ([environment] os)", Phase.SETUP))
    if (task_dir / "environment" / "docker-compose.yaml").exists():
        needs.append(Need("several containers (environment/docker-compose.yaml)", Phase.SETUP))
    if NetworkMode.ALLOWLIST in (env.network_mode, config.agent.network_mode):
        needs.append(Need("a network allowlist (network_mode = 'allowlist')", Phase.SETUP))
    if fetch := network_fetch(task_dir, config):
        needs.append(Need(f"the network for its verifier ({fetch})", Phase.GRADING))
    return needs


def judge(
    task_id: str,
    task_dir: Path,
    parsed: Parsed,
    oracle: RolloutResult | None,
    nop: RolloutResult | None,
) -> Verdict:
    if parsed.problem is not None or parsed.config is None:
        return Verdict(task_id, "fail", "-", "-", f"invalid task: {parsed.problem}")
    shown = (_shown(oracle), _shown(nop))
    needs = task_needs(task_dir, parsed.config)
    setup_needs = [n.what for n in needs if n.phase is Phase.SETUP]
    for result in (oracle, nop):
        failure = result.failure if result is not None else None
        if result is None or failure is None:
            continue
        if _unsupported(result) or (setup_needs and failure.phase is Phase.SETUP):
            asks = f"it needs {', '.join(setup_needs)}; " if setup_needs else ""
            return Verdict(task_id, "skip", *shown, f"cannot run here: {asks}{failure.message}")
    expected = float(parsed.config.metadata.get(EXPECTED_ORACLE_KEY, 1.0))
    problems = [
        p
        for p in (
            _problem("oracle", oracle, expected, "solution/solve.sh does not pass the tests"),
            _problem("nop", nop, 0.0, "the tests pass with nothing done"),
        )
        if p
    ]
    if not problems:
        note = ""
        if expected != 1.0:
            note = f"oracle scores {expected:g} by design ([metadata] {EXPECTED_ORACLE_KEY})"
        return Verdict(task_id, "pass", *shown, note)
    grading_needs = [n.what for n in needs if n.phase is Phase.GRADING]
    if grading_needs and all(_verifier_side(r) for r in (oracle, nop)):
        return Verdict(
            task_id,
            "skip",
            *shown,
            f"cannot run here: it needs {grading_needs[0]}, which it did not get here ("
            + "; ".join(problems)
            + ")",
        )
    return Verdict(task_id, "fail", *shown, "; ".join(problems))


def network_fetch(task_dir: Path, config: TaskConfig) -> str | None:
    """The first line of the task's test scripts that fetches from the network, as
    ``tests/test.sh:3: curl ...``; ``None`` when there is none or the verifier has no network
    by the task's own choice (then a failure is the task's)."""
    mode = config.verifier.network_mode or config.environment.network_mode
    if mode is NetworkMode.NO_NETWORK:
        return None
    scripts = [task_dir / "tests" / "test.sh"]
    scripts += sorted(task_dir.glob("steps/*/tests/test.sh"))
    for script in scripts:
        for number, line in enumerate(_head(script).splitlines(), 1):
            if _NETWORK_COMMAND.search(_command_text(line)):
                where = script.relative_to(task_dir)
                return f"{where}:{number}: {line.strip()[:60]}"
    return None


# Words that only mention a command (print it, look it up) rather than run it.
_MENTIONS = {"echo", "printf", "command", "which", "type", "hash", ":"}


def _command_text(line: str) -> str:
    """What a shell line runs, roughly: its words without comments, and nothing of a line
    that only prints or looks up a command (a network word there proves nothing)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: keep the line, minus a trailing comment
        words = re.sub(r"(^|\s)#.*", "", line).split()
    if not words or words[0] in _MENTIONS:
        return ""
    return " ".join(words)


def _head(path: Path, limit: int = 1024 * 1024) -> str:
    """The start of a regular file as text ("" for a link, a device, a missing file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return ""
        return handle.read(limit).decode("utf-8", errors="replace")


def _unsupported(result: RolloutResult) -> bool:
    harbor = result.extra_fields.get("harbor") or {}
    return result.failure is not None and harbor.get("exception_type") in UNSUPPORTED_HERE


def _verifier_side(result: RolloutResult | None) -> bool:
    """A wrong reward, or a failure while grading: what a verifier without network causes."""
    if result is None:
        return False
    return result.failure is None or result.failure.phase is Phase.GRADING


def _problem(agent: str, result: RolloutResult | None, must: float, meaning: str) -> str | None:
    if result is None:
        return f"{agent}: no result"
    if result.failure is not None:
        failure = result.failure
        return f"{agent}: {failure.category} in {failure.phase}: {failure.message}"
    reward = result.reward
    if reward is None or not math.isclose(reward, must):
        return f"{agent} scored {_number(reward)} (must be {must:g}): {meaning}"
    return None


def _shown(result: RolloutResult | None) -> str:
    if result is None:
        return "-"
    if result.failure is not None:
        return str(result.failure.category)
    return _number(result.reward)


def _number(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"
