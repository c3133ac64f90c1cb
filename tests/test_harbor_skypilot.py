"""HarborBackend with environment="skypilot" over the fake SDK gives the local provider's rewards.

The fake runs each pod as a real local sandbox, so the same Harbor tasks, agents and verifiers
run for real; only the path to them (the SkyPilot provider and SDK) differs.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harbor.agents.installed.base import BaseInstalledAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from harbor.models.trial.config import EnvironmentConfig
from sky_support import create_calls, fake_sky_server
from test_harbor_template import DATASET, TEMPLATES, wrong_for

from backends import HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.harbor import dataset_requests, discover_tasks
from backends.relay import Relay, ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.rollout.dataset import requests_from_dataset

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

TASKS = Path(__file__).parents[1] / "tasks" / "harbor"


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


def prebuilt_tasks() -> list[str]:
    """The example tasks a pod can run: a registry image, no Dockerfile to build and push."""
    return sorted(
        t for t in discover_tasks(TASKS) if not (TASKS / t / "environment" / "Dockerfile").exists()
    )


async def rewards(
    backend: HarborBackend, requests: list[RolloutRequest]
) -> dict[str, float | None]:
    out = {}
    for result in await collect(backend, requests, max_in_flight=8):
        assert result.status is RolloutStatus.SUCCESS, (result.rollout_id, result.failure)
        out[result.rollout_id] = result.reward
    return out


async def test_dataset_mode_rewards_match_the_local_provider(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    tasks = prebuilt_tasks()
    assert {"artifacts", "failing-tests", "named-rewards", "multi-step-rewards"} <= set(tasks)
    requests = [r for r in dataset_requests(TASKS) if r.metadata["harbor_task_id"] in tasks]
    by_env = {}
    for environment in ("local", "skypilot"):
        for agent in ("oracle", "nop"):
            backend = HarborBackend(
                tasks_dir=TASKS,
                task_mode="dataset",
                agent=agent,
                environment=environment,
                trials_dir=tmp_path / environment / "trials",
                artifacts=tmp_path / environment / "out",
                max_concurrent=4,
            )
            got = await rewards(backend, requests)
            by_env[(environment, agent)] = got
    assert by_env[("skypilot", "oracle")] == by_env[("local", "oracle")]
    assert by_env[("skypilot", "nop")] == by_env[("local", "nop")]
    assert set(by_env[("local", "oracle")].values()) == {0.0, 1.0}  # failing-tests gives 0
    # Every pod was terminated.
    import sky_sandbox

    assert await sky_sandbox.ls.aio() == []


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    async with (
        ScriptedPolicy(wrong_for("row-1-")) as policy,
        Relay(upstream_url=policy.base_url, request_token_ids=True) as relay,
    ):
        yield relay


async def test_template_mode_rewards_match_the_local_provider(
    tmp_path: Path, fake_sky: dict[str, str], relay: Relay
) -> None:
    requests = requests_from_dataset(DATASET)[:4]
    by_env = {}
    for environment in ("local", "skypilot"):
        backend = HarborBackend(
            tasks_dir=TEMPLATES / "arithmetic",
            agent="terminus-2",
            environment=environment,
            trials_dir=tmp_path / environment / "trials",
            artifacts=tmp_path / environment / "out",
            max_concurrent=4,
        )
        by_env[environment] = await rewards(RelayedBackend(backend, relay), requests)
    assert by_env["skypilot"] == by_env["local"]
    assert len(by_env["local"]) == 4


class AsksTheRelay(BaseInstalledAgent):
    """An agent installed in the pod: asks the policy over plain HTTP, writes its answer."""

    @staticmethod
    def name() -> str:
        return "asks-the-relay"

    async def install(self, environment: BaseEnvironment) -> None:
        return None

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        script = (
            "import json, os, re, urllib.request\n"
            "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions',"
            " data=json.dumps({'model': 'policy', 'messages': [{'role': 'user', 'content':"
            f" {instruction!r}}}]}}).encode(), headers={{'Authorization':"
            " 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
            "text = json.load(urllib.request.urlopen(req, timeout=20))['choices'][0]['message']"
            "['content']\n"
            "open('/app/answer.txt', 'w').write(re.findall(r'-?\\d+', text)[-1] + '\\n')\n"
        )
        res = await self.exec_as_agent(environment, f"python3 -c {shlex.quote(script)}")
        assert res.return_code == 0, res.stderr


def _host_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def _reachable_address() -> tuple[str, int]:
    """An address of this host a pod could reach, and a free port on it (or a skip)."""
    host = _host_address()
    if host is None:
        pytest.skip("this host has no address a pod could reach")
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


async def test_an_agent_in_the_pod_reaches_the_relay_at_its_advertised_url(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    host, port = _reachable_address()
    requests = requests_from_dataset(DATASET)[:2]

    def backend(**kwargs: object) -> HarborBackend:
        return HarborBackend(
            tasks_dir=TEMPLATES / "arithmetic",
            agent=AsksTheRelay,
            environment="skypilot",
            trials_dir=tmp_path / "trials",
            artifacts=tmp_path / "out",
            **kwargs,  # type: ignore[arg-type]
        )

    async with (
        ScriptedPolicy() as policy,
        Relay(
            upstream_url=policy.base_url,
            host=host,
            port=port,
            advertised_url=f"http://{host}:{port}",
        ) as relay,
    ):
        # With its network blocked the pod could not reach the relay: refused, and said so.
        blocked = EnvironmentConfig(kwargs={"network": "none"})
        refused = await collect(
            RelayedBackend(backend(environment_config=blocked), relay), requests
        )
        for result in refused:
            assert result.failure is not None and result.reward is None, result
            assert "cannot reach the relay" in result.failure.message
        # The template's default network (Harbor's: public) reaches the advertised URL.
        results = await collect(RelayedBackend(backend(), relay), requests)
    for result in results:
        assert result.status is RolloutStatus.SUCCESS, result.failure
        assert result.reward == 1.0
        assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
    # The token reached the agent with its command; no create carried an env (nothing of a
    # rollout is in a pod's spec, so creates can share a batch).
    assert all(call["spec"]["env"] == {} for call in await create_calls())


def test_backends_run_tells_agents_in_pods_the_relay_url(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    """`backends run --relay-host/--relay-port/--relay-url`, through the installed script: an
    agent installed in the pod reaches the relay (without them each rollout failed with "the
    relay has no advertised_url")."""
    host, port = _reachable_address()
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:2]))
    script = Path(sys.executable).with_name("backends")
    tests = Path(__file__).parent
    env = {
        **os.environ,
        **fake_sky,
        "BACKENDS_HOME": str(tmp_path / "home"),
        "PYTHONPATH": os.pathsep.join([str(tests), str(tests / "skyfake")]),
    }
    common = ["run", "-p", str(TEMPLATES / "arithmetic"), "-d", str(rows), "-e", "skypilot"]
    common += ["-a", "test_harbor_skypilot:AsksTheRelay"]
    relay = [
        "--relay-host",
        host,
        "--relay-port",
        str(port),
        "--relay-url",
        f"http://{host}:{port}",
    ]
    proc = subprocess.run(
        [str(script), *common, "-o", str(tmp_path / "run"), *relay],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [
        json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()
    ]
    assert [r["reward"] for r in results] == [1.0, 1.0], results
    # An advertised URL without a fixed port is refused before anything runs.
    proc = subprocess.run(
        [str(script), *common, "--relay-url", f"http://{host}:9"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "--relay-port" in proc.stderr, proc.stderr
