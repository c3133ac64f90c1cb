"""Agent runtime benchmark: Harbor's installed agents from their prepared runtimes, per trial,
side by side.

Run as root: `python tests/benchmarks/bench_runtimes.py [rounds]` (default 5). One task
(tasks/harbor/workdir-copy, no network), behind one relay with the embedded scripted policy
playing each agent's script (tasks/harbor-templates/<agent>.json, told apart by rollout id).
Interleaved rounds of:

* HarborBackend with Harbor's `oracle` (the sandboxed trial with no agent to speak of);
* HarborBackend with an agent that only runs `python -c "import litellm"` with the runtime's
  Python in the trial's sandbox (what every LiteLLM-based agent pays at its start);
* HarborBackend with `agent="mini-swe-agent"`: the runtime bound in, two policy calls;
* an agent that only runs `codex --version` from the codex runtime (its Node and binary start);
* HarborBackend with `agent="codex"`, `"claude-code"` and `"opencode"` (Node runtimes;
  Responses and Messages through the relay), two policy calls each (opencode also asks for
  a title: three).

Prints medians per loop (whole rollout and Harbor's agent phase), the differences and the
ratio against the oracle trial, and the runtime's one-time build as its manifest recorded it.
"""

from __future__ import annotations

import json
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
SCRIPTS = ROOT / "tasks" / "harbor-templates"
_ids = iter(range(10**9))


AGENTS = ("mini-swe-agent", "codex", "claude-code", "opencode")


class RunsOnly(BaseAgent):
    """Runs only ``command`` in the trial's sandbox (a runtime's start, without the agent)."""

    def __init__(self, *args: Any, command: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.command = command

    @staticmethod
    def name() -> str:
        return "runs-only"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        done = await environment.exec(
            self.command,
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONDONTWRITEBYTECODE": "1"},
        )
        assert done.return_code == 0, done.stderr


def script() -> Script:
    """Each agent's script, its rules matched by rollout id (``<agent>-<n>``)."""
    rules: list[Any] = []
    for agent in AGENTS:
        data = json.loads((SCRIPTS / f"{agent}.json").read_text())
        rules += [{**rule, "rollout": f"^{agent}-"} for rule in data["rules"]]
    return Script.model_validate({"name": "bench", "rules": rules})


async def one(backend: RelayedBackend, expect: float, agent: str = "bench") -> RolloutResult:
    request = RolloutRequest(
        rollout_id=f"{agent}-{next(_ids)}", prompt=[], metadata={"harbor_task_id": "workdir-copy"}
    )
    result = await backend.execute(request)
    assert result.reward == expect, result.failure
    return result


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def main(rounds: int) -> None:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    runtimes = {agent: await ensure_runtime(RUNTIMES[agent]) for agent in AGENTS}
    runtime, codex = runtimes["mini-swe-agent"], runtimes["codex"]
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
            ScriptedPolicy(script()) as policy,
            Relay(
                upstream_url=policy.base_url, upstream_api_key="k", unix_socket_path=tmp / "r.sock"
            ) as relay,
        ):
            oracle = RelayedBackend(
                harbor("oracle", "oracle", environment_config=EnvironmentConfig(kwargs=offline)),
                relay,
            )
            python = runtime.path / "venv" / "bin" / "python"
            imports = RelayedBackend(
                harbor(
                    "imports",
                    RunsOnly,
                    native_agent_kwargs={"command": f"{python} -c 'import litellm'"},
                    environment_config=EnvironmentConfig(kwargs=runtime.sandbox_kwargs(offline)),
                ),
                relay,
            )
            version = RelayedBackend(
                harbor(
                    "version",
                    RunsOnly,
                    native_agent_kwargs={"command": f"{codex.bin_dir / 'codex'} --version"},
                    environment_config=EnvironmentConfig(kwargs=codex.sandbox_kwargs(offline)),
                ),
                relay,
            )
            agents = {
                agent: RelayedBackend(
                    harbor(agent, agent, environment_config=EnvironmentConfig(kwargs=offline)),
                    relay,
                )
                for agent in AGENTS
            }

            def run(agent: str) -> Callable[[], Awaitable[RolloutResult]]:
                return lambda: one(agents[agent], 1.0, agent)

            loops: dict[str, tuple[Callable[[], Awaitable[RolloutResult]], list[int]]] = {
                "oracle": (lambda: one(oracle, 1.0), []),
                "import litellm only": (lambda: one(imports, 0.0), []),  # the task is not done
                "mini-swe-agent": (run("mini-swe-agent"), []),
                "codex --version only": (lambda: one(version, 0.0), []),
                "codex": (run("codex"), []),
                "claude-code": (run("claude-code"), []),
                "opencode": (run("opencode"), []),
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
            for backend in agents.values():
                await backend.aclose()
    for held in runtimes.values():
        held.release()

    print(f"agent runtime benchmark: {rounds} interleaved rounds, medians")
    for name in loops:
        print(
            f"  {name:22s} {median_ms(timings[name]):8.1f} ms"
            f"   (Harbor's agent phase {median_ms(agent_phase[name]):7.1f} ms)"
        )
    base = median_ms(timings["oracle"])
    for name in loops:
        if name != "oracle":
            ms = median_ms(timings[name])
            print(f"{name + ' - oracle:':34s} {ms - base:+8.1f} ms   ({ms / base:6.2f}x)")
    for agent, held in runtimes.items():
        manifest = held.manifest
        print(
            f"{agent} runtime build (once per host): {manifest.build_sec:.1f} s, "
            f"{manifest.size_bytes / 1024**2:.0f} MiB, {len(manifest.packages)} packages"
        )


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
