"""A Harbor agent installed in the sandbox reaches the policy through the route HarborBackend
hands it as environment variables: the relay's socket forwarder and the rollout's token.

The agent is Harbor's own installed Strands agent (its runner, its model connection built from
its environment), with only the install step replaced by one that works offline
(``harbor_support.OfflineStrands``): the Python with strands-agents comes from the
strands-calculator example's rollout bundle, bound in read-only.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from harbor.models.trial.config import EnvironmentConfig

from backends import HarborBackend, Relay, RelayedBackend, RolloutRequest, RolloutStatus, collect
from backends.bundle import build_bundle
from backends.bundle.environment import ensure_environment
from backends.relay.scripted import ScriptedPolicy

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio, pytest.mark.timeout(1800)]

ROOT = Path(__file__).parents[1]
TEMPLATE = ROOT / "tasks" / "templates" / "workflow"
STRANDS_EXAMPLE = ROOT / "tasks" / "rollouts" / "strands-calculator"
FACTORY = Path(__file__).parent / "strands_factory"
UPSTREAM_KEY = "sk-upstream-" + uuid.uuid4().hex


async def test_an_installed_agent_gets_the_route_through_its_environment(tmp_path: Path) -> None:
    bundle = build_bundle(STRANDS_EXAMPLE, entrypoint="main.py:CalculatorWorkflow")
    environment = await ensure_environment(
        bundle,
        environment_dir=TEMPLATE / "environment",
        docker_image="debian:12",
        entrypoint="main.py:CalculatorWorkflow",
    )
    backend = HarborBackend(
        tasks_dir=TEMPLATE,
        agent="harbor_support:OfflineStrands",
        native_agent_kwargs={
            "python": str(environment.python),
            "factory_path": str(FACTORY),
            "factory": "agent:create_agent",
        },
        grader="backends.graders:ExactMatchGrader",
        environment_config=EnvironmentConfig(kwargs={"extra_binds": environment.binds()}),
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        cleanup_successful_trials=False,
    )
    request = RolloutRequest(
        rollout_id="installed",
        prompt=[{"role": "user", "content": "What is 6 * 7?"}],
        label="42",
    )
    async with (
        ScriptedPolicy() as policy,
        Relay(
            upstream_url=policy.base_url,
            upstream_api_key=UPSTREAM_KEY,
            unix_socket_path=tmp_path / "relay.sock",
        ) as relay,
    ):
        upstream_url = policy.base_url
        [result] = await collect(RelayedBackend(backend, relay), [request])
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0, result.sample
    # The agent's one model call came through the relay, on this rollout's route.
    assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
    assert result.policy_trace.calls[0].choices[0].message["content"] == "42"
    # What the agent was handed: the forwarder inside the sandbox and the rollout's token,
    # never the upstream's URL or key (Harbor writes the agent's config to the trial dir).
    trial = tmp_path / "trials" / "installed"
    written = "".join(p.read_text(errors="replace") for p in trial.rglob("*") if p.is_file())
    assert "http://127.0.0.1:18080/rollouts/installed/v1" in written
    assert UPSTREAM_KEY not in written and upstream_url not in written


def test_an_allowlist_of_the_sandboxs_own_loopback_is_no_network(tmp_path: Path) -> None:
    """Harbor allowlists an installed agent's inference host: through the relay's forwarder
    that is 127.0.0.1, inside the sandbox. Only such an allowlist is accepted (as no network)."""
    from harbor.models.task.config import NetworkMode, NetworkPolicy

    from backends.sandbox.contract import PROVIDERS

    env = PROVIDERS[0].make(tmp_path)
    for hosts in (["127.0.0.1"], ["localhost", "::1"]):
        env.validate_network_policy_support(
            NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=hosts)
        )
    with pytest.raises(ValueError, match="allowlist"):
        env.validate_network_policy_support(
            NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["127.0.0.1", "a.com"])
        )
