"""``backends run`` over a run directory, the way a user meets it: resume after a crash, refusal
of changed inputs, ``--retry-failed``, each dataset format, pass@k, and what the files say."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli_run import BACKENDS, REPO, records, run_cli

from backends.cli.relay_socket import remove_stale
from backends.sandbox import owners

# Behaviour picked by the row's prompt and the environment (never an input of the run).
ENTRYPOINT = """
import os

import anyio
from backends import AgentWorkflow, Grader, LocalBackend


class W(AgentWorkflow):
    async def run(self, ctx):
        prompt = ctx.prompt[-1]["content"]
        if prompt == "slow" and os.environ.get("TEST_SLOW"):
            await anyio.sleep(60)
        if prompt == "flaky" and os.environ.get("TEST_FAIL"):
            raise RuntimeError("flaky row failed")
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class G(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


backend = LocalBackend(workflow=W, grader=G)
"""
LOCAL = ["--backend", "local"]


def entrypoint(tmp_path: Path) -> str:
    path = tmp_path / "entry.py"
    path.write_text(ENTRYPOINT)
    return f"{path}:backend"


def dataset(tmp_path: Path, prompts: list[str], name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(
        "".join(json.dumps({"user_prompt": p, "ground_truth": "42"}) + "\n" for p in prompts)
    )
    return path


def current(run_dir: Path) -> dict[tuple[int, int], dict]:
    """The last line of each slot."""
    return {(r["row"], r["attempt"]): r for r in records(run_dir)}


def summary(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A TMPDIR of the test's own (the host's /tmp is shared), short enough for socket paths."""
    folder = Path(tempfile.mkdtemp(prefix="tmpdir-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_run_killed_with_sigkill_resumes_with_only_its_unfinished_rollouts(
    tmp_path: Path, short_tmpdir: Path
) -> None:
    data = dataset(tmp_path, ["ok", "ok", "ok", "slow", "slow", "ok"])
    run_dir = tmp_path / "run"
    cmd = [*BACKENDS, "run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir)]
    env = {**os.environ, "BACKENDS_HOME": str(tmp_path), "COLUMNS": "200"}
    env["TMPDIR"] = str(short_tmpdir)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**env, "TEST_SLOW": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "results.jsonl").exists() or len(records(run_dir)) < 4:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)  # no handler runs: nothing is recorded as cancelled
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = records(run_dir)
    assert sorted(r["row"] for r in before) == [0, 1, 2, 5]
    [socket_dir] = short_tmpdir.glob("backends-relay-*")  # the killed run could not remove it
    # As if the kill had landed in the middle of a write: a torn last line.
    with (run_dir / "results.jsonl").open("ab") as handle:
        handle.write(b'{"rollout_id": "torn')
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming run: 2 of 6 rollouts to run (4 kept)" in " ".join(done.stdout.split())
    assert not socket_dir.exists()  # the next run removed the dead run's relay socket folder
    assert list(short_tmpdir.iterdir()) == []  # and its own on the way out
    after = records(run_dir)  # every line parses: the torn one was cut off
    assert after[:4] == before  # the finished ones were kept as they were, not rerun
    rerun = after[4:]
    assert sorted(r["row"] for r in rerun) == [3, 4]
    assert all(r["session"] == 2 and r["rollout_id"].endswith(".s2") for r in rerun)
    assert {r["status"] for r in after} == {"success"}
    assert summary(done)["ran"] == 2 and summary(done)["rollouts"] == 6
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["complete"] and metrics["counts"]["success"] == 6
    manifest = json.loads((run_dir / "run.json").read_text())
    first, second = manifest["sessions"]
    assert first["ended_at"] is None and first["exit_code"] is None  # it never ended
    assert second["finished"] == 2 and second["exit_code"] == 0
    # Run once more: nothing left to do, nothing run.
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and summary(again)["ran"] == 0
    assert records(run_dir) == after


def test_only_dead_runs_relay_socket_folders_are_removed(short_tmpdir: Path) -> None:
    def folder(name: str, owner: str | None) -> Path:
        path = short_tmpdir / name
        path.mkdir()
        if owner is not None:
            (path / "owner-host").write_text(owners.host_identity() + "\n")
            (path / "owner").write_text(owner)
        return path

    dead = folder("backends-relay-dead", "999999999 1\n")  # no such pid
    live = folder("backends-relay-live", None)
    owners.write(live)  # this process
    unrecorded = folder("backends-relay-new", None)  # being made, or an older version's
    others = folder("backends-relay-others", "999999999 1\n")
    os.chown(others, 12345, 12345)  # another user's
    target = folder("not-ours", "999999999 1\n")
    (short_tmpdir / "backends-relay-link").symlink_to(target)
    assert remove_stale(short_tmpdir) == [dead]
    assert not dead.exists() and live.exists() and unrecorded.exists() and others.exists()
    assert (target / "owner").exists()


def test_a_signal_then_a_rerun_finishes_the_cancelled_rollouts(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["ok", "slow", "ok"])
    run_dir = tmp_path / "run"
    cmd = [*BACKENDS, "run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir)]
    env = {**os.environ, "BACKENDS_HOME": str(tmp_path), "COLUMNS": "200"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**env, "TEST_SLOW": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (run_dir / "results.jsonl").exists() or len(records(run_dir)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert f"rerun the same command with -o {run_dir}" in " ".join(stderr.split())
    assert current(run_dir)[(1, 0)]["status"] == "cancelled"
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert current(run_dir)[(1, 0)]["status"] == "success"
    assert len(records(run_dir)) == 4  # the cancelled try stays as history


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("dataset", "dataset_sha256"),
        ("attempts", "attempts: 1 -> 2"),
        ("timeout", "agent_timeout_sec: 300.0 -> 5.0"),
        ("entrypoint", "entrypoint_sha256"),
    ],
)
def test_changed_inputs_are_refused_naming_what_changed(
    tmp_path: Path, change: str, expected: str
) -> None:
    data = dataset(tmp_path, ["ok", "ok"])
    ep = entrypoint(tmp_path)
    run_dir = tmp_path / "run"
    first = run_cli("run", ep, *LOCAL, "-d", str(data), "-o", str(run_dir), home=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    lines = (run_dir / "results.jsonl").read_bytes()
    args = ["run", ep, *LOCAL, "-d", str(data), "-o", str(run_dir)]
    if change == "dataset":
        dataset(tmp_path, ["ok", "ok", "ok"])
    elif change == "attempts":
        args += ["-k", "2"]
    elif change == "timeout":
        args += ["--agent-timeout", "5"]
    else:
        Path(ep.rpartition(":")[0]).write_text(ENTRYPOINT + "\n# edited\n")
    again = run_cli(*args, home=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    message = " ".join(again.stderr.replace("│", " ").split())
    assert "holds a run of other inputs" in message and expected in message
    assert "Traceback" not in again.stderr
    assert (run_dir / "results.jsonl").read_bytes() == lines  # untouched


def test_concurrency_is_not_an_input_and_a_foreign_directory_is_refused(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["ok"])
    run_dir = tmp_path / "run"
    args = ["run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir)]
    assert run_cli(*args, home=tmp_path).returncode == 0
    assert run_cli(*args, "-n", "3", home=tmp_path).returncode == 0  # resumed, nothing to do
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused = run_cli(*args[:-1], str(other), home=tmp_path)
    assert refused.returncode == 2 and "holds no run" in " ".join(refused.stderr.split())


def test_two_processes_cannot_share_a_run_directory(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["slow"])
    run_dir = tmp_path / "run"
    args = ["run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir)]
    env = {**os.environ, "BACKENDS_HOME": str(tmp_path), "TEST_SLOW": "1"}
    holder = subprocess.Popen([*BACKENDS, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "run.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        second = run_cli(*args, home=tmp_path)
        assert second.returncode == 2
        assert f"is in use by another `backends run` (pid {holder.pid})" in " ".join(
            second.stderr.replace("│", " ").split()
        )
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(30)


def test_retry_failed_reruns_only_failures_of_the_phases_named(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["ok", "flaky", "ok", "flaky"])
    run_dir = tmp_path / "run"
    args = ["run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir)]
    first = run_cli(*args, home=tmp_path, env={"TEST_FAIL": "1"})
    assert first.returncode == 1
    failed = {slot: r for slot, r in current(run_dir).items() if r["status"] == "failure"}
    assert sorted(failed) == [(1, 0), (3, 0)]
    assert all(r["failed_phase"] == "agent" for r in failed.values())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["failures_by_phase"] == {"agent": {"agent_error": 2}}
    assert metrics["mean_reward"] == 1.0 and metrics["graded"] == 2  # failures are not 0
    # Another phase: nothing reruns, the failures stay.
    other = run_cli(*args, "--retry-failed", "setup,grading", home=tmp_path)
    assert other.returncode == 1 and summary(other)["ran"] == 0
    # The failures' phase: only they rerun; the successes are kept as they were.
    kept = {slot: r for slot, r in current(run_dir).items() if r["status"] == "success"}
    retried = run_cli(*args, "--retry-failed", "agent", home=tmp_path)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert summary(retried)["ran"] == 2
    now = current(run_dir)
    assert {slot: now[slot] for slot in kept} == kept
    assert {now[s]["status"] for s in failed} == {"success"}
    assert {now[s]["session"] for s in failed} == {3}
    assert json.loads((run_dir / "metrics.json").read_text())["failures_by_phase"] == {}
    # A category works as well as a phase: nothing failed, so nothing reruns.
    assert summary(run_cli(*args, "--retry-failed", "infra_error", home=tmp_path))["ran"] == 0


ARITHMETIC = [
    ("What is 2 + 3?", "5", {"op": "+"}),
    ("What is 7 * 6?", "42", {"op": "*"}),
    ("What is 9 - 4?", "6", {"op": "-"}),  # a wrong label: reward 0
]


def write_dataset(tmp_path: Path, kind: str) -> Path:
    if kind == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text(
            "".join(
                json.dumps({"user_prompt": p, "ground_truth": g, "metadata": m}) + "\n"
                for p, g, m in ARITHMETIC
            )
        )
    elif kind == "csv":
        path = tmp_path / "rows.csv"
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["user_prompt", "ground_truth", "metadata"])
            writer.writerows([p, g, json.dumps(m)] for p, g, m in ARITHMETIC)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        columns = list(zip(*ARITHMETIC, strict=True))
        table = pa.table(
            {"user_prompt": columns[0], "ground_truth": columns[1], "metadata": columns[2]}
        )
        pq.write_table(table, path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_each_dataset_format_gives_the_same_rollouts(tmp_path: Path, kind: str) -> None:
    data = write_dataset(tmp_path, kind)
    run_dir = tmp_path / "run"
    proc = run_cli("run", *LOCAL, "-d", str(data), "-o", str(run_dir), home=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(records(run_dir), key=lambda r: r["row"])
    assert [(r["prompt"], r["reward"]) for r in lines] == [
        ("What is 2 + 3?", 1.0),
        ("What is 7 * 6?", 1.0),
        ("What is 9 - 4?", 0.0),
    ]
    result = json.loads((run_dir / lines[1]["result"]).read_text())
    assert result["sample"]["messages"][-1]["content"].endswith("42")


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("bad.csv", "user_prompt,metadata\nhi,{}\nthere,[1\n", "bad.csv:3: metadata: not a JSON"),
        ("bad.csv", "ground_truth\n5\n", "bad.csv:2: a row needs user_prompt or metadata"),
        ("bad.parquet", "not parquet", "bad.parquet: not a readable Parquet file"),
    ],
)
def test_bad_rows_of_each_format_are_named(
    tmp_path: Path, name: str, content: str, expected: str
) -> None:
    (tmp_path / name).write_text(content)
    proc = run_cli("run", *LOCAL, "-d", str(tmp_path / name), home=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in " ".join(proc.stderr.replace("│", " ").split())
    assert not (tmp_path / "runs").exists()


# Per attempt, a known answer: row 0 right on attempts 0 and 1, row 1 never, row 2 on attempt 3.
PASS_AT_K_SCRIPT = {
    "name": "known-attempts",
    "rules": [
        {"rollout": r"\.row-0-[01]$", "turns": [{"content": "2"}]},
        {"rollout": r"\.row-2-3$", "turns": [{"content": "2"}]},
    ],
    "default": [{"content": "3"}],
}


def test_pass_at_k_and_groups_from_known_per_attempt_answers(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({"user_prompt": f"Question {i}: what is 1 + 1?", "ground_truth": "2"}) + "\n"
            for i in range(3)
        )
    )
    script = tmp_path / "script.json"
    script.write_text(json.dumps(PASS_AT_K_SCRIPT))
    run_dir = tmp_path / "run"
    proc = run_cli(
        "run", *LOCAL, "-d", str(data), "-k", "4", "--policy-script", str(script),
        "-o", str(run_dir), home=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # Unbiased estimator 1 - C(n-c, k) / C(n, k) per row, averaged: (n, c) = (4,2), (4,0), (4,1).
    expected = {"1": (0.5 + 0 + 0.25) / 3, "2": (5 / 6 + 0 + 0.5) / 3, "4": (1 + 0 + 1) / 3}
    assert metrics["pass_at_k"] == pytest.approx(expected)
    assert metrics["pass_at_k_rows"] == {"1": 3, "2": 3, "4": 3}
    assert summary(proc)["pass_at_k"] == {k: round(v, 4) for k, v in expected.items()}
    assert "pass@2 0.444" in proc.stdout
    groups = {g["row"]: g for g in metrics["groups"]}
    assert [(groups[r]["passed"], groups[r]["mean_reward"]) for r in range(3)] == [
        (2, 0.5),
        (0, 0.0),
        (1, 0.25),
    ]
    assert groups[0]["reward_std"] == 0.5 and groups[0]["attempts"] == 4
    assert metrics["group_summary"] == {
        "groups": 3,
        "zero_variance": 1,  # row 1: every reward 0, no learning signal
        "all_passed": 0,
        "none_passed": 1,
        "mean_reward_std": pytest.approx((0.5 + 0 + 0.4330127) / 3),
    }
    assert metrics["planned"] == 12 and metrics["mean_reward"] == 0.25


def test_the_results_files_say_what_each_rollout_did(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["ok", "flaky"])
    run_dir = tmp_path / "run"
    proc = run_cli(
        "run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir),
        home=tmp_path, env={"TEST_FAIL": "1"},
    )  # fmt: skip
    assert proc.returncode == 1
    ok, failed = sorted(records(run_dir), key=lambda r: r["row"])
    assert ok["status"] == "success" and ok["reward"] == 1.0 and ok["passed"] is True
    assert ok["failure"] is None and ok["failed_phase"] is None and ok["answer"] == "42"
    assert ok["prompt"] == "ok" and ok["rollout_id"] == "run.row-0-0"
    assert {"queued_sec", "setup_sec", "agent_sec", "grader_sec"} <= set(ok["timings"])
    assert ok["started_at"] <= ok["finished_at"]
    for key in ("result", "trajectory", "artifacts"):
        assert (run_dir / ok[key]).exists(), key
    assert failed["status"] == "failure" and failed["reward"] is None and failed["passed"] is None
    assert failed["failed_phase"] == "agent"
    assert failed["failure"]["category"] == "agent_error"
    assert "flaky row failed" in failed["failure"]["message"]
    assert failed["trajectory"] is None  # no sample, no trajectory
    full = json.loads((run_dir / failed["result"]).read_text())
    assert full["rollout_id"] == failed["rollout_id"] and full["status"] == "failure"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["counts"] == {"success": 1, "failure": 1, "cancelled": 0, "not_run": 0}
    assert metrics["failures_by_category"] == {"agent_error": 1}
    # Time per phase, over the rollouts that went through it (the failure ended in its agent).
    assert metrics["time_per_phase"]["setup_sec"]["count"] == 2
    assert metrics["time_per_phase"]["agent_sec"]["count"] == 1
    assert metrics["complete"] is True and metrics["planned"] == 2
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["run_id"] == "run" and manifest["rows"] == 2 and manifest["attempts"] == 1
    assert manifest["inputs"]["backend"] == "local" and manifest["inputs"]["policy"] == "scripted"
    # The summary at the end, in words and as the last line.
    assert "rollouts: 1 succeeded, 1 failed, 0 cancelled, 0 not run, of 2" in proc.stdout
    assert "failures by phase: agent: agent_error 1" in proc.stdout


def test_tokens_are_counted_from_the_relayed_calls(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("run", *LOCAL, "-o", str(run_dir), home=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = records(run_dir)
    assert all(r["policy_calls"] == 1 and r["tokens"]["completion"] > 0 for r in lines)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["tokens"]["prompt"] == sum(r["tokens"]["prompt"] for r in lines) > 0
    assert metrics["policy_calls"] == len(lines)


def test_plain_progress_lines_off_a_terminal(tmp_path: Path) -> None:
    proc = run_cli(
        "run", *LOCAL, "--progress-every", "0.1", "-o", str(tmp_path / "r"), home=tmp_path
    )
    assert proc.returncode == 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("progress: ")]
    assert lines and lines[-1].startswith("progress: done 12/12 | running 0 | failed 0")
    assert "mean reward 1.000" in lines[-1] and "rollouts/s" in lines[-1] and "ETA" in lines[-1]
    assert "\x1b[" not in proc.stderr  # no terminal codes in a log


def test_a_damaged_results_file_is_named_not_overwritten(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["ok", "ok"])
    run_dir = tmp_path / "run"
    args = ["run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir)]
    assert run_cli(*args, home=tmp_path).returncode == 0
    results = run_dir / "results.jsonl"
    damaged = b'{"rollout_id": "x"}\n' + results.read_bytes()
    results.write_bytes(damaged)
    proc = run_cli(*args, home=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "results.jsonl:1: not a result line" in " ".join(proc.stderr.replace("│", " ").split())
    assert results.read_bytes() == damaged
