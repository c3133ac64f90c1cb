"""Parametrize the contract suite over every provider we ship."""

from __future__ import annotations

import pytest

from backends.sandbox.contract import PROVIDERS, Provider


@pytest.fixture(params=PROVIDERS, ids=lambda p: p.name)
def provider(request: pytest.FixtureRequest) -> Provider:
    p: Provider = request.param
    reason = p.available()
    if reason is not None:
        pytest.fail(f"provider {p.name} cannot run on this host: {reason}")
    return p
