"""ATIF conversion, redaction and previews; and the server saving trajectories and previews."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from harbor.models.trajectories import Metrics
from harbor.utils.trajectory_validator import TrajectoryValidator
from server_support import make_backend, rollout_body, serve_in_process

from backends.rollout.artifacts import make_artifacts_dir
from backends.rollout.request import RolloutResult, RolloutStatus
from backends.rollout.sample import RolloutSample
from backends.server import LEASE_HEADER, create_rollout_server
from backends.trajectory import (
    Redactor,
    TrajectoryWriter,
    build_preview,
    save_trajectory,
    to_trajectory,
)
from backends.trajectory.preview import MAX_PREVIEW_BYTES, MAX_STRING_CHARS

KEY = "sk-test-key-0123456789abcdef"

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
    {
        "role": "assistant",
        "content": None,
        "model": "policy-7b",
        "reasoning_content": "I should call ls.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "ls"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "sh", "arguments": "not json"}},
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}},
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "a.txt\nb.txt"},
    {"role": "tool", "tool_call_id": "call_b", "content": "error"},
    {"role": "assistant", "content": "a.txt and b.txt"},
]  # fmt: skip


def validate_with_harbor_cli(path: Path) -> None:
    check = subprocess.run(
        [sys.executable, "-m", "harbor.utils.trajectory_validator", str(path)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


def valid(doc: dict[str, Any]) -> None:
    validator = TrajectoryValidator()
    assert validator.validate(doc), validator.get_errors()


def test_chat_converts_to_valid_atif_with_tool_calls_and_observations() -> None:
    trajectory = to_trajectory(CHAT, session_id="r1")
    doc = trajectory.to_json_dict()
    valid(doc)
    sources = [s["source"] for s in doc["steps"]]
    assert sources == ["system", "user", "agent", "agent"]
    call = doc["steps"][2]
    assert call["model_name"] == "policy-7b"
    assert call["reasoning_content"] == "I should call ls."
    assert [t["arguments"] for t in call["tool_calls"]] == [{"cmd": "ls"}, {"_raw": "not json"}]
    results = call["observation"]["results"]
    assert [(r["source_call_id"], r["content"]) for r in results] == [
        ("call_a", "a.txt\nb.txt"),
        ("call_b", "error"),
    ]
    assert call["metrics"] == {"prompt_tokens": 12, "completion_tokens": 5, "cached_tokens": 4}
    assert doc["final_metrics"]["total_prompt_tokens"] == 12
    assert doc["final_metrics"]["total_steps"] == 4


def test_missing_usage_stays_missing() -> None:
    doc = to_trajectory(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ).to_json_dict()
    assert "metrics" not in doc["steps"][1]
    assert "timestamp" not in doc["steps"][1]
    assert doc["final_metrics"] == {"total_steps": 2}
    assert "model_name" not in doc["agent"]


def test_agent_step_metrics_attach_token_ids_to_the_nth_agent_step() -> None:
    extra = [None, Metrics(completion_token_ids=[5, 6], logprobs=[-0.1, -0.2])]
    doc = to_trajectory(CHAT, agent_step_metrics=extra).to_json_dict()
    valid(doc)
    assert doc["steps"][2]["metrics"]["prompt_tokens"] == 12
    assert doc["steps"][3]["metrics"] == {"completion_token_ids": [5, 6], "logprobs": [-0.1, -0.2]}


def test_odd_roles_are_kept_not_dropped() -> None:
    doc = to_trajectory(
        [
            {"role": "tool", "tool_call_id": "x", "content": "orphan"},
            {"role": "critic", "content": "hmm", "name": "judge"},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [{"id": "c", "function": {"name": "f"}}],
            },
            {"role": "tool", "tool_call_id": "unknown", "content": "stray"},
        ]
    ).to_json_dict()
    valid(doc)
    assert doc["steps"][0]["source"] == "system"
    assert doc["steps"][0]["extra"]["original_role"] == "tool"
    assert doc["steps"][1]["source"] == "user"
    assert doc["steps"][1]["extra"] == {"name": "judge", "original_role": "critic"}
    stray = doc["steps"][2]["observation"]["results"][0]
    assert "source_call_id" not in stray and stray["extra"]["tool_call_id"] == "unknown"


def test_redactor_scrubs_credentials_but_not_token_counts() -> None:
    r = Redactor([KEY])
    text = (
        f"key {KEY}; Authorization: Bearer abc.def-123456; Basic dXNlcjpwYXNz; "
        'https://alice:pw123@example.invalid/x; api_key=zzz123; {"password": "p4ss"}; '
        "ghp_0123456789abcdefghijklmnop"
    )
    out = r.text(text)
    for secret in [
        KEY,
        "abc.def-123456",
        "dXNlcjpwYXNz",
        "alice",
        "pw123",
        "zzz123",
        "p4ss",
        "ghp_0123",
    ]:
        assert secret not in out, (secret, out)
    value = r.value(
        {
            "api_key": "x",
            "headers": {"Authorization": "Bearer q"},
            "prompt_tokens": 7,
            "token_ids": [1],
        }
    )
    assert value == {
        "api_key": "[REDACTED]",
        "headers": {"Authorization": "[REDACTED]"},
        "prompt_tokens": 7,
        "token_ids": [1],
    }
    assert Redactor(["short"]).text("short words stay") == "short words stay"


def test_redactor_keeps_the_sampled_token_of_a_logprobs_entry() -> None:
    entry = {"token": "hello", "logprob": -0.1, "bytes": [104]}
    assert Redactor().value({"content": [entry]}) == {"content": [entry]}
    assert Redactor().value({"token": "hunter2hunter2"}) == {"token": "[REDACTED]"}


def test_saved_trajectory_scrubs_known_key_shapes_not_just_given_secrets(tmp_path: Path) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "tool", "content": "OPENAI_API_KEY=sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX1234"},
        {"role": "tool", "content": f"Authorization: Bearer abcdefghijklmnop; key {KEY}"},
        {"role": "assistant", "content": "done"},
    ]
    sample = RolloutSample(messages=messages, trajectory_messages=messages)
    result = RolloutResult(rollout_id="s1", status=RolloutStatus.SUCCESS, sample=sample)
    path = save_trajectory(tmp_path, result, secrets=[KEY])
    assert path is not None
    text = path.read_text()
    for secret in ["sk-proj-", "abcdefghijklmnop", KEY]:
        assert secret not in text
    valid(json.loads(text))


def test_a_rerun_without_a_sample_removes_the_old_trajectory(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}]
    sample = RolloutSample(messages=messages, trajectory_messages=messages)
    ok = RolloutResult(rollout_id="s1", status=RolloutStatus.SUCCESS, sample=sample)
    path = save_trajectory(tmp_path, ok)
    assert path is not None and path.exists()
    failed = RolloutResult(rollout_id="s1", status=RolloutStatus.FAILURE)
    assert save_trajectory(tmp_path, failed) is None
    assert not path.exists()


def test_artifacts_dir_starts_empty_on_a_rerun(tmp_path: Path) -> None:
    first = make_artifacts_dir(tmp_path, "r1")
    assert first is not None
    (first / "old.txt").write_text("previous run")
    (first.parent / "trajectory.json").write_text("{}")
    again = make_artifacts_dir(tmp_path, "r1")
    assert again == first and list(again.iterdir()) == []
    assert not (first.parent / "trajectory.json").exists()


def test_preview_keeps_the_latest_100_steps_redacted_and_bounded() -> None:
    messages = [{"role": "user", "content": "start"}]
    for i in range(150):
        messages.append({"role": "assistant", "content": f"step {i}, my key is {KEY}"})
    doc = build_preview(messages, rollout_id="p1", secrets=[KEY], status="running")
    assert doc is not None
    valid(doc)
    assert len(doc["steps"]) == 100
    assert [s["step_id"] for s in doc["steps"]] == list(range(1, 101))
    assert doc["steps"][-1]["extra"]["original_step_id"] == 151
    assert doc["extra"]["backends"]["truncated"] is True
    assert KEY not in json.dumps(doc)

    huge = [{"role": "user", "content": "x" * 200_000} for _ in range(100)]
    big = build_preview(huge, rollout_id="p2")
    assert big is not None
    size = len(json.dumps(big))
    assert size <= MAX_PREVIEW_BYTES
    assert 40 < len(big["steps"]) < 100  # clipped strings, oldest steps dropped to fit
    assert len(big["steps"][0]["message"]) < MAX_STRING_CHARS + 100


def test_preview_drops_token_ids() -> None:
    doc = build_preview(CHAT, rollout_id="p3")
    assert doc is not None
    assert "completion_token_ids" not in json.dumps(doc)


# -- the server saves them -------------------------------------------------------------------


async def _run(http: httpx.AsyncClient, rid: str, **extra: Any) -> dict[str, Any]:
    response = await http.post("/rollout", json=rollout_body(rid, **extra))
    assert response.status_code == 202, response.text
    lease = response.json()["polling_lease_token"]
    got = await http.get(f"/rollout/{rid}/result", headers={LEASE_HEADER: lease})
    return dict(got.json())


@pytest.mark.anyio
async def test_server_saves_a_valid_trajectory_beside_the_artifacts(tmp_path: Path) -> None:
    root = tmp_path / "rollouts"
    backend = make_backend(artifacts_root=root)
    app = create_rollout_server(backend=backend, state_file=tmp_path / "s.db", artifacts_root=root)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as http:
        data = await _run(http, "saved", metadata={"reply": f"42 (key {KEY})"})
        skipped = await _run(http, "skipped", metadata={"no_trajectory": True})
        failed = await _run(http, "failed", metadata={"fail": True})
    assert data["status"] == "success" and data["sample"]["reward"] == 0.0  # reply is not "42"
    path = root / "saved" / "trajectory.json"
    assert (root / "saved" / "artifacts").is_dir()
    validate_with_harbor_cli(path)
    doc = json.loads(path.read_text())
    assert doc["session_id"] == "saved"
    assert doc["extra"]["backends"]["reward"] == 0.0
    assert KEY not in path.read_text()
    assert skipped["status"] == "success"
    assert not (root / "skipped" / "trajectory.json").exists()
    assert failed["status"] == "failure"
    assert not (root / "failed" / "trajectory.json").exists()


@pytest.mark.anyio
async def test_trajectory_writer_saves_in_the_background_and_waits_past_its_bound(
    tmp_path: Path,
) -> None:
    def result(rid: str) -> RolloutResult:
        messages = [
            {"role": "user", "content": f"hi {KEY}"},
            {"role": "assistant", "content": "42"},
        ]
        sample = RolloutSample(messages=messages, trajectory_messages=messages)
        return RolloutResult(rollout_id=rid, status=RolloutStatus.SUCCESS, sample=sample)

    writer = TrajectoryWriter(tmp_path, max_pending=2)
    writer.start()
    assert not await writer.submit(RolloutResult(rollout_id="none", status=RolloutStatus.SUCCESS))
    # A burst far past the bound: submitters wait for the writer, and nothing is lost.
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(lambda rid=f"r{i}": writer.submit(result(rid), secrets=[KEY]))
    await anyio.to_thread.run_sync(writer.close, 30)
    assert writer.saved == 40
    saved = (tmp_path / "r0" / "trajectory.json").read_text()
    assert json.loads(saved)["session_id"] == "r0" and KEY not in saved
    assert all((tmp_path / f"r{i}" / "trajectory.json").is_file() for i in range(40))
    assert not (tmp_path / "none").exists()


@pytest.mark.anyio
async def test_live_previews_are_published_redacted_and_honour_opt_out(tmp_path: Path) -> None:
    previews = tmp_path / "previews"
    app = create_rollout_server(
        backend=make_backend(),
        state_file=tmp_path / "s.db",
        artifacts_root=None,
        preview_root=previews,
        preview_interval_sec=0.2,
    )
    planted = [{"role": "user", "content": f"use {KEY} and Authorization: Bearer zzzzzzzz"}]
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as http:
        async with anyio.create_task_group() as tg:
            results: dict[str, dict[str, Any]] = {}

            async def run(rid: str, meta: dict[str, Any]) -> None:
                results[rid] = await _run(http, rid, initial_messages=planted, metadata=meta)

            tg.start_soon(run, "live", {"stream": 5, "sleep": 1.0})
            tg.start_soon(run, "private", {"stream": 5, "sleep": 1.0, "no_preview": True})
    assert results["live"]["status"] == "success"
    preview = previews / "live" / "preview.json"
    assert preview.exists()
    text = preview.read_text()
    assert KEY not in text and "zzzzzzzz" not in text
    doc = json.loads(text)
    valid(doc)
    assert doc["extra"]["backends"]["preview"] is True
    assert len(doc["steps"]) == 6
    assert not (previews / "private").exists()
