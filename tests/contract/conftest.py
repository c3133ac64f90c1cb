"""Parametrize the contract suite over every provider we ship."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sky_support import fake_sky_server

from backends.sandbox.contract import PROVIDERS, Provider


@pytest.fixture(scope="session")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


@pytest.fixture(params=PROVIDERS, ids=lambda p: p.name)
def provider(request: pytest.FixtureRequest) -> Provider:
    p: Provider = request.param
    if p.name == "skypilot":
        request.getfixturevalue("fake_sky")
    reason = p.available()
    if reason is not None:
        pytest.fail(f"provider {p.name} cannot run on this host: {reason}")
    return p
