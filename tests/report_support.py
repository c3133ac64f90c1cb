"""Run directories for the report's tests, and the page as headless Chromium renders it.

``make_run`` writes the files ``backends run`` writes (run.json, results.jsonl, metrics.json,
rollouts/<id>/...) with its own models, so the report reads what the CLI writes.
``rendered`` opens a page in Chromium, lets its script run, and parses the resulting DOM.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from backends.cli.runfiles import ResultRecord, RunManifest, Session, relative, write_json_atomic
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure
from backends.rollout.request import RolloutResult, RolloutStatus
from backends.rollout.sample import RolloutSample
from backends.trajectory import save_trajectory

CHROMIUM = shutil.which("chromium") or "chromium"


def tool_conversation(question: str, answer: str) -> list[dict[str, Any]]:
    """A calculator conversation: the question, a tool call, its observation, the answer."""
    return [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": answer},
    ]


@dataclass
class Rollout:
    row: int
    attempt: int = 0
    reward: float | None = 1.0
    failure: tuple[ErrorCategory, Phase, str] | None = None
    messages: list[dict[str, Any]] | None = None
    artifacts: dict[str, str | bytes] = field(default_factory=dict)
    prompt: str = "What is 6 * 7?"
    task: str | None = None
    retry: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)  # raw results-line fields


def make_run(run_dir: Path, rollouts: list[Rollout], *, rows: int, attempts: int) -> Path:
    run_id = run_dir.name
    (run_dir / "rollouts").mkdir(parents=True)
    now = time.time()
    manifest = RunManifest(
        run_id=run_id,
        created_at=now - 60,
        inputs={"mode": "rollout", "rows": rows, "attempts": attempts},
        display={"entrypoint": "tasks/rollouts/arithmetic/main.py:backend", "policy": "scripted"},
        attempts=attempts,
        rows=rows,
        sessions=[Session(started_at=now - 60, ended_at=now, finished=len(rollouts), exit_code=0)],
    )
    write_json_atomic(run_dir / "run.json", manifest)
    lines = []
    for r in rollouts:
        rid = f"{run_id}.row-{r.row}-{r.attempt}" + (f".retry-{r.retry}" if r.retry else "")
        folder = run_dir / "rollouts" / rid
        folder.mkdir()
        messages = r.messages or tool_conversation(r.prompt, "42")
        failure = (
            RolloutFailure(category=r.failure[0], phase=r.failure[1], message=r.failure[2])
            if r.failure
            else None
        )
        sample = RolloutSample(messages=messages, reward=r.reward if failure is None else None)
        if failure is not None:
            result = RolloutResult.failed(rid, failure, sample=sample)
        else:
            result = RolloutResult(rollout_id=rid, status=RolloutStatus.SUCCESS, sample=sample)
        (folder / "result.json").write_text(result.model_dump_json())
        trajectory = save_trajectory(run_dir / "rollouts", result)
        for name, content in r.artifacts.items():
            path = folder / "artifacts" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        record = ResultRecord(
            rollout_id=rid,
            row=r.row,
            attempt=r.attempt,
            task=r.task,
            prompt=r.prompt,
            status=str(result.status),
            reward=result.reward,
            passed=None if result.reward is None else result.reward >= 1.0,
            failure=failure,
            failed_phase=str(failure.phase) if failure else None,
            answer=str(messages[-1].get("content") or ""),
            timings={"queued_sec": 0.001, "setup_sec": 0.2, "agent_sec": 1.5, "grader_sec": 0.01},
            policy_calls=2,
            started_at=now - 30,
            finished_at=now - 28,
            result=relative(folder / "result.json", run_dir),
            trajectory=relative(trajectory, run_dir) if trajectory else None,
            artifacts=relative(folder / "artifacts", run_dir) if r.artifacts else None,
        )
        lines.append({**record.model_dump(mode="json"), **r.overrides})
    import json

    (run_dir / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


# -- the page as Chromium renders it ----------------------------------------------------------


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def all(self, tag: str | None = None, **attrs: str) -> list[Node]:
        found = []
        for child in self.children:
            if isinstance(child, Node):
                if (tag is None or child.tag == tag) and all(
                    value in child.attrs.get(key.rstrip("_"), "").split()
                    if key.rstrip("_") == "class"
                    else child.attrs.get(key.rstrip("_")) == value
                    for key, value in attrs.items()
                ):
                    found.append(child)
                found.extend(child.all(tag, **attrs))
        return found

    def one(self, tag: str | None = None, **attrs: str) -> Node:
        [node] = self.all(tag, **attrs)
        return node


_VOID = {
    "meta",
    "link",
    "br",
    "hr",
    "img",
    "input",
    "area",
    "base",
    "col",
    "embed",
    "source",
    "wbr",
}


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def rendered(page: Path, *, fragment: str = "", timeout: float = 120) -> tuple[Node, str]:
    """The page's DOM after its scripts ran in headless Chromium, parsed, and as text."""
    url = page.resolve().as_uri() + (f"#{fragment}" if fragment else "")
    done = subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--virtual-time-budget=10000", "--dump-dom", url,
        ],
        capture_output=True, text=True, timeout=timeout, check=True,
    )  # fmt: skip
    parser = _Builder()
    parser.feed(done.stdout)
    return parser.root, done.stdout


def screenshot(page: Path, out: Path, *, size: str = "1300,1800", timeout: float = 120) -> Path:
    subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--hide-scrollbars", f"--window-size={size}", "--virtual-time-budget=10000",
            f"--screenshot={out}", page.resolve().as_uri(),
        ],
        capture_output=True, timeout=timeout, check=True,
    )  # fmt: skip
    return out
