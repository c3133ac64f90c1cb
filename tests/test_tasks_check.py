"""`backends tasks check DIR`, run as a user porting tasks runs it: the bundled tasks pass, and
each kind of broken or unrunnable task is named with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[1]

GOOD_TEST = """#!/bin/bash
if [ -f /app/done ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def make_task(
    root: Path,
    name: str,
    *,
    toml: str | None = None,
    solve: str | None = "touch /app/done\n",
    test: str = GOOD_TEST,
    environment: str = 'docker_image = "ubuntu:24.04"\nworkdir = "/app"\n',
) -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "environment" / "README.md").write_text("prebuilt image\n")
    (task / "instruction.md").write_text("Create /app/done.\n")
    (task / "tests" / "test.sh").write_text(test)
    if solve is not None:
        (task / "solution").mkdir()
        (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solve}")
    default = (
        f"[agent]\ntimeout_sec = 60.0\n[verifier]\ntimeout_sec = 60.0\n[environment]\n{environment}"
    )
    (task / "task.toml").write_text(default if toml is None else toml)
    return task


def check(path: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "backends.cli", "tasks", "check", str(path), *args]
    env = {**os.environ, "COLUMNS": "400", "BACKENDS_HOME": str(home)}  # one row per line
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def row(output: str, task: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith(f"│ {task} ")]
    return " ".join(line.replace("│", " ").split())


def test_bundled_tasks_all_pass(tmp_path: Path) -> None:
    done = check(ROOT / "tasks" / "harbor", home=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "10 passed, 0 failed, 0 skipped" in done.stdout
    assert row(done.stdout, "artifacts").startswith("artifacts 1 0 pass")
    # The task whose tests fail on purpose says why its oracle's 0 is a pass.
    assert "expected_oracle_reward" in row(done.stdout, "failing-tests")
    assert list((tmp_path / "tasks-check").iterdir()) == []  # nothing to look at: nothing kept


def test_broken_and_unrunnable_tasks_are_named_with_their_reason(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    make_task(tasks, "good")
    make_task(tasks, "bad-toml", toml="[agent\ntimeout_sec = 60\n")
    make_task(tasks, "bad-field", toml='[environment]\ncpus = "many"\n')
    make_task(tasks, "no-solution", solve=None)
    make_task(tasks, "oracle-fails", solve="true\n")
    make_task(tasks, "nop-passes", test="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    make_task(tasks, "no-reward", test="#!/bin/bash\nexit 0\n")
    make_task(tasks, "no-image", environment='docker_image = "nvidia/cuda:12.4.0-base"\n')
    make_task(tasks, "gpu", environment='docker_image = "ubuntu:24.04"\ngpus = 1\n')
    make_task(
        tasks,
        "needs-network",
        test="#!/bin/bash\n# fetch the test runner\n"
        "curl -fsS -o /tmp/run.sh http://tasks-check.invalid/run.sh && bash /tmp/run.sh && echo 1 > /logs/verifier/reward.txt"
        " || echo 0 > /logs/verifier/reward.txt\n",
    )
    done = check(tasks, "-n", "6", home=tmp_path / "home")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 passed, 6 failed, 3 skipped" in out
    assert row(out, "good").startswith("good 1 0 pass")
    assert "invalid task: task.toml is not valid TOML" in row(out, "bad-toml")
    assert "line 1" in row(out, "bad-toml")
    assert "environment.cpus" in row(out, "bad-field")
    assert "no solution/solve.sh" in row(out, "no-solution")
    assert "oracle scored 0 (must be 1): solution/solve.sh does not pass" in row(
        out, "oracle-fails"
    )
    assert "nop scored 1 (must be 0): the tests pass with nothing done" in row(out, "nop-passes")
    assert "verifier_error" in row(out, "no-reward")
    no_image = row(out, "no-image")
    assert "skip cannot run here" in no_image and "nvidia/cuda:12.4.0-base" in no_image
    assert "skip cannot run here" in row(out, "gpu") and "GPU" in row(out, "gpu")
    network = row(out, "needs-network")
    assert "skip cannot run here: it needs the network for its verifier" in network
    assert "tests/test.sh:3: curl" in network  # the line, not the comment above it
    # The trials stay for the user to read why: the tests' own output of each run.
    [kept] = list((tmp_path / "home" / "tasks-check").iterdir())
    assert f"trials of every run (oracle/, nop/): {kept}" in out
    assert list(kept.glob("oracle/oracle-fails-0*/verifier/test-stdout.txt"))


def test_one_task_directory_and_a_directory_without_tasks(tmp_path: Path) -> None:
    task = make_task(tmp_path / "one", "solo")
    done = check(task, home=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    (tmp_path / "empty").mkdir()
    done = check(tmp_path / "empty", home=tmp_path)
    assert done.returncode == 2
    assert "holds no Harbor task" in done.stderr
    done = check(task, "-e", "kubernetes-ish", home=tmp_path)
    assert done.returncode == 2
    assert "environment 'kubernetes-ish' is not 'local'" in done.stderr


def test_task_text_is_not_read_as_terminal_markup(tmp_path: Path) -> None:
    # A task's name and messages reach the table as plain text: "[red]" stays visible.
    make_task(tmp_path / "tasks", "x[bold]y", solve="true\n")
    done = check(tmp_path / "tasks", home=tmp_path)
    assert done.returncode == 1
    assert "│ x[bold]y " in done.stdout


def test_the_network_hint_reads_only_the_start_of_regular_test_scripts(tmp_path: Path) -> None:
    from harbor.models.task.config import TaskConfig

    from backends.cli.tasks_verdict import network_fetch

    task = make_task(tmp_path, "t", test="#!/bin/bash\n# curl in a comment\nwget -q http://x/\n")
    config = TaskConfig()
    assert network_fetch(task, config) == "tests/test.sh:3: wget -q http://x/"
    offline = TaskConfig.model_validate({"verifier": {"network_mode": "no-network"}})
    assert network_fetch(task, offline) is None  # the task chose no network: its failure
    (task / "tests" / "test.sh").unlink()
    (task / "tests" / "test.sh").symlink_to("/dev/zero")  # would never end if read whole
    assert network_fetch(task, config) is None


def test_a_network_word_that_runs_nothing_excuses_no_failure(tmp_path: Path) -> None:
    """A wrong solution was skipped (exit 0) as "needs the network" because a test line only
    mentioned curl in a trailing comment: only commands the tests run may excuse a failure."""
    from harbor.models.task.config import TaskConfig

    from backends.cli.tasks_verdict import network_fetch

    lines = [
        "#!/bin/bash",
        "ans=$(cat /app/answer.txt)  # compare, no curl or wget needed",
        "echo 'install with: pip install foo'",
        "command -v curl >/dev/null || true",
        '[ "$ans" = 42 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt',
    ]
    task = make_task(
        tmp_path / "tasks",
        "broken",
        test="\n".join(lines) + "\n",
        solve="echo 41 > /app/answer.txt\n",
    )
    assert network_fetch(task, TaskConfig()) is None
    done = check(tmp_path / "tasks", home=tmp_path)
    assert done.returncode == 1, done.stdout
    assert "oracle scored 0" in done.stdout
