"""Harbor agents and task builders the HarborBackend tests load by import path.

The agents are real Harbor ``BaseAgent`` subclasses: each runs shell commands in the trial's
sandbox the way an adversarial or slow agent would.
"""

from __future__ import annotations

import base64
import os
import shlex
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

from harbor.agents.base import BaseAgent
from harbor.agents.installed import strands as strands_agent
from harbor.agents.installed.strands import Strands
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from host_support import unique_marker

from backends.sandbox.local import LocalSandbox

HIJACK = Path(__file__).with_name("pid1_hijack.py")


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


class SeizesPid1(_ShellAgent):
    """Takes pid 1 over with ptrace (the one process the kill before grading spares) and
    makes it a loop that writes 1 over the tests' reward."""

    forger = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        if open('/logs/verifier/reward.txt').read().strip() not in ('', '1'):\n"
        "            open('/logs/verifier/reward.txt', 'w').write('1')\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.002)\n"
    )
    script = (
        (
            f"echo {base64.b64encode(HIJACK.read_bytes()).decode()} | base64 -d > /root/hijack.py; "
            f"echo {base64.b64encode(forger.encode()).decode()} | base64 -d > /root/forger.py; "
            "python3 /root/hijack.py /usr/bin/python3 /root/forger.py"
        )
        .replace("{", "{{")
        .replace("}", "}}")
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
    """Sleeps for a long time under a marker, so a test can find its processes.

    The marker is this test process's own (another suite on the host runs its own); a
    process it starts that runs this agent is handed it in ``env()``.
    """

    marker = os.environ.get("SLEEPS_MARKER") or unique_marker()
    script = f"nohup sleep {marker} >/dev/null 2>&1 & sleep {marker}"

    @classmethod
    def env(cls) -> dict[str, str]:
        return {"SLEEPS_MARKER": cls.marker}


class Answers(_ShellAgent):
    """Writes the instruction's last word to /app/answer.txt (a template-mode agent)."""

    script = "mkdir -p /app && echo {instruction} | awk '{{print $NF}}' > /app/answer.txt"


class StallsTransfers(_ShellAgent):
    """Replaces the sandbox's tar with one that hangs, so every later transfer stalls."""

    script = "printf '#!/bin/sh\\nexec sleep 876543\\n' > /usr/bin/tar; chmod 755 /usr/bin/tar"


class EndsPid1ByPtrace(_ShellAgent):
    """Instead of doing the task, tries to end the sandbox: traces its pid 1 and resumes it
    with SIGKILL (what the host's own kill looks like)."""

    script = (
        "python3 - <<'EOF'\n"
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
        "if libc.ptrace(16, 1, None, None) == 0:  # PTRACE_ATTACH\n"
        "    os.waitpid(1, 0)\n"
        "    libc.ptrace(7, 1, None, ctypes.c_void_p(9))  # PTRACE_CONT with SIGKILL\n"
        "EOF"
    )


class EndsPid1ThroughItsMemory(_ShellAgent):
    """Instead of doing the task, ends the sandbox: writes exit_group(0) over pid 1's code
    where its blocked read returns (through /proc/1/mem), then interrupts that read."""

    script = (
        "python3 - <<'EOF'\n"
        "import os, signal, time\n"
        "pc = int(open('/proc/1/syscall').read().split()[-1], 16)\n"
        "fd = os.open('/proc/1/mem', os.O_RDWR)\n"
        "os.pwrite(fd, bytes.fromhex('b8e700000031ff0f05'), pc - 2)  # exit_group(0)\n"
        "os.kill(1, signal.SIGCHLD)\n"
        "time.sleep(1)\n"
        "EOF"
    )


class OfflineStrands(Strands):
    """Harbor's own installed Strands agent, with only its install step replaced.

    The real install downloads uv, a Python and strands-agents, none of which this machine
    can reach; this one points the agent's venv at an environment bound into the sandbox
    (a rollout bundle's, which holds strands-agents). The rest is Harbor's: its runner, and
    the model connection it builds from the agent's environment variables (the route).
    """

    def __init__(self, *args: Any, python: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offline_python = python

    async def install(self, environment: BaseEnvironment) -> None:
        runner = Path(strands_agent.__file__).with_name(self._RUNNER_PATH.name)
        local = self.logs_dir / runner.name
        local.write_text(runner.read_text())
        wrapper = self.logs_dir / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {self.offline_python} "$@"\n')
        wrapper.chmod(0o755)
        await environment.exec(f"mkdir -p {self._PYTHON.parent}", user="root")
        await environment.upload_file(local, str(self._RUNNER_PATH))
        await environment.upload_file(wrapper, str(self._PYTHON))
        staged = self._stage_factory_source()
        if staged is not None:
            await environment.upload_dir(staged, str(self._FACTORY_DIR))


async def kill_from_the_host(environment: BaseEnvironment) -> None:
    """SIGKILL the sandbox's pid 1 from the host, as an operator or a failing machine would."""
    import signal

    found = await environment.exec("readlink /proc/self/ns/pid", user="root")
    os.kill(_init_of(found.stdout.strip()), signal.SIGKILL)


def _init_of(namespace: str) -> int:
    """The host pid of the process that is pid 1 in the pid namespace ``namespace``."""
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit() or os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                continue
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        nspid = next(line for line in status.splitlines() if line.startswith("NSpid:"))
        if nspid.split()[-1] == "1":
            return int(entry)
    raise AssertionError(f"no pid 1 in {namespace}")


class LosesSandboxAfterPolicyCall(_ShellAgent):
    """Calls the policy (host side, through the route it is given) and records the token,
    one line per attempt, in ``record``; on its first attempt its sandbox is then killed from
    the host: an infrastructure failure after policy calls were made. Later attempts first
    try the earlier tokens and record the status codes they got."""

    def __init__(
        self,
        logs_dir: Path,
        model_name: str | None = None,
        *args: object,
        policy_base_url: str | None = None,
        policy_api_key: str | None = None,
        record: str = "",
        **kwargs: object,
    ) -> None:
        super().__init__(logs_dir, model_name, *args, **kwargs)  # type: ignore[arg-type]
        self.base_url, self.token, self.record = policy_base_url, policy_api_key, Path(record)

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        import httpx

        earlier = _lines(self.record)
        body = {"model": "policy", "messages": [{"role": "user", "content": "What is 6 * 7?"}]}
        async with httpx.AsyncClient(timeout=30) as http:

            async def call(token: str | None) -> int:
                headers = {"authorization": f"Bearer {token}"}
                reply = await http.post(
                    f"{self.base_url}/chat/completions", json=body, headers=headers
                )
                return reply.status_code

            old_statuses = [await call(token) for token in earlier]
            assert await call(self.token) == 200
        _note(self.record, f"{self.token} {old_statuses}")
        if not earlier:
            await kill_from_the_host(environment)


def _lines(path: Path) -> list[str]:
    return [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []


def _note(path: Path, line: str) -> None:
    with path.open("a") as out:
        out.write(line + "\n")


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


class SurvivorSandbox(LocalSandbox):
    """The local sandbox whose kill before grading reports a survivor (a process stuck past
    SIGKILL, say), though it killed them all."""

    async def end_processes(self) -> bool:
        await super().end_processes()
        return False


class FillsVerifierDir(_ShellAgent):
    """Leaves a tree in /logs/verifier deeper than any download may be."""

    script = "cd /logs/verifier && for i in $(seq 300); do mkdir d && cd d; done"


class BlocksTestsDir(_ShellAgent):
    """Leaves a file where the tests are uploaded."""

    script = "rm -rf /tests; echo x > /tests"


class LinksLogsToCwd(_ShellAgent):
    """Makes /logs a link each process resolves to its own working directory."""

    script = "rm -rf /logs && ln -s /proc/self/cwd /logs"
