"""Agent runtime benchmark: mini-swe-agent from its prepared runtime, per trial, side by side.

Run as root: `python tests/benchmarks/bench_runtimes.py [rounds]` (default 5). One task
(tasks/harbor/workdir-copy, no network), behind one relay with the embedded scripted policy
playing tasks/harbor-templates/mini-swe-agent.json. Interleaved rounds of:

* HarborBackend with Harbor's `oracle` (the sandboxed trial with no agent to speak of);
* HarborBackend with an agent that only runs `python -c "import litellm"` with the runtime's
  Python in the trial's sandbox (what every LiteLLM-based agent pays at its start);
* HarborBackend with `agent="mini-swe-agent"`: the runtime bound in, two policy calls.

Prints medians per loop (whole rollout and Harbor's agent phase), the differences and the
ratio against the oracle trial, and the runtime's one-time build as its manifest recorded it.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from harbor.models.trial.config import EnvironmentConfig

from backends import Relay, RelayedBackend, RolloutRequest, RolloutResult
from backends.harbor import HarborBackend
from backends.relay import Script, ScriptedPolicy
from backends.runtimes import RUNTIMES, ensure_runtime

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tasks" / "harbor"
SCRIPT = ROOT / "tasks" / "harbor-templates" / "mini-swe-agent.json"
_ids = iter(range(10**9))


class ImportsLitellm(BaseAgent):
    """Runs only `import litellm` with the runtime's Python, in the trial's sandbox."""

    def __init__(self, *args: Any, python: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.python = python

    @staticmethod
    def name() -> str:
        return "imports-litellm"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        done = await environment.exec(
            f"{self.python} -c 'import litellm'",
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONDONTWRITEBYTECODE": "1"},
        )
        assert done.return_code == 0, done.stderr


async def one(backend: RelayedBackend, expect: float) -> RolloutResult:
    request = RolloutRequest(
        rollout_id=f"bench-{next(_ids)}", prompt=[], metadata={"harbor_task_id": "workdir-copy"}
    )
    result = await backend.execute(request)
    assert result.reward == expect, result.failure
    return result


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def main(rounds: int) -> None:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    runtime = await ensure_runtime(RUNTIMES["mini-swe-agent"])
    offline = {"network": "none"}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)

        def harbor(name: str, agent: Any, **kwargs: Any) -> HarborBackend:
            return HarborBackend(
                tasks_dir=TASKS,
                task_mode="dataset",
                agent=agent,
                trials_dir=tmp / name / "trials",
                artifacts=tmp / name / "out",
                **kwargs,
            )

        async with (
            ScriptedPolicy(Script.load(SCRIPT)) as policy,
            Relay(
                upstream_url=policy.base_url, upstream_api_key="k", unix_socket_path=tmp / "r.sock"
            ) as relay,
        ):
            oracle = RelayedBackend(
                harbor("oracle", "oracle", environment_config=EnvironmentConfig(kwargs=offline)),
                relay,
            )
            imports = RelayedBackend(
                harbor(
                    "imports",
                    ImportsLitellm,
                    native_agent_kwargs={"python": str(runtime.path / "venv" / "bin" / "python")},
                    environment_config=EnvironmentConfig(kwargs=runtime.sandbox_kwargs(offline)),
                ),
                relay,
            )
            mini = RelayedBackend(
                harbor(
                    "mini", "mini-swe-agent", environment_config=EnvironmentConfig(kwargs=offline)
                ),
                relay,
            )
            loops: dict[str, tuple[Callable[[], Awaitable[RolloutResult]], list[int]]] = {
                "oracle": (lambda: one(oracle, 1.0), []),
                "import litellm only": (lambda: one(imports, 0.0), []),  # the task is not done
                "mini-swe-agent": (lambda: one(mini, 1.0), []),
            }
            for fn, _ in loops.values():  # warm-up: imports, the runtime, the image
                await fn()
            timings: dict[str, list[float]] = {name: [] for name in loops}
            agent_phase: dict[str, list[float]] = {name: [] for name in loops}
            for _ in range(rounds):
                for name, (fn, _) in loops.items():
                    started = time.perf_counter()
                    result = await fn()
                    timings[name].append(time.perf_counter() - started)
                    agent_phase[name].append(result.timings.get("harbor.agent_sec", 0.0))
            await mini.aclose()
    runtime.release()

    print(f"agent runtime benchmark: {rounds} interleaved rounds, medians")
    for name in loops:
        print(
            f"  {name:22s} {median_ms(timings[name]):8.1f} ms"
            f"   (Harbor's agent phase {median_ms(agent_phase[name]):7.1f} ms)"
        )
    base = median_ms(timings["oracle"])
    agent = median_ms(timings["mini-swe-agent"])
    imports_ms = median_ms(timings["import litellm only"])
    print(f"mini-swe-agent trial - oracle trial:     {agent - base:+8.1f} ms")
    print(f"import-litellm trial - oracle trial:     {imports_ms - base:+8.1f} ms")
    print(f"mini-swe-agent trial / oracle trial:     {agent / base:8.2f}x")
    manifest = runtime.manifest
    print(
        f"runtime build (once per host): {manifest.build_sec:.1f} s, "
        f"{manifest.size_bytes / 1024**2:.0f} MiB, {len(manifest.packages)} packages"
    )


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
