"""Bundle benchmark: the arithmetic workflow inside sandboxes against the same in-process.

Run as root: `python tests/benchmarks/bench_bundle.py [rounds]` (default 10). All behind one
relay with the embedded scripted policy. Interleaved rounds of:

* `LocalBackend`: the workflow in this process (the baseline for the workflow's own work);
* `HarborBackend` template mode with `agent=<the workflow>`, its bundle built and installed
  (repeat rollouts: nothing is built or installed), each rollout forked from the plan's warm
  runner (the entrypoint imported once: `backends.bundle.warm`);
* the same with the warm runner off: each rollout's runner a fresh interpreter (cold exec);
* `HarborBackend` template mode with Harbor's `oracle` on the same template (with a tests/
  that gives 1): the sandboxed trial without any workflow.

Then once: the first rollout of a new bundle (a copy of the project with one changed line, so
a new key: resolve, link wheels from the wheelhouse, install offline in a sandbox, run).

Prints medians per loop, the bundled rollout's added time over the oracle trial (target: at
most 50 ms) and its split (Harbor's agent phase = the runner's process), and the ratios.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends import LocalBackend, Relay, RelayedBackend, RolloutRequest, RolloutResult
from backends.harbor import HarborBackend
from backends.relay.scripted import ScriptedPolicy

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tasks" / "rollouts" / "arithmetic"
TEMPLATE = ROOT / "tasks" / "templates" / "workflow"
PROMPT = [
    {"role": "system", "content": "Reply with just the number."},
    {"role": "user", "content": "What is 43 * 21?"},
]
_ids = iter(range(10**9))


def oracle_template(tmp: Path) -> Path:
    task = tmp / "oracle-template"
    shutil.copytree(TEMPLATE, task)
    (task / "tests").mkdir()
    test = task / "tests" / "test.sh"
    test.write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    test.chmod(0o755)
    return task


def workflow_backend(tmp: Path, project: Path, name: str) -> HarborBackend:
    return HarborBackend(
        tasks_dir=TEMPLATE,
        agent=f"{project}/main.py:ArithmeticWorkflow",
        grader=f"{project}/main.py:ExactAnswerGrader",
        trials_dir=tmp / name / "trials",
        artifacts=tmp / name / "out",
    )


async def one(backend: RelayedBackend, expect: float = 1.0) -> RolloutResult:
    request = RolloutRequest(rollout_id=f"bench-{next(_ids)}", prompt=PROMPT, label="903")
    result = await backend.execute(request)
    assert result.reward == expect, result.failure
    return result


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def main(rounds: int) -> None:
    load_before = os.getloadavg()[0]
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        async with (
            ScriptedPolicy() as policy,
            Relay(
                upstream_url=policy.base_url, upstream_api_key="k", unix_socket_path=tmp / "r.sock"
            ) as relay,
        ):
            local = RelayedBackend(
                LocalBackend(
                    workflow=f"{PROJECT}/main.py:ArithmeticWorkflow",
                    grader=f"{PROJECT}/main.py:ExactAnswerGrader",
                    artifacts_root=None,
                ),
                relay,
            )
            bundled = RelayedBackend(workflow_backend(tmp, PROJECT, "bundled"), relay)
            cold_backend = workflow_backend(tmp, PROJECT, "cold")
            assert cold_backend.settings.workflow is not None
            cold_backend.settings.workflow.fork_server = False
            cold = RelayedBackend(cold_backend, relay)
            oracle = RelayedBackend(
                HarborBackend(
                    tasks_dir=oracle_template(tmp),
                    agent="oracle",
                    trials_dir=tmp / "oracle" / "trials",
                    artifacts=tmp / "oracle" / "out",
                ),
                relay,
            )
            loops: dict[str, Callable[[], Awaitable[RolloutResult]]] = {
                "LocalBackend (in-process)": lambda: one(local),
                "HarborBackend, bundled workflow": lambda: one(bundled),
                "HarborBackend, bundled, cold exec": lambda: one(cold),
                "HarborBackend, oracle (no workflow)": lambda: one(oracle),
            }
            for fn in loops.values():  # warm-up: imports, the bundle, its install, the image
                await fn()
            timings: dict[str, list[float]] = {name: [] for name in loops}
            agent_phase: dict[str, list[float]] = {name: [] for name in loops}
            for _ in range(rounds):
                for name, fn in loops.items():
                    started = time.perf_counter()
                    result = await fn()
                    timings[name].append(time.perf_counter() - started)
                    agent_phase[name].append(result.timings.get("agent_sec", 0.0))

            fresh = tmp / "fresh-project"
            shutil.copytree(PROJECT, fresh, ignore=shutil.ignore_patterns("__pycache__"))
            with (fresh / "main.py").open("a") as handle:
                handle.write(f"\n# a new bundle: {time.time()}\n")
            started = time.perf_counter()
            first = RelayedBackend(workflow_backend(tmp, fresh, "fresh"), relay)
            await one(first)
            first_sec = time.perf_counter() - started
            for backend in (bundled, cold, oracle, first):  # warm runners end with them
                await backend.aclose()

    load = f"load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    print(f"bundle benchmark: {rounds} interleaved rounds, medians ({load})")
    for name in loops:
        print(
            f"  {name:38s} {median_ms(timings[name]):8.1f} ms"
            f"   (agent phase {median_ms(agent_phase[name]):7.1f} ms)"
        )
    base = median_ms(timings["HarborBackend, oracle (no workflow)"])
    repeat = median_ms(timings["HarborBackend, bundled workflow"])
    cold_repeat = median_ms(timings["HarborBackend, bundled, cold exec"])
    inproc = median_ms(timings["LocalBackend (in-process)"])
    print(f"  first rollout of a new bundle          {first_sec * 1000:8.1f} ms (once)")
    print(f"repeat bundled rollout - oracle trial:   {repeat - base:+8.1f} ms (target <= +50 ms)")
    print(f"  the same, cold exec (no fork server):  {cold_repeat - base:+8.1f} ms")
    print(f"repeat bundled / oracle trial:           {repeat / base:8.2f}x")
    print(f"repeat bundled / in-process:             {repeat / inproc:8.2f}x")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 10)
