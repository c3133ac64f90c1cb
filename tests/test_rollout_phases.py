"""The shared rollout pipeline: phases, the error table, the lifespan, the typed route and trace."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import httpx
import pytest
from policy_support import completion, policy_server
from server_support import ScriptedWorkflow, result, serve_in_process, server, submit
from test_cli_run import run_cli

import backends
from backends import (
    ErrorCategory,
    LocalBackend,
    Phase,
    PolicyRoute,
    RolloutRequest,
    RolloutResult,
    RolloutSample,
    RolloutStatus,
    RolloutTrace,
    collect,
)
from backends.relay import Relay
from backends.relayed import RelayedBackend
from backends.rollout import (
    AgentError,
    InFlight,
    InfrastructureError,
    RolloutPhases,
    RolloutValidationError,
    Startup,
    Tracked,
    classify,
    is_retryable,
    run_phases,
)
from backends.sandbox.errors import (
    ExecTimeoutError,
    SandboxStartError,
    UnsupportedTaskError,
)

pytestmark = pytest.mark.anyio


def req(rid: str = "r1", **fields: Any) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rid, prompt=[{"role": "user", "content": "q"}], label="42", **fields
    )


# -- the error table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "phase", "category", "retryable"),
    [
        (InfrastructureError("pool exhausted"), Phase.AGENT, ErrorCategory.INFRA_ERROR, True),
        (SandboxStartError("no cgroup"), Phase.SETUP, ErrorCategory.INFRA_ERROR, True),
        (UnsupportedTaskError("gpus"), Phase.SETUP, ErrorCategory.VALIDATION_ERROR, False),
        (ExecTimeoutError("slow"), Phase.AGENT, ErrorCategory.TIMEOUT, False),
        (TimeoutError(), Phase.AGENT, ErrorCategory.TIMEOUT, False),
        (AgentError("gave up"), Phase.AGENT, ErrorCategory.AGENT_ERROR, False),
        (RolloutValidationError("bad"), Phase.SETUP, ErrorCategory.VALIDATION_ERROR, False),
        # Unlisted exceptions take their phase's own category.
        (RuntimeError("x"), Phase.SETUP, ErrorCategory.INFRA_ERROR, True),
        (RuntimeError("x"), Phase.AGENT, ErrorCategory.AGENT_ERROR, False),
        (RuntimeError("x"), Phase.GRADING, ErrorCategory.VERIFIER_ERROR, False),
    ],
)
def test_one_table_gives_category_and_retryable(
    exc: BaseException, phase: Phase, category: ErrorCategory, retryable: bool
) -> None:
    failure = classify(exc, phase)
    assert failure.category is category and failure.phase is phase
    assert failure.retryable is retryable


def test_a_users_subclass_inherits_its_parents_category() -> None:
    class PoolGone(InfrastructureError):
        pass

    assert PoolGone().category is ErrorCategory.INFRA_ERROR and PoolGone().retryable
    assert is_retryable(PoolGone()) and not is_retryable(ValueError())


def test_openai_connection_errors_are_policy_errors() -> None:
    import openai

    request = httpx.Request("POST", "http://policy/v1/chat/completions")
    failure = classify(openai.APIConnectionError(request=request), Phase.AGENT)
    assert failure.category is ErrorCategory.POLICY_ERROR and not failure.retryable


def test_exception_class_names_are_unique_across_the_package() -> None:
    # Harbor records a trial's exception by class name only: two classes of one name would be
    # indistinguishable in its results.
    seen: dict[str, str] = {}
    for info in pkgutil.walk_packages(backends.__path__, "backends."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                if obj.__module__ != info.name:
                    continue  # imported, not defined here
                where = f"{obj.__module__}.{obj.__qualname__}"
                assert seen.setdefault(name, where) == where, f"{name}: {seen[name]} and {where}"


# -- the phases driver -------------------------------------------------------------------------


class Recorder(RolloutPhases):
    """Phases that record what ran and fail where the request's metadata says."""

    calls: list[str]

    def __init__(self, request: RolloutRequest, tracked: Tracked) -> None:
        super().__init__(request, tracked)
        self.calls = []
        self.fail = (request.metadata or {}).get("fail")

    def admit(self) -> None:
        self.calls.append("admit")
        if self.fail == "admit":
            raise RolloutValidationError("no such task")

    async def provision(self) -> None:
        self.calls.append("provision")
        if self.fail == "provision":
            raise RuntimeError("the sandbox would not boot")
        if self.fail == "hang_provision":
            await anyio.sleep_forever()

    async def run_agent(self) -> RolloutSample:
        self.calls.append("agent")
        if self.fail == "agent":
            raise RuntimeError("agent crashed")
        if self.fail == "hang_agent":
            await anyio.sleep_forever()
        return RolloutSample(messages=[{"role": "assistant", "content": "42"}])

    async def grade(self, sample: RolloutSample) -> None:
        self.calls.append("grade")
        if self.fail != "no_reward":
            sample.reward = 1.0

    async def finalize(self) -> None:
        await anyio.sleep(0.01)  # a cancelled rollout still gets here: it is shielded
        self.calls.append("finalize")


async def drive(request: RolloutRequest) -> tuple[RolloutResult, list[str]]:
    made: list[Recorder] = []

    async def body(tracked: Tracked) -> RolloutResult:
        made.append(Recorder(request, tracked))
        return await run_phases(made[0])

    result = await InFlight().run(request, body)
    return result, made[0].calls


@pytest.mark.parametrize(
    ("fail", "category", "phase", "calls"),
    [
        (None, None, None, ["admit", "provision", "agent", "grade", "finalize"]),
        ("admit", ErrorCategory.VALIDATION_ERROR, Phase.SETUP, ["admit"]),
        ("provision", ErrorCategory.INFRA_ERROR, Phase.SETUP, ["admit", "provision", "finalize"]),
        (
            "agent",
            ErrorCategory.AGENT_ERROR,
            Phase.AGENT,
            ["admit", "provision", "agent", "finalize"],
        ),
        (
            "no_reward",
            ErrorCategory.VERIFIER_ERROR,
            Phase.GRADING,
            ["admit", "provision", "agent", "grade", "finalize"],
        ),
    ],
)
async def test_phases_run_in_order_and_each_failure_names_its_phase(
    fail: str | None, category: ErrorCategory | None, phase: Phase | None, calls: list[str]
) -> None:
    result, ran = await drive(req(metadata={"fail": fail}))
    assert ran == calls
    if category is None:
        assert result.status is RolloutStatus.SUCCESS and result.reward == 1.0
        assert {"queued_sec", "setup_sec", "agent_sec", "grader_sec"} <= set(result.timings)
    else:
        assert result.failure is not None and result.reward is None
        assert (result.failure.category, result.failure.phase) == (category, phase)
        # Only the infrastructure fault may be retried with a fresh attempt.
        assert result.failure.retryable is (category is ErrorCategory.INFRA_ERROR)


async def test_grading_is_skipped_when_not_asked() -> None:
    result, ran = await drive(req(grade=False))
    assert result.status is RolloutStatus.SUCCESS and "grade" not in ran


@pytest.mark.parametrize("fail", ["hang_provision", "hang_agent"])
async def test_a_deadline_in_provision_or_agent_is_a_timeout_and_still_finalizes(
    fail: str,
) -> None:
    result, ran = await drive(req(metadata={"fail": fail}, agent_timeout_sec=0.2))
    assert result.failure is not None and result.failure.category is ErrorCategory.TIMEOUT
    assert ran[-1] == "finalize"


async def test_cancel_during_provision_is_cancelled_and_still_finalizes() -> None:
    inflight = InFlight()
    made: list[Recorder] = []

    async def body(tracked: Tracked) -> RolloutResult:
        made.append(Recorder(request, tracked))
        return await run_phases(made[0])

    request = req(metadata={"fail": "hang_provision"})
    async with anyio.create_task_group() as tg:
        results: list[RolloutResult] = []

        async def run() -> None:
            results.append(await inflight.run(request, body))

        tg.start_soon(run)
        with anyio.fail_after(5):
            while not made or "provision" not in made[0].calls:
                await anyio.sleep(0.01)
        assert inflight.status("r1") is RolloutStatus.RUNNING
        inflight.cancel(["r1"])
    assert results[0].status is RolloutStatus.CANCELLED
    assert made[0].calls[-1] == "finalize"


# -- the lifespan ------------------------------------------------------------------------------


class Warming(LocalBackend):
    """A LocalBackend that counts its warm-ups and refuses rollouts before the first one."""

    def __init__(self, fail: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("workflow", ScriptedWorkflow)
        kwargs.setdefault("grader", "server_support:ExactGrader")
        super().__init__(**kwargs)
        self.starts = 0
        self.fail = fail
        self.start = Startup(self._warm_up)  # type: ignore[method-assign]

    async def _warm_up(self) -> None:
        await anyio.sleep(0.05)  # concurrent callers must wait, not warm up twice
        self.starts += 1
        if self.fail:
            raise RuntimeError("image layers are missing")

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        assert self.start.done, "a rollout ran before the backend was started"
        return await super().execute(request)


async def test_run_batch_starts_the_backend_once_before_the_first_rollout(tmp_path: Path) -> None:
    backend = Warming(artifacts_root=tmp_path)
    relayed_twice = [req(f"r{i}") for i in range(3)]
    results = await collect(backend, relayed_twice)
    assert [r.status for r in results] == [RolloutStatus.SUCCESS] * 3
    await collect(backend, [req("again")])
    assert backend.starts == 1


async def test_concurrent_starts_warm_up_once(tmp_path: Path) -> None:
    backend = Warming(artifacts_root=tmp_path)
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(backend.start)
    assert backend.starts == 1


async def test_a_failed_start_fails_the_batch_before_any_rollout(tmp_path: Path) -> None:
    backend = Warming(fail=True, artifacts_root=tmp_path)
    with pytest.raises(RuntimeError, match="image layers"):
        await collect(backend, [req()])
    assert backend.starts == 1 and backend.health()["in_flight"] == 0


async def test_the_server_starts_the_backend_before_admitting_rollouts(tmp_path: Path) -> None:
    backend = Warming(artifacts_root=tmp_path / "rollouts")
    async with serve_in_process(server(tmp_path, backend)) as url:
        assert backend.starts == 1
        async with httpx.AsyncClient(base_url=url) as http:
            data = await result(http, "s1", await submit(http, "s1"))
    assert data["status"] == "success"


async def test_a_backend_that_cannot_start_fails_the_server_startup(tmp_path: Path) -> None:
    app = server(tmp_path, Warming(fail=True, artifacts_root=tmp_path / "rollouts"))
    sent: list[dict[str, Any]] = []
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(10):
        await app({"type": "lifespan"}, receive, send)
    assert sent[0]["type"] == "lifespan.startup.failed"
    assert "image layers are missing" in sent[0]["message"]


def test_backends_run_starts_the_backend(tmp_path: Path) -> None:
    main = tmp_path / "main.py"
    main.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_rollout_phases import Warming\n"
        "backend = Warming(workflow='tasks/rollouts/arithmetic/main.py:ArithmeticWorkflow',\n"
        "                  grader='tasks/rollouts/arithmetic/main.py:ExactAnswerGrader')\n"
    )
    proc = run_cli("run", f"{main}:backend", home=tmp_path)
    # Warming.execute refuses to run before start: every rollout succeeding shows it was called.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["mean_reward"] == 1.0 and not summary["failures"]


# -- the typed route and trace -----------------------------------------------------------------


class Recording:
    """An inner backend that records the request it was handed and answers success."""

    def __init__(self) -> None:
        self.seen: list[RolloutRequest] = []

    async def start(self) -> None:
        pass

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        self.seen.append(request)
        # Call the policy the way an agent in a sandbox would: through the relay's socket.
        route = request.policy_route
        assert route is not None and route.relay_socket is not None
        connector = aiohttp.UnixConnector(path=str(route.relay_socket))
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.post(
                f"http://relay{route.relay_path}/chat/completions",
                headers={"Authorization": f"Bearer {route.api_key}"},
                json={"model": "policy", "messages": [{"role": "user", "content": "q"}]},
            ) as response:
                assert response.status == 200, await response.text()
        sample = RolloutSample(messages=[{"role": "assistant", "content": "42"}], reward=1.0)
        return RolloutResult(rollout_id=request.rollout_id, status="success", sample=sample)

    def status(self, rollout_id: str) -> None:
        return None

    def has_capacity(self) -> bool:
        return True

    def cancel(self, ids: Any = None, prefix: Any = None, all: bool = False) -> dict[str, Any]:
        return {}

    def health(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        pass


UPSTREAM_KEY = "sk-upstream-0123456789abcdef"


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    async with policy_server(lambda body, auth: (200, completion(body, "42"))) as url:
        yield url


async def test_the_backend_gets_a_typed_route_and_the_result_a_typed_trace(
    upstream: str, tmp_path: Path
) -> None:
    inner = Recording()
    socket_path = tmp_path / "relay.sock"
    async with Relay(
        unix_socket_path=socket_path, advertised_url="https://relay.example:8443/"
    ) as relay:
        request = req(chat_completions_url=upstream, api_key=UPSTREAM_KEY)
        outcome = await RelayedBackend(inner, relay).execute(request)
        relay_url = relay.base_url
    (seen,) = inner.seen
    route = seen.policy_route
    assert route is not None and route.relayed and route.relay_socket == socket_path
    assert route.base_url == f"{relay_url}/rollouts/r1/v1" == seen.chat_completions_url
    assert route.api_key == seen.api_key and UPSTREAM_KEY not in seen.model_dump_json()
    assert route.sandbox_base_url(18080) == "http://127.0.0.1:18080/rollouts/r1/v1"
    assert route.sandbox_base_url() == "https://relay.example:8443/rollouts/r1/v1"
    env = route.environment(route.sandbox_base_url(18080))
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == route.api_key
    # Anthropic clients (Claude Code) reach the same route's /v1/messages.
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:18080/rollouts/r1"
    # The route never leaves the process: not in the request's JSON, not in its repr.
    assert "policy_route" not in seen.model_dump_json() and "policy_route" not in repr(seen)
    assert route.api_key not in repr(route)
    trace = outcome.policy_trace
    assert isinstance(trace, RolloutTrace)
    assert [call.upstream_status for call in trace.calls] == [200]


def test_a_direct_route_never_reaches_into_a_sandbox() -> None:
    # Without a relay the route holds the trainer's own key: a sandbox must never get it.
    route = PolicyRoute.of(req(chat_completions_url="http://gpu:8000/v1", api_key=UPSTREAM_KEY))
    assert not route.relayed and route.api_key == UPSTREAM_KEY
    with pytest.raises(RolloutValidationError, match="no relay route"):
        route.sandbox_base_url(18080)
    with pytest.raises(RolloutValidationError, match="no relay route"):
        route.sandbox_base_url()


def test_a_relay_route_without_socket_or_advertised_url_is_refused() -> None:
    route = PolicyRoute(
        rollout_id="r", base_url="http://h/rollouts/r/v1", relay_path="/rollouts/r/v1"
    )
    with pytest.raises(RolloutValidationError, match="Unix socket"):
        route.sandbox_base_url(18080)
    with pytest.raises(RolloutValidationError, match="advertised_url"):
        route.sandbox_base_url()


def test_the_trace_keeps_its_json_place_and_round_trips() -> None:
    trace = RolloutTrace(rollout_id="r", registered_at=1.0)
    result = RolloutResult(
        rollout_id="r", status="success", extra_fields={"k": 1}, policy_trace=trace
    )
    data = json.loads(result.model_dump_json())
    assert data["extra_fields"] == {"k": 1, "policy_trace": trace.model_dump(mode="json")}
    assert "policy_trace" not in data
    again = RolloutResult.model_validate(data)
    assert again.policy_trace == trace and again.extra_fields == {"k": 1}
    assert RolloutResult(rollout_id="r", status="success").model_dump()["extra_fields"] == {}


class OpensAClient(ScriptedWorkflow):
    """Registers a closer on its rollout context, then fails or hangs as the metadata says."""

    closed: list[str] = []

    async def run(self, ctx: Any) -> Any:
        rollout = backends.get_rollout_context()
        assert rollout is not None

        async def close() -> None:
            await anyio.sleep(0.01)  # shielded: a cancelled rollout still gets here
            OpensAClient.closed.append(str(rollout.rollout_id))

        rollout.call_on_close(close)
        return await super().run(ctx)


@pytest.mark.parametrize("meta", [{}, {"fail": True}, {"sleep": 30}])
async def test_what_a_workflow_opened_is_closed_however_it_ends(
    meta: dict[str, Any], tmp_path: Path
) -> None:
    OpensAClient.closed.clear()
    backend = LocalBackend(workflow=OpensAClient, artifacts_root=tmp_path)
    result = await backend.execute(req(metadata=meta, grade=False, agent_timeout_sec=0.3))
    assert OpensAClient.closed == ["r1"], result


class HangsOnClose(ScriptedWorkflow):
    async def run(self, ctx: Any) -> Any:
        rollout = backends.get_rollout_context()
        assert rollout is not None
        rollout.call_on_close(anyio.sleep_forever)
        return await super().run(ctx)


async def test_a_hung_close_cannot_hold_the_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("backends.rollout.user_code.CLOSE_TIMEOUT_SEC", 0.2)
    backend = LocalBackend(workflow=HangsOnClose, artifacts_root=tmp_path)
    with anyio.fail_after(5):
        result = await backend.execute(req(grade=False))
    assert result.status is RolloutStatus.SUCCESS
