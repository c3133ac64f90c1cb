"""Warm runners: a workflow's entrypoint imported once, each rollout forked from it.

A bundled rollout run cold spends most of its time in a fresh interpreter's imports (`openai`
alone takes 1-4 s here). ``WarmRunner`` keeps fork servers (``backends.sandbox.forkserver``)
for one ``WorkflowPlan``: the environment's Python with the runner's modules and the
workflow's entrypoint imported, one per uid range its trials' sandboxes run as, all in one
no-network host sandbox of the task's image (with the environment bound, as in a trial).
``BundleAgent`` runs ``runner run`` through them; each rollout is forked into its own trial's
sandbox, reads its input there, and nothing of it stays in the server. Whenever they cannot
serve, the rollout runs cold.

A runner nobody closes (its HarborBackend dropped without ``aclose()``) ends its servers and
host sandbox when it is collected, rather than when the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from backends.bundle.environment import Environment
from backends.sandbox.forkserver import ForkServers

if TYPE_CHECKING:
    from backends.sandbox.local import LocalSandbox

log = logging.getLogger(__name__)

PRELOAD = "backends.bundle.preload:preload"


class WarmRunner:
    """The fork servers of one plan's environment, started on the first rollout that asks."""

    def __init__(
        self,
        environment: Environment,
        *,
        entrypoint: str,
        workflow_config: str | None,
        image_dir: Path,
        docker_image: str | None,
        name: str,
    ) -> None:
        self.environment = environment
        self.entrypoint = entrypoint
        self.workflow_config = workflow_config
        self.image_dir = image_dir
        self.docker_image = docker_image
        self.name = name
        self._lock = anyio.Lock()
        self._host: LocalSandbox | None = None  # the sandbox holding the servers
        self._scratch: Path | None = None
        self._servers: ForkServers | None = None
        self._failed = False
        self._closed = False
        self._finalizer: weakref.finalize[..., WarmRunner] | None = None

    async def servers(self) -> ForkServers | None:
        """The fork servers, their host sandbox started on first use; None: run cold."""
        async with self._lock:
            if self._servers is None and not (self._failed or self._closed):
                try:
                    await self._start()
                except Exception as e:  # never the rollout's failure: it runs cold
                    log.warning("%s: no fork server, rollouts run cold: %s", self.name, e)
                    self._failed = True
                    await self._stop()
            return self._servers

    async def _start(self) -> None:
        from harbor.models.task.config import EnvironmentConfig
        from harbor.models.trial.paths import TrialPaths

        from backends.sandbox.local import LocalSandbox

        self._scratch = Path(tempfile.mkdtemp(prefix="fork-server-"))
        trial_paths = TrialPaths(trial_dir=self._scratch)
        trial_paths.mkdir()
        host = LocalSandbox(
            environment_dir=self.image_dir,
            environment_name="fork-server",
            session_id=self.name,
            trial_paths=trial_paths,
            task_env_config=EnvironmentConfig(docker_image=self.docker_image),
            network="none",
            extra_binds=self.environment.binds(),  # the environment and its Python
        )
        self._host = host
        await host.start(force_build=False)
        await open_paths(host, [Path(b["target"]) for b in self.environment.binds()])
        project = str(self.environment.bundle.project_dir)
        self._servers = ForkServers(
            host.sandbox,
            python=str(self.environment.python),
            cwd=project,
            preload=(PRELOAD, [project, self.entrypoint, self.workflow_config]),
        )
        self._finalizer = weakref.finalize(
            self, _stop_unclosed, asyncio.get_running_loop(), self._servers, host, self._scratch
        )

    async def aclose(self) -> None:
        """End every server and their host sandbox; later rollouts run cold."""
        with anyio.CancelScope(shield=True):
            async with self._lock:
                self._closed = True
                await self._stop()

    async def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        servers, self._servers = self._servers, None
        if servers is not None:
            servers.close()
        host, self._host = self._host, None
        if host is not None:
            await host.stop(delete=True)  # its cgroup's kill ends every server in it
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _stop_unclosed(
    loop: asyncio.AbstractEventLoop, servers: ForkServers, host: LocalSandbox, scratch: Path
) -> None:
    """``_stop()`` for a runner collected unclosed. A finalizer cannot await and may run in
    any thread, inside any code: the kills go to the runner's loop as a callback of their own
    (or run here when that loop is not running); the waiting and removals to the cleanup thread."""

    def stop() -> None:
        servers.close()
        host.sandbox.stop_nowait(then=lambda: shutil.rmtree(scratch, ignore_errors=True))

    if not loop.is_running():  # closed, or stopped (perhaps for good): nothing of it runs now
        stop()
        return
    try:
        loop.call_soon_threadsafe(stop)
    except RuntimeError:  # closed meanwhile
        stop()


async def open_paths(host: LocalSandbox, paths: list[Path]) -> None:
    """Let everyone traverse the image's directories above `paths` in the host sandbox: the
    servers run as a host uid that is not its root (e.g. the image's /root is 0700)."""
    above = sorted({str(p) for path in paths for p in path.parents if str(p) != "/"})
    script = f"chmod o+x -- {shlex.join(above)} 2>/dev/null; exit 0"
    await host.exec(script, user="root")
