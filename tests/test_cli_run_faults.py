"""``backends run`` under hostile rows, faults and signals, the way a user meets them."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_cli_run import BACKENDS, REPO, full_results, only_run, records, run_cli
from watchdog_support import is_block_of, reported_block

# Behaviour picked by the row's user_prompt.
ENTRYPOINT = """
import time

import anyio
from backends import AgentWorkflow, Grader, LocalBackend


class W(AgentWorkflow):
    async def run(self, ctx):
        prompt = ctx.prompt[-1]["content"]
        if prompt == "object":
            return [*ctx.prompt, {"role": "assistant", "content": object()}]
        if prompt == "bytes":
            reply = {"role": "assistant", "content": "ok", "tool_calls": [{"id": b"raw"}]}
            return [*ctx.prompt, reply]
        if prompt.startswith("child"):
            # A child process per rollout: a stopped run must not leave it behind.
            await anyio.run_process(["sleep", "30.%s" % prompt.removeprefix("child")])
        if prompt == "block":
            time.sleep(3)  # blocks the event loop: every other rollout waits
        if prompt == "wait":
            await anyio.sleep(0.5)
        if prompt.startswith("big"):
            return [*ctx.prompt, {"role": "assistant", "content": "x" * int(prompt[3:])}]
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class G(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


backend = LocalBackend(workflow=W, grader=G)
"""


def entrypoint(tmp_path: Path) -> str:
    """The test's LocalBackend, kept in this process (``--backend local`` follows it)."""
    path = tmp_path / "entry.py"
    path.write_text(ENTRYPOINT)
    return f"{path}:backend"


LOCAL = ["--backend", "local"]


def dataset(tmp_path: Path, prompts: list[str], name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(
        "".join(json.dumps({"user_prompt": p, "ground_truth": "42"}) + "\n" for p in prompts)
    )
    return path


def results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


@pytest.mark.parametrize(
    ("bad", "field"), [("object", "content: object is not JSON"), ("bytes", "tool_calls[0].id")]
)
@pytest.mark.parametrize("with_output", [True, False])
def test_a_row_whose_messages_are_not_json_fails_alone(
    tmp_path: Path, bad: str, field: str, with_output: bool
) -> None:
    data = dataset(tmp_path, ["ok"] * 4 + [bad] + ["ok"] * 5)
    out = tmp_path / "out"
    args = ["-o", str(out)] if with_output else []
    proc = run_cli("run", entrypoint(tmp_path), *LOCAL, "-d", str(data), *args, home=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    written = full_results(out if with_output else only_run(tmp_path))
    assert len(written) == 10
    good = [r for r in written if r["status"] == "success"]
    assert len(good) == 9 and all(r["sample"]["reward"] == 1.0 for r in good)
    (failed,) = [r for r in written if r["status"] != "success"]
    assert failed["rollout_id"].endswith(".row-4-0")
    assert failed["failure"]["category"] == "validation_error"
    assert failed["failure"]["phase"] == "agent"
    assert field in failed["failure"]["message"]
    assert failed["sample"] is None  # no reward 1 for a sample that could not be built
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["graded"] == 9 and summary["failures"] == {"validation_error": 1}


def test_two_runs_at_once_keep_apart(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["ok"] * 10)
    env = {**os.environ, "BACKENDS_HOME": str(tmp_path), "COLUMNS": "200"}
    cmd = [*BACKENDS, "run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-k", "4"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE) for _ in range(2)]
    for proc in procs:
        assert proc.wait(120) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    ids: list[set[str]] = []
    for run in runs:
        rollouts = sorted((run / "rollouts").iterdir())
        assert len(rollouts) == 40
        for folder in rollouts:
            # Each folder holds its own rollout's trajectory, from this run, nothing else.
            assert folder.name.startswith(run.name + ".row-")
            trajectory = json.loads((folder / "trajectory.json").read_text())
            assert trajectory["session_id"] == folder.name
        ids.append({r["rollout_id"] for r in results(run / "results.jsonl")})
        assert ids[-1] == {f.name for f in rollouts}
    assert not ids[0] & ids[1]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_cancels_in_flight_rollouts_and_says_what_finished(
    tmp_path: Path, signum: int, code: int
) -> None:
    tag = f"{os.getpid()}{signum}"
    data = dataset(tmp_path, ["ok"] * 3 + [f"child{tag}"] * 7)
    run_dir = tmp_path / "out"
    out = run_dir / "results.jsonl"
    env = {**os.environ, "BACKENDS_HOME": str(tmp_path), "COLUMNS": "200"}
    cmd = [*BACKENDS, "run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(run_dir)]
    proc = subprocess.Popen(
        [*cmd, "--max-in-flight", "10"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_sleepers(tag)) < 7 or not out.exists() or len(results(out)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        for pid in _sleepers(tag):  # only if the run failed to
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, stdout + stderr
    assert "Traceback" not in stderr
    name = signal.Signals(signum).name
    assert f"interrupted by {name}: 3 of 10 rollouts finished, 7 cancelled, 0 not started" in (
        stderr
    )
    assert "rollouts of run" in stdout  # the table, and the summary line after it
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rollouts"] == 10 and summary["failures"] == {"cancelled": 7}
    written = results(out)
    assert sorted(r["status"] for r in written) == ["cancelled"] * 7 + ["success"] * 3
    assert _sleepers(tag) == []  # every child was killed


def _sleepers(tag: str) -> list[int]:
    """Pids of the `sleep 30.<tag>` children this test's runs started."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline == b"sleep\x0030." + tag.encode() + b"\x00":
            pids.append(int(entry.name))
    return pids


def test_a_results_file_that_cannot_be_written_is_named_and_stays_whole(tmp_path: Path) -> None:
    data = dataset(tmp_path, ["ok"] * 10)
    out = tmp_path / "out" / "results.jsonl"

    def small_files() -> None:  # a file may not grow past 4 kB: as a disk that fills up
        resource.setrlimit(resource.RLIMIT_FSIZE, (4_000, 4_000))

    proc = subprocess.run(
        [*BACKENDS, "run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(out.parent),
         "--max-in-flight", "1"],
        cwd=REPO, env={**os.environ, "BACKENDS_HOME": str(tmp_path), "COLUMNS": "200"},
        capture_output=True, text=True, timeout=120, preexec_fn=small_files,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"cannot write {out}: File too large" in proc.stderr
    assert "the run stopped" in proc.stderr
    written = results(out)  # every line whole JSON: the partial one was cut off
    assert 0 < len(written) < 10
    assert out.read_bytes().endswith(b"\n")


def test_large_prompts_store_each_token_id_list_once(tmp_path: Path) -> None:
    # The example rollout calls the scripted policy, which returns prompt and completion
    # token ids (one per character) like vLLM: a long prompt's ids must not be saved twice.
    size = 300_000
    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps({"user_prompt": "a" * size, "ground_truth": "1"}) + "\n")
    out = tmp_path / "out"
    proc = run_cli("run", *LOCAL, "-d", str(data), "-o", str(out), home=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = (out / records(out)[0]["result"]).read_bytes()
    assert line.count(b'"prompt_token_ids"') == 1
    (call,) = json.loads(line)["extra_fields"]["policy_trace"]["calls"]
    assert len(call["prompt_token_ids"]) == size
    # The prompt text three times (messages, trajectory, the trace's request), its ids once
    # ("97, " each): proportional, with nothing stored twice.
    assert len(line) < 8 * size
    # trajectory.json too: written compact when large (indented, each id took a line).
    (trajectory,) = out.glob("rollouts/*/trajectory.json")
    assert trajectory.stat().st_size < 8 * size


def test_a_workflow_blocking_the_event_loop_is_named_and_others_do_not_time_out(
    tmp_path: Path,
) -> None:
    data = dataset(tmp_path, ["wait"] * 3 + ["block"] + ["wait"] * 6)
    out = tmp_path / "out"
    proc = run_cli(
        "run", entrypoint(tmp_path), *LOCAL, "-d", str(data), "-o", str(out),
        "--max-in-flight", "10", "--agent-timeout", "2", home=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    written = {r["rollout_id"].split(".", 1)[1]: r for r in full_results(out)}
    blamed = written.pop("row-3-0")
    assert {r["status"] for r in written.values()} == {"success"}, written
    assert blamed["failure"]["category"] == "timeout"
    message = blamed["failure"]["message"]
    charged = reported_block(message, "its own code blocked the event loop for ", " (at entry.py:")
    assert is_block_of(charged, 3.0), message
    assert blamed["extra_fields"]["event_loop_blocked"]["seconds"] > 2.5
    logged = [line for line in proc.stderr.splitlines() if "blocked for" in line]
    culprit = [line for line in logged if ".row-3-0" in line]
    assert culprit, proc.stderr
    assert is_block_of(reported_block(culprit[0], "blocked for ", " by rollout"), 3.0), culprit
