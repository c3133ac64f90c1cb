"""End to end through the command line, the way a user runs the main job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BACKENDS = [sys.executable, "-m", "backends.cli"]


def run_cli(
    *args: str, home: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BACKENDS_HOME": str(home), "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [*BACKENDS, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def only_run(home: Path) -> Path:
    """The one run directory under ``home``."""
    (run,) = (home / "runs").iterdir()
    return run


def records(run_dir: Path) -> list[dict]:
    """The lines of the run's results.jsonl."""
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_bytes().splitlines()]


def full_results(run_dir: Path) -> list[dict]:
    """Each line's full result (its result.json), in the order of the lines."""
    return [json.loads((run_dir / r["result"]).read_text()) for r in records(run_dir)]


def rollout_dir(home: Path, name: str = "row-0-0") -> Path:
    run = only_run(home)
    return run / "rollouts" / f"{run.name}.{name}"


# The first run of a changed package builds and installs the example's rollout bundle (minutes
# on a loaded machine) before its first rollout.
MAIN_JOB_TIMEOUT = 1200


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param([], marks=[pytest.mark.sandbox, pytest.mark.timeout(MAIN_JOB_TIMEOUT)]),
        ["--backend", "local"],
    ],
    ids=["harbor", "local"],
)
def test_main_job_on_embedded_defaults_prints_rewards(tmp_path: Path, backend: list[str]) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("run", *backend, "-o", str(run_dir), home=tmp_path, timeout=MAIN_JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scripted" in proc.stdout
    where = "in this process" if backend else "in sandboxes (HarborBackend)"
    assert where in " ".join(proc.stdout.split())
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    dataset_rows = len((REPO / "tasks/data/arithmetic.jsonl").read_text().splitlines())
    assert summary["rollouts"] == dataset_rows
    assert summary["mean_reward"] == 1.0  # the scripted policy computes arithmetic exactly
    assert f"run directory: {run_dir}" in proc.stdout
    assert f"report: {run_dir}/report.html" in proc.stdout
    assert summary["report"] == str(run_dir / "report.html")
    results = full_results(run_dir)
    results_by_id = {r["rollout_id"].split(".", 1)[1]: r for r in results}
    assert len(results) == dataset_rows
    assert all(r["status"] == "success" and r["sample"]["reward"] == 1.0 for r in results)
    # Each rollout's artifacts landed in its own directory in the run directory.
    replies = list((run_dir / "rollouts").glob("*.row-*/artifacts/**/reply.txt"))
    assert len(replies) == dataset_rows
    if not backend:  # the workflow ran in the sandbox, through the bundle's runner
        assert all(r["extra_fields"]["harbor"]["task"] == "workflow" for r in results)
    # Beside them, an ATIF trajectory that Harbor's validator accepts, whose agent step carries
    # the token ids and logprobs the policy sampled, as the relay recorded them.
    trajectory = run_dir / "rollouts" / "run.row-0-0" / "trajectory.json"
    check = subprocess.run(
        [sys.executable, "-m", "harbor.utils.trajectory_validator", str(trajectory)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    agent_step = next(
        s for s in json.loads(trajectory.read_text())["steps"] if s["source"] == "agent"
    )
    assert agent_step["message"] == results_by_id["row-0-0"]["sample"]["messages"][-1]["content"]
    trace_call = results_by_id["row-0-0"]["extra_fields"]["policy_trace"]["calls"][0]
    assert agent_step["metrics"]["completion_token_ids"] == trace_call["choices"][0]["token_ids"]
    assert len(agent_step["metrics"]["logprobs"]) == len(
        agent_step["metrics"]["completion_token_ids"]
    )


def test_unknown_entrypoint_is_named(tmp_path: Path) -> None:
    proc = run_cli("run", "tasks/rollouts/arithmetic/main.py:nothing_here", home=tmp_path)
    assert proc.returncode == 2
    assert "nothing_here" in proc.stderr


def test_malformed_dataset_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"user_prompt": "ok", "ground_truth": "1"}\n{broken\n')
    proc = run_cli("run", "-d", str(bad), home=tmp_path)
    assert proc.returncode == 2
    assert "bad.jsonl:2: not valid JSON" in proc.stderr


# A backend for the tests below, loaded from a file the way a user's entrypoint is; TEST_MODE
# picks its behaviour.
ENTRYPOINT = """
import gc, os, weakref
from backends import AgentWorkflow, Grader, LocalBackend

MODE = os.environ.get("TEST_MODE", "ok")
KEY = "sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX1234"


class W(AgentWorkflow):
    async def run(self, ctx):
        if MODE == "fail":
            raise RuntimeError(f"agent crashed holding {KEY}")
        if ctx.artifacts_dir:
            (ctx.artifacts_dir / "old.txt").write_text("from this run")
        answer = [{"role": "assistant", "content": "42"}]
        if MODE == "secret":
            tool = f"OPENAI_API_KEY={KEY} Authorization: Bearer abcdefghijklmnop policy-key-0123456789"
            return [*ctx.prompt, {"role": "tool", "content": tool}, *answer]
        return [*ctx.prompt, *answer]


class G(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


class Backend(LocalBackend):
    held = []

    async def execute(self, request):
        if MODE == "memory":
            # Rollouts run one at a time: every earlier result should be gone by now.
            gc.collect()
            alive = sum(ref() is not None for ref in self.held)
            if alive > 3:
                raise RuntimeError(f"the CLI still holds {alive} earlier results")
        result = await super().execute(request)
        if MODE == "memory" and result.sample is not None:
            self.held.append(weakref.ref(result.sample))
        if MODE == "lose" and request.rollout_id.endswith(".row-1-0"):
            result = result.model_copy(update={"rollout_id": "stray"})  # row-1-0 never arrives
        return result


backend = Backend(workflow=W, grader=G)
"""


def entrypoint(tmp_path: Path) -> str:
    path = tmp_path / "entry.py"
    path.write_text(ENTRYPOINT)
    return f"{path}:backend"


def two_rows(tmp_path: Path) -> Path:
    data = tmp_path / "two.jsonl"
    data.write_text('{"user_prompt": "a", "ground_truth": "42"}\n' * 2)
    return data


def test_a_request_without_a_result_fails_the_run(tmp_path: Path) -> None:
    proc = run_cli(
        "run", entrypoint(tmp_path), "-d", str(two_rows(tmp_path)),
        home=tmp_path, env={"TEST_MODE": "lose"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 of 2 rollouts returned no result: " in proc.stderr
    assert ".row-1-0" in proc.stderr and "unknown ids: stray" in proc.stderr


def test_an_empty_dataset_is_bad_input(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    proc = run_cli("run", "-d", str(empty), home=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "empty.jsonl has no rows" in proc.stderr


def test_results_are_not_kept_until_the_end(tmp_path: Path) -> None:
    proc = run_cli(
        "run", entrypoint(tmp_path), "--max-in-flight", "1", "-o", str(tmp_path / "out"),
        home=tmp_path, env={"TEST_MODE": "memory"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(records(tmp_path / "out")) == 12


def run_files(run_dir: Path) -> str:
    """Every file the run wrote, as one text."""
    return "\n".join(p.read_text() for p in sorted(run_dir.rglob("*")) if p.is_file())


def test_secrets_are_redacted_in_output_files_and_table(tmp_path: Path) -> None:
    ep = entrypoint(tmp_path)
    proc = run_cli(
        "run", ep, "-d", str(two_rows(tmp_path)), "-o", str(tmp_path / "a"),
        # The workflow never calls the policy: nothing listens there.
        "--policy-url", "http://alice:hunter2pass@127.0.0.1:9/v1", "--api-key-env", "MY_KEY",
        home=tmp_path, env={"TEST_MODE": "secret", "MY_KEY": "policy-key-0123456789"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trajectory = (tmp_path / "a/rollouts/a.row-0-0/trajectory.json").read_text()
    planted = ["hunter2pass", "sk-proj-", "abcdefghijklmnop", "policy-key-0123456789"]
    for text in (proc.stdout + proc.stderr, run_files(tmp_path / "a")):
        assert not [s for s in planted if s in text], text
    assert "OPENAI_API_KEY=[REDACTED]" in trajectory
    # Failure messages, in the table and the results files.
    proc = run_cli(
        "run", ep, "-d", str(two_rows(tmp_path)), "-o", str(tmp_path / "b"),
        home=tmp_path, env={"TEST_MODE": "fail"},
    )  # fmt: skip
    assert proc.returncode == 1
    assert "agent crashed holding [REDACTED]" in proc.stdout
    assert "sk-proj-" not in proc.stdout + proc.stderr + run_files(tmp_path / "b")


def test_runs_one_after_the_other_keep_their_own_files(tmp_path: Path) -> None:
    ep, data = entrypoint(tmp_path), two_rows(tmp_path)
    proc = run_cli("run", ep, "-d", str(data), home=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = rollout_dir(tmp_path)
    assert (first / "trajectory.json").exists() and (first / "artifacts/old.txt").exists()
    proc = run_cli("run", ep, "-d", str(data), home=tmp_path, env={"TEST_MODE": "fail"})
    assert proc.returncode == 1
    # The second run neither deleted the first's files nor wrote beside them.
    assert (first / "trajectory.json").exists() and (first / "artifacts/old.txt").exists()
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    second = runs[1] if runs[0] == first.parent.parent else runs[0]
    assert not list(second.glob("rollouts/*/trajectory.json"))  # no sample, no trajectory
    results = records(second)
    assert {r["status"] for r in results} == {"failure"}
    assert all(r["rollout_id"].startswith(second.name + ".") for r in results)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"user_prompt": "ok"}\n{"user_prompt": "caf\xe9"}\n', "bad.jsonl:2: not UTF-8 text"),
        (b'{"user_prompt": ["hi"]}\n', "bad.jsonl:1: user_prompt: Input should be a valid string"),
        (b'{"user_prompt": "hi", "metadata": "x"}\n', "bad.jsonl:1: metadata: Input should be"),
        # Not the label "1" or "nan": a boolean or non-finite ground truth is refused.
        (b'{"user_prompt": "hi", "ground_truth": true}\n', "bad.jsonl:1: ground_truth:"),
        (b'{"user_prompt": "hi", "ground_truth": NaN}\n', "bad.jsonl:1: ground_truth:"),
        # Hostile rows: refused with the line named, never a traceback or a rollout.
        (
            b'{"user_prompt": "ok"}\n{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
            "bad.jsonl:2: nested deeper than 100 levels",
        ),
        (
            b'{"user_prompt": "hi", "metadata": {"a": ' + b"[" * 500 + b"]" * 500 + b"}}\n",
            "nested deeper than 100 levels",
        ),
        (
            b'{"user_prompt": "hi", "metadata": {"n": ' + b"7" * 5000 + b"}}\n",
            "bad.jsonl:1: not usable JSON (Exceeds the limit",
        ),
        (
            b'{"user_prompt": "hi \\ud800 there"}\n',
            "bad.jsonl:1: user_prompt: text with a lone surrogate",
        ),
        (
            b'{"user_prompt": "hi", "metadata": {"k": ["\\udfff"]}}\n',
            "bad.jsonl:1: metadata.k[0]: text with a lone surrogate",
        ),
    ],
)
def test_bad_dataset_rows_are_named(tmp_path: Path, content: bytes, expected: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    proc = run_cli("run", "-d", str(bad), home=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in " ".join(proc.stderr.split())  # rich may wrap the message
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_a_row_over_the_size_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"user_prompt": "ok"}\n{"user_prompt": "' + b"x" * 2_000_000 + b'"}\n')
    proc = run_cli("run", "-d", str(bad), "--max-row-bytes", "1000000", home=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bad.jsonl:2: the row is larger than the 1000000-byte limit" in " ".join(
        proc.stderr.split()
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--agent-timeout", "inf"], "--agent-timeout"),
        (["--grader-timeout", "nan"], "--grader-timeout"),
        (["-o", "README.md"], "--run-dir"),
        (["--retry-failed", "bogus"], "--retry-failed"),
        (["--backend", "docker"], "--backend"),
        (["-a", "oracle"], "-a"),
    ],
)
def test_bad_options_are_named(tmp_path: Path, args: list[str], expected: str) -> None:
    proc = run_cli("run", *args, home=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
