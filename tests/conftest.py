"""Shared test fixtures. Async tests use anyio's pytest plugin on asyncio."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
