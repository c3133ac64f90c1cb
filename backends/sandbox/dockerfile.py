"""A parser for the Dockerfile subset Harbor tasks use.

Supported: FROM (one stage), RUN, WORKDIR, ENV, ARG, USER, COPY and local ADD (no URLs, no
archive unpacking), plus metadata that has no effect on a sandbox (LABEL, EXPOSE, CMD,
ENTRYPOINT, MAINTAINER, STOPSIGNAL, HEALTHCHECK, VOLUME), which is accepted and ignored.
Everything else is refused with an error naming the instruction and its line, because
silently skipping a step would build a different image than the task author wrote.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from backends.sandbox.errors import UnsupportedInstructionError

IGNORED = {"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK"}
IGNORED |= {"VOLUME"}
SUPPORTED = {"FROM", "RUN", "WORKDIR", "ENV", "ARG", "USER", "COPY", "ADD"} | IGNORED


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-case
    args: str  # raw text after the keyword, continuations joined
    line: int  # 1-based line of the keyword

    def where(self) -> str:
        return f"line {self.line}: {self.keyword} {self.args}"[:200]


def parse(text: str) -> list[Instruction]:
    """Split a Dockerfile into instructions and check each is one this builder supports.

    Raises:
        UnsupportedInstructionError: unknown or unsupported instruction or form.
    """
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped, as docker does
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        joined = " ".join(p.strip() for p in pending if p.strip())
        pending = []
        keyword, _, args = joined.partition(" ")
        instructions.append(_check(Instruction(keyword.upper(), args.strip(), start)))
    if pending:
        raise UnsupportedInstructionError(f"Dockerfile ends inside a line continuation: {start}")
    if not instructions or instructions[0].keyword not in ("FROM", "ARG"):
        raise UnsupportedInstructionError("Dockerfile must start with FROM")
    froms = [i for i in instructions if i.keyword == "FROM"]
    if len(froms) != 1:
        raise UnsupportedInstructionError(
            f"multi-stage builds are not supported (found {len(froms)} FROM instructions)"
        )
    return instructions


def _check(ins: Instruction) -> Instruction:
    if ins.keyword not in SUPPORTED:
        raise UnsupportedInstructionError(
            f"Dockerfile instruction {ins.keyword} is not supported by the local sandbox "
            f"builder ({ins.where()})"
        )
    flags = list(split_flags(ins.args, words=False)[0])
    allowed = {"COPY": {"chown", "chmod"}, "ADD": {"chown", "chmod"}, "FROM": {"platform"}}
    bad = [f for f in flags if f not in allowed.get(ins.keyword, set())]
    if bad and ins.keyword in {"RUN", "COPY", "ADD", "FROM"}:
        raise UnsupportedInstructionError(
            f"{ins.keyword} --{bad[0]} is not supported by the local sandbox builder "
            f"({ins.where()})"
        )
    if ins.keyword == "FROM" and re.search(r"\sAS\s", ins.args, re.IGNORECASE):
        pass  # a named single stage is fine; a second FROM is refused in parse()
    if ins.keyword == "ADD" and re.search(r"\b(https?|git)://", ins.args):
        raise UnsupportedInstructionError(f"ADD from a URL needs a network ({ins.where()})")
    return ins


def split_flags(args: str, words: bool = True) -> tuple[dict[str, str], list[str]]:
    """`--chown=a:b src dst` -> ({'chown': 'a:b'}, ['src', 'dst']); JSON form supported.

    Only leading `--flag` tokens are flags; `RUN useradd --create-home` has none.
    """
    flags: dict[str, str] = {}
    rest = args
    while rest.startswith("--"):
        token, _, rest = rest.partition(" ")
        key, _, value = token[2:].partition("=")
        flags[key] = value
        rest = rest.strip()
    if not words:
        return flags, []
    if rest.startswith("["):
        return flags, [str(x) for x in json.loads(rest)]
    return flags, shlex.split(rest)


def shell_form(args: str) -> list[str]:
    """The argv of a RUN: exec form as given, shell form through /bin/sh -c."""
    if args.startswith("["):
        try:
            return [str(x) for x in json.loads(args)]
        except ValueError:
            pass
    return ["/bin/sh", "-c", args]


def parse_env(args: str) -> dict[str, str]:
    """ENV/ARG pairs: `K=V K2="a b"`, or the legacy `K value with spaces`."""
    tokens = shlex.split(args, posix=True)
    if tokens and "=" not in tokens[0]:
        key, _, value = args.partition(" ")
        return {key: value.strip()}
    out: dict[str, str] = {}
    for tok in tokens:
        key, eq, value = tok.partition("=")
        out[key] = value if eq else ""
    return out


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand(text: str, variables: dict[str, str]) -> str:
    """Docker's variable substitution for ENV, WORKDIR, COPY, USER: $X, ${X}, ${X:-d}."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        value = variables.get(name, "")
        if not value and m.group(2) is not None:
            return m.group(2)
        return value

    return _VAR.sub(sub, text)
