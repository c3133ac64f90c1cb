"""HarborBackend benchmark: one trivial `oracle` task, side by side in one run.

Run as root: `python tests/benchmarks/bench_harbor.py [rounds] [parallel_rollouts]` (defaults
30 and 48). Interleaved rounds of:

* `HarborBackend` (dataset mode, local sandbox, the trial's /logs bound to the host);
* Harbor's own `Trial` driven directly over the same `LocalSandbox` (Harbor's defaults);
* the same `Trial` over `HostExec`, a bare environment written here that runs each command
  on the host with bash (no isolation at all): the floor for Harbor's own work.

Prints p50/p99 per loop and the ratios (targets: HarborBackend within 10% of Harbor's Trial,
the local trial within 2x of the host-exec trial), then rollouts/s with 16 in flight for
HarborBackend and Harbor's Trial (target: HarborBackend within 10%).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

from backends.harbor import HarborBackend
from backends.rollout import RolloutRequest, collect

LOCAL = "backends.sandbox.local:LocalSandbox"
HOST_ROOTS = ("/logs", "/tests", "/solution", "/app")

TASK_TOML = """schema_version = "1.4"
[verifier]
timeout_sec = 60.0
[agent]
timeout_sec = 60.0
[environment]
docker_image = "ubuntu:24.04"
workdir = "/app"
"""


def write_task(root: Path) -> Path:
    task = root / "tasks" / "trivial"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "environment" / "README.md").write_text("base image\n")
    (task / "task.toml").write_text(TASK_TOML)
    (task / "instruction.md").write_text("Write 42 to /app/answer.txt.\n")
    for path, body in (
        (task / "solution" / "solve.sh", "echo 42 > /app/answer.txt"),
        (task / "tests" / "test.sh", '[ "$(cat /app/answer.txt)" = 42 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt'),
    ):  # fmt: skip
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return task


class HostExec(BaseEnvironment):
    """Runs the trial on the host itself: real /logs, /tests, /solution and /app directories.

    Only for this benchmark, one trial at a time (the paths are global); start() refuses to
    run if any of them exists already.
    """

    @staticmethod
    def type() -> str:
        return "host-exec"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        return None

    async def start(self, force_build: bool) -> None:
        taken = [root for root in HOST_ROOTS if os.path.lexists(root)]  # noqa: ASYNC240
        if taken:
            raise RuntimeError(f"{taken} exist on the host: HostExec needs them free")
        for path in ("/logs/agent", "/logs/verifier", "/logs/artifacts", "/app"):
            os.makedirs(path)

    async def stop(self, delete: bool) -> None:
        for root in HOST_ROOTS:
            shutil.rmtree(root, ignore_errors=True)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        merged = {**os.environ, **(self._merge_env(env) or {})}
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            command,
            cwd=cwd or "/app",
            env=merged,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout_sec or None)
        return ExecResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            return_code=proc.returncode or 0,
        )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        os.makedirs(os.path.dirname(target_path), exist_ok=True)
        shutil.copy2(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        shutil.copytree(source_dir, target_dir, dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        shutil.copy2(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        shutil.copytree(source_dir, target_dir, dirs_exist_ok=True)


async def harbor_trial(task: Path, trials: Path, environment: EnvironmentConfig) -> None:
    config = TrialConfig(
        task=TaskConfig(path=task),
        agent=AgentConfig(name="oracle"),
        environment=environment,
        trials_dir=trials,
    )
    result = await (await Trial.create(config)).run()
    assert result.verifier_result is not None, result.exception_info
    assert result.verifier_result.rewards == {"reward": 1.0}
    shutil.rmtree(trials / config.trial_name, ignore_errors=True)  # as HarborBackend does


_ids = iter(range(10**9))


def requests(n: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(
            rollout_id=f"bench-{next(_ids)}", prompt=[], metadata={"harbor_task_id": "trivial"}
        )
        for _ in range(n)
    ]


async def backend_rollouts(backend: HarborBackend, n: int) -> None:
    for result in await collect(backend, requests(n), max_in_flight=16):
        assert result.reward == 1.0, result.failure


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main(rounds: int, parallel: int) -> None:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        task = write_task(tmp)
        trials = tmp / "trials"
        backend = HarborBackend(
            tasks_dir=task.parent,
            task_mode="dataset",
            trials_dir=trials / "backend",
            artifacts=tmp / "artifacts",
            max_concurrent=16,
        )
        local = EnvironmentConfig(import_path=LOCAL)
        host = EnvironmentConfig(import_path=f"{__name__}:HostExec")
        loops = {
            "HarborBackend": lambda: backend_rollouts(backend, 1),
            "Harbor Trial, LocalSandbox": lambda: harbor_trial(task, trials / "local", local),
            "Harbor Trial, host-exec": lambda: harbor_trial(task, trials / "host", host),
        }
        timings: dict[str, list[float]] = {name: [] for name in loops}
        for fn in loops.values():  # warm-up: imports, the base image, the sandbox pool
            await fn()
        for _ in range(rounds):
            for name, fn in loops.items():
                t0 = time.perf_counter()
                await fn()
                timings[name].append((time.perf_counter() - t0) * 1000)
        print(f"serial: {rounds} rounds, interleaved, one oracle trial each")
        for name, xs in timings.items():
            print(f"  {name:28s} p50 {pct(xs, 0.5):7.1f} ms   p99 {pct(xs, 0.99):7.1f} ms")
        ours = statistics.median(timings["HarborBackend"])
        theirs = statistics.median(timings["Harbor Trial, LocalSandbox"])
        bare = statistics.median(timings["Harbor Trial, host-exec"])
        print(f"  ratio p50 HarborBackend / Harbor Trial: {ours / theirs:.2f}x (target <= 1.10x)")
        print(f"  ratio p50 HarborBackend / host-exec trial: {ours / bare:.2f}x (target <= 2x)")
        print(f"  ratio p50 Harbor Trial on LocalSandbox / host-exec: {theirs / bare:.2f}x")

        limiter = anyio.CapacityLimiter(16)

        async def direct_batch() -> None:
            async def one() -> None:
                async with limiter:
                    await harbor_trial(task, trials / "local", local)

            async with anyio.create_task_group() as group:
                for _ in range(parallel):
                    group.start_soon(one)

        rates: dict[str, list[float]] = {"HarborBackend": [], "Harbor Trial": []}
        for _ in range(3):
            for name, fn in (
                ("HarborBackend", lambda: backend_rollouts(backend, parallel)),
                ("Harbor Trial", direct_batch),
            ):
                t0 = time.perf_counter()
                await fn()
                rates[name].append(parallel / (time.perf_counter() - t0))
        print(f"parallel: {parallel} rollouts, 16 in flight, 3 interleaved rounds (median)")
        for name, xs in rates.items():
            print(f"  {name:28s} {statistics.median(xs):6.1f} rollouts/s")
        ratio = statistics.median(rates["HarborBackend"]) / statistics.median(rates["Harbor Trial"])
        print(f"  ratio HarborBackend / Harbor Trial: {ratio:.2f}x (target >= 0.90x)")


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    parallel = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    asyncio.run(main(rounds, parallel))
