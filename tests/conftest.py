"""Shared test fixtures. Async tests use anyio's pytest plugin on asyncio."""

from collections.abc import Iterator

import pytest
from host_support import running_sandboxes

from backends.sandbox import cgroups


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", autouse=True)
def no_sandbox_outlives_its_module() -> Iterator[None]:
    """Every sandbox a test module starts is stopped by the module's end.

    One left running (a backend never closed, say) holds its uid range and processes until
    the test process exits, and later tests of the run see them (CI once found range 0 held).
    """
    before = set(running_sandboxes())
    yield
    leaked = [name for name in running_sandboxes() if name not in before]
    for name in leaked:  # so that the next module starts clean
        cgroups.SandboxCgroup(name).kill()
    assert not leaked, f"sandboxes still running after the module's tests: {leaked}"
