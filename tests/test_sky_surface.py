"""The fake SkyPilot Sandbox SDK keeps the documented surface; drift fails here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

FAKE = Path(__file__).parent / "skyfake"
RECORDED = Path(__file__).parent / "data" / "sky_sandbox_surface.json"
sys.path.insert(0, str(FAKE))

import sky_sandbox  # noqa: E402
from surface import surface  # noqa: E402


def test_fake_matches_the_recorded_documented_surface() -> None:
    recorded = json.loads(RECORDED.read_text())
    recorded.pop("provenance")
    assert surface(sky_sandbox) == recorded


def test_a_changed_signature_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    async def create(name: str | None = None, *, template: str | None = None) -> None: ...

    monkeypatch.setattr(sky_sandbox, "create", sky_sandbox.entry_point(create))
    recorded = json.loads(RECORDED.read_text())
    assert surface(sky_sandbox)["module"]["create"] != recorded["module"]["create"]


def test_sync_calls_are_refused_inside_an_event_loop() -> None:
    import asyncio

    async def misuse() -> None:
        sky_sandbox.ls()

    with pytest.raises(sky_sandbox.BlockingCallError, match=r"ls\.aio"):
        asyncio.run(misuse())
