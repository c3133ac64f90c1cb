"""SkyPilot sandboxes against the holes a review found: lifetimes, names, reaping, downloads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sky_support import fake_sky_server

from backends.harbor.phases import _trial_name
from backends.sandbox import skyruns
from backends.sandbox.contract import PROVIDERS

pytestmark = [pytest.mark.anyio]

SKY = next(p for p in PROVIDERS if p.name == "skypilot")


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


def _spy_creates(env: Any, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    create = env.sdk.create.aio

    async def spy(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs)
        return await create(*args, **kwargs)

    monkeypatch.setattr(env.sdk.create, "aio", spy)
    return sent


@pytest.mark.sandbox
async def test_each_sandbox_is_created_with_its_own_ttl(
    tmp_path: Path, fake_sky: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    short = SKY.make(tmp_path / "a", kwargs={"ttl_sec": 7})
    default = SKY.make(tmp_path / "b")
    sent = _spy_creates(short, monkeypatch)
    for env in (short, default):
        await env.start(force_build=False)
        await env.stop(delete=True)
    # The lifetime is the server's only backstop for a run recorded elsewhere: 24 h is not it.
    assert [s["timeout"] for s in sent] == [7, 6 * 3600]


def test_ids_that_sanitize_alike_get_distinct_names() -> None:
    run = skyruns.Run("0123abcd")
    for a, b in [("Row-A", "row-a"), ("a.b", "a_b"), ("q1", "Q1"), ("x" * 80 + "A", "x" * 80)]:
        na = skyruns.sandbox_name(run, f"{_trial_name(a, 1)}__env")
        nb = skyruns.sandbox_name(run, f"{_trial_name(b, 1)}__env")
        assert na != nb, (a, b, na)
        assert len(na) <= 53 and len(nb) <= 53 and na.startswith("bk-0123abcd-")
    # An id that needs no sanitizing keeps its plain name.
    assert skyruns.sandbox_name(run, "row-a-1") == "bk-0123abcd-row-a-1"
    assert skyruns.sandbox_name(run, "Row-A", retry=2) != skyruns.sandbox_name(run, "row-a", 2)
