"""Harbor agents and task builders the HarborBackend tests load by import path.

The agents are real Harbor ``BaseAgent`` subclasses: each runs shell commands in the trial's
sandbox the way an adversarial or slow agent would.
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path
from typing import ClassVar

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

from backends.sandbox.local import LocalSandbox


class _ShellAgent(BaseAgent):
    """Runs ``script`` (with ``{instruction}`` filled in, shell-quoted) in the sandbox."""

    script = "true"

    @staticmethod
    def name() -> str:
        return "shell-agent"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        await environment.exec(self.script.format(instruction=shlex.quote(instruction)))


class PlantsReward(_ShellAgent):
    """Writes the reward files itself instead of doing the task."""

    script = (
        "echo 1 > /logs/verifier/reward.txt; echo '{{\"reward\": 1}}' > /logs/verifier/reward.json"
    )


class SwapsReward(_ShellAgent):
    """Leaves a daemon that turns the verifier's reward.txt into a link to the instruction's path."""

    script = (
        "target=$(echo {instruction}); nohup bash -c 'while :; do f=/logs/verifier/reward.txt; "
        'if [ -f $f ] && [ ! -L $f ]; then ln -sf "$0" $f; fi; sleep 0.01; done\' "$target" '
        ">/dev/null 2>&1 &"
    )


class ForgesRewardLater(_ShellAgent):
    """Leaves daemons that write 1 over the tests' reward and swap in tests that write 1."""

    script = (
        "nohup bash -c 'f=/logs/verifier/reward.txt; while :; do "
        'if [ -s $f ] && [ "$(cat $f)" != 1 ]; then echo 1 > $f; fi; sleep 0.005; done\' '
        ">/dev/null 2>&1 & "
        "nohup bash -c 'while [ ! -s /tests/test.sh ]; do sleep 0.001; done; "
        'printf "#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n" > /tests/t.new; '
        "chmod +x /tests/t.new; mv -f /tests/t.new /tests/test.sh' >/dev/null 2>&1 &"
    )


class LeavesService(_ShellAgent):
    """Starts a long-running 'service' the task's tests look for."""

    script = "nohup sleep 876543 >/dev/null 2>&1 &"


class DeepArtifacts(_ShellAgent):
    """Leaves an artifact 200 directories deep (past PATH_MAX on the host) beside a normal one."""

    script = (
        "echo kept > /logs/artifacts/kept.txt; cd /logs/artifacts; "
        "for i in $(seq 200); do mkdir dddddddddddddddddddddddddddddddddddddddd; "
        "cd dddddddddddddddddddddddddddddddddddddddd; done; echo x > f.txt"
    )


class Snoops(_ShellAgent):
    """Looks for the tests and for the label before verification; reports in its artifacts."""

    script = (
        "{{ echo tests:; ls -A /tests 2>&1; echo instruction: {instruction}; echo env:; env; "
        "echo grep:; grep -rlsE --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
        "'CAN[A]RY-[0-9a-f]{{32}}' / 2>/dev/null; echo end; }} > /logs/artifacts/snoop.txt 2>&1"
    )

    @staticmethod
    def canary() -> str:
        """A label the pattern above finds, though the pattern itself never matches it."""
        import uuid

        return "CANARY-" + uuid.uuid4().hex


class Sleeps(_ShellAgent):
    """Sleeps for a long time under a marker, so a test can find its processes."""

    marker = "987654"
    script = "nohup sleep 987654 >/dev/null 2>&1 & sleep 987654"


class Answers(_ShellAgent):
    """Writes the instruction's last word to /app/answer.txt (a template-mode agent)."""

    script = "mkdir -p /app && echo {instruction} | awk '{{print $NF}}' > /app/answer.txt"


class StallsTransfers(_ShellAgent):
    """Replaces the sandbox's tar with one that hangs, so every later transfer stalls."""

    script = "printf '#!/bin/sh\\nexec sleep 876543\\n' > /usr/bin/tar; chmod 755 /usr/bin/tar"


def write_task(root: Path, name: str, *, test: str, solve: str = "true", toml: str = "") -> Path:
    """A single-step task on the base image with the given tests and oracle solution."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "README.md").write_text("base image\n")
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text(f"Do the {name} task.\n")
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n'
        "[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 30.0\n"
        '[environment]\ndocker_image = "ubuntu:24.04"\nworkdir = "/app"\n' + toml
    )
    for path, body in ((task / "tests" / "test.sh", test), (task / "solution" / "solve.sh", solve)):
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return task


class CountingSandbox(LocalSandbox):
    """The local sandbox, counting its file transfers (class-wide, reset by the test)."""

    transfers: ClassVar[Counter[str]] = Counter()

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        CountingSandbox.transfers[f"download {source_dir}"] += 1
        await super().download_dir(source_dir, target_dir)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        CountingSandbox.transfers[f"upload {target_dir}"] += 1
        await super().upload_dir(source_dir, target_dir)
