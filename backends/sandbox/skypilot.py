"""SkyPilot sandboxes (``sky.sandbox``, one Kubernetes pod each) as a Harbor environment.

``SkyPilotSandbox`` extends Harbor 0.25's own ``SkypilotEnvironment`` (task validation, image
reference, pool and ad-hoc create arguments, the ``su`` wrapping of users, handle draining)
where it needs more:

- the SDK is found lazily, as ``sky.sandbox`` or the Platform SDK's ``sky_sandbox`` shim, with
  an error naming what to install (``backends.sandbox.skysdk``); PyPI ``skypilot`` is never
  needed;
- names carry this run's prefix (``backends.sandbox.skyruns``) so a reaper finds a crashed
  run's sandboxes, and every sandbox a lifetime (``ttl_sec``);
- identical creates arriving together are made in one ``num_sandboxes`` call
  (``backends.sandbox.skybatch``); creation is bounded (``max_concurrent_creates`` calls),
  jittered, and retried with backoff on transient failures, each attempt under a fresh name;
  a command is never retried;
- exec has a client-side deadline past the server's cap, and a command that times out or whose
  caller is cancelled has its processes killed, daemons included; both exec result shapes the
  SDK has had (a process handle, an older dict) are read;
- file transfer goes through tar with the local provider's checks: paths that escape the
  sandbox are refused, downloads are unpacked by the hardened unpacker and bounded in size;
- Dockerfile tasks are built with ``docker``, ``podman`` or ``buildah`` (the first found),
  pushed to ``registry`` under Harbor's content-addressed tag, and not rebuilt when it exists;
- an agent that must reach the relay from the pod gets its advertised URL (``relay_url``); a
  sandbox with blocked network cannot, and is refused at creation.
"""

from __future__ import annotations

import asyncio
import binascii
import inspect
import io
import logging
import math
import os
import shlex
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO, TypeVar, cast

import anyio
from harbor.environments import skypilot as harbor_skypilot
from harbor.environments.base import ExecResult
from harbor.environments.definition import effective_exec_cwd
from harbor.models.task.config import NetworkMode

from backends.sandbox import skybatch, skylive, skyruns, skysdk, transfer, unpack
from backends.sandbox.errors import (
    ExecTimeoutError,
    HostPrerequisiteError,
    ImageBuildError,
    SandboxNotRunningError,
    SandboxStartError,
)
from backends.sandbox.filtered import CheckedDownloads

log = logging.getLogger(__name__)

MAX_TIMEOUT_SEC = harbor_skypilot._MAX_TIMEOUT_SEC  # the server's exec and file-API cap
DEFAULT_TTL_SEC = 6 * 3600
DEFAULT_MAX_DOWNLOAD = 4 * 1024**3
DOWNLOAD_CHUNK = 4 * 1024**2  # one exec of a download: the most it holds in memory at once
DOWNLOAD_IN_MEMORY = 16 * 1024**2  # a download larger than this is spooled to a host file
CLIENT_GRACE_SEC = 30.0  # past a command's timeout, how long the server may take to report it
KILL_TIMEOUT_SEC = 30
STAGING = "/tmp"
EXEC_TAG = "BACKENDS_EXEC_ID"  # every command's processes carry it, to be found and killed
SIGKILLED = 137  # a command's exit status when its pod went away under it (or the OOM killer)

_T = TypeVar("_T")


class SkyPilotSandbox(CheckedDownloads, harbor_skypilot.SkypilotEnvironment):
    """A Harbor environment on a SkyPilot sandbox (one Kubernetes pod from an image or a pool).

    Harbor's kwargs (``EnvironmentConfig.kwargs``): ``registry`` (where Dockerfile tasks are
    pushed; or ``HARBOR_SKYPILOT_REGISTRY``), ``pool`` (a warm pool: its image, shape and
    network apply), ``context_name``, ``namespace``, ``secrets`` (names the Platform resolves),
    ``platform``. Ours:

    - ``ttl_sec``: the sandbox's lifetime, after which the server reaps it (default 6 h);
    - ``max_concurrent_creates``: creations in flight at once in this process (default 64);
    - ``create_attempts``: tries for a create that fails for a transient reason (default 4);
    - ``admission_jitter_sec``: each create call waits a random time up to this first (0.05 s);
    - ``batch_window_sec``, ``batch_max_size``: identical creates arriving within the window
      (0.02 s; longer while they wait for admission) are made by one
      ``create(num_sandboxes=N)`` call of at most this many (32; 1 turns batching off);
    - ``max_download_bytes``: the most one download may bring back (default 4 GiB);
    - ``sdk_threads``: the event loop's default executor is widened to this many threads (256):
      the SDK's ``.aio`` calls run its sync client there, one thread per call in flight, and
      the default (cores + 4) would let only a handful of commands run at once;
    - ``max_output_bytes``: output an ``exec`` keeps per stream (default 64 MiB), the rest
      dropped and said at the end of its stderr;
    - ``network``: ``"public"`` or ``"none"``, over the task's; without either the sandbox
      has no network unless the task asks for it itself (as local sandboxes);
    - ``liveness_interval_sec``: while a command runs, how often the server's listing is
      consulted for its pod (15 s; one listing per interval serves every command): a pod
      gone under a command raises ``SandboxNotRunningError`` then, not at its timeout (0:
      never consulted, for a server whose listing does not show every pod);
    - ``relay_url``: the relay as the pod reaches it (set by HarborBackend from the rollout's
      route); with a blocked network the sandbox is refused.

    Limits: no GPUs; network is public or none (no allowlist); a command runs at most
    3600 s (the server's cap), a longer ``timeout_sec`` is capped there.
    """

    def __init__(
        self,
        *args: Any,
        ttl_sec: int | str = DEFAULT_TTL_SEC,
        max_concurrent_creates: int | str = 64,
        create_attempts: int | str = 4,
        admission_jitter_sec: float | str = 0.05,
        batch_window_sec: float | str = skybatch.DEFAULT_WINDOW_SEC,
        batch_max_size: int | str = skybatch.DEFAULT_MAX_SIZE,
        max_download_bytes: int | str = DEFAULT_MAX_DOWNLOAD,
        relay_url: str | None = None,
        network: str | None = None,
        max_output_bytes: int | str = 64 * 1024 * 1024,
        sdk_threads: int | str = 256,
        liveness_interval_sec: float | str = skylive.DEFAULT_INTERVAL_SEC,
        **kwargs: Any,
    ) -> None:
        self._max_output = int(max_output_bytes)
        self._liveness_interval = float(liveness_interval_sec)
        if self._liveness_interval < 0:
            raise ValueError(f"liveness_interval_sec must be >= 0, not {liveness_interval_sec}")
        self._sdk_threads = int(sdk_threads)
        self._stopping = False
        if network not in (None, "public", "none", "no-network"):
            raise ValueError(f"network must be 'public' or 'none', not {network!r}")
        self._network_override = network
        self.sdk = skysdk.load()  # raises naming what to install
        harbor_skypilot.sky_sandbox = _Intercepted(self.sdk)  # it imports only `sky.sandbox`
        harbor_skypilot._HAS_SKYPILOT = True
        self._ttl = int(ttl_sec)
        self._batching = skybatch.Policy(
            window=float(batch_window_sec),
            max_size=int(batch_max_size),
            max_concurrent=int(max_concurrent_creates),
            attempts=int(create_attempts),
            jitter=float(admission_jitter_sec),
        )
        self._max_download = int(max_download_bytes)
        self._relay_url = relay_url
        for name, value in (
            ("ttl_sec", self._ttl),
            ("max_concurrent_creates", self._batching.max_concurrent),
            ("create_attempts", self._batching.attempts),
            ("batch_max_size", self._batching.max_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, not {value}")
        if self._batching.window < 0 or self._batching.jitter < 0:
            raise ValueError("batch_window_sec and admission_jitter_sec must be >= 0")
        super().__init__(*args, **kwargs)
        if NetworkMode.ALLOWLIST in (
            self.network_policy.network_mode,
            self.task_env_config.network_mode,
        ):
            raise ValueError(
                "network_mode='allowlist' is not supported by SkyPilot sandboxes: their egress "
                "allowlist is CIDR-based, so only 'public' and 'no-network' are honoured"
            )
        if self._relay_url and self._network_disabled and not self._pool:
            raise SandboxStartError(
                f"the sandbox has no network (network_mode='no-network'), so its agent cannot "
                f"reach the relay at {self._relay_url}: allow the task network, or run an agent "
                "that calls the policy from the host (terminus-2)"
            )
        self.run = skyruns.current()
        self._sandbox_name = skyruns.sandbox_name(self.run, self.session_id)

    @property
    def _network_disabled(self) -> bool:
        """No network unless asked for, by kwarg or by the task itself (as local sandboxes)."""
        if self._network_override is not None:
            return self._network_override != "public"
        if self.network_policy.network_mode != NetworkMode.PUBLIC:
            return True
        explicit = {"network_mode", "allow_internet"} & self.task_env_config.model_fields_set
        return not explicit

    @classmethod
    def preflight(cls) -> None:
        skysdk.load()
        skysdk.require_api_server()

    # -- lifecycle -----------------------------------------------------------------------

    async def _create_sandbox(self, image: str | None) -> Any:
        self.run.register()
        _widen_default_executor(self._sdk_threads)
        creating = _CREATING.set(self._create)
        try:
            sandbox = await super()._create_sandbox(image)  # Harbor builds the arguments
        finally:
            _CREATING.reset(creating)
        self._sandbox_name = sandbox.name
        skylive.pods.created(sandbox.name, (self._context_name, self._namespace))
        return sandbox

    async def _create(self, **kwargs: Any) -> Any:
        """Harbor's ``create.aio`` call, made through this loop's batcher."""
        kwargs.pop("name", None)  # the batcher names it: for this session, or a batch member
        kwargs["timeout"] = self._ttl  # instead of Harbor's fixed 24 h
        # The create's env (the task's and the config's) goes with every command instead
        # (``exec`` merges it in): creates of different rollouts stay identical, so they can
        # share a batch, and nothing of a rollout is in the pod's spec.
        kwargs["env"] = None
        return await skybatch.batcher().create(
            self.sdk, self.run, kwargs, self.session_id, self._batching
        )

    async def start(self, force_build: bool) -> None:
        try:
            await super().start(force_build)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        if self._sandbox is not None:
            self._stopping = True  # commands cut short from here on are not results
            with anyio.CancelScope(shield=True):
                await super().stop(delete)
            self.run.live.discard(self._sandbox_name)
            self.run.held.discard(self._sandbox_name)
            skylive.pods.forget(self._sandbox_name)

    def _require_sandbox(self) -> Any:
        if self._sandbox is None:
            raise SandboxNotRunningError("the SkyPilot sandbox is not running: start() it first")
        return self._sandbox

    # -- images ----------------------------------------------------------------------------

    async def _image_exists(self) -> bool:
        builder = image_builder()
        check = (
            [builder, "manifest", "inspect", self._image_ref]
            if builder != "buildah"
            else ["skopeo", "inspect", f"docker://{self._image_ref}"]
        )
        if shutil.which(check[0]) is None:
            return False
        proc = await anyio.run_process(check, check=False)
        return proc.returncode == 0

    async def _build_and_push_image(self) -> None:
        builder = image_builder()
        ref = self._image_ref
        build = [builder, "build", "--platform", self._platform, "-t", ref]
        build += ["-f", str(self._dockerfile_path), str(self.environment_dir)]
        for argv in (build, [builder, "push", ref]):
            proc = await anyio.run_process(argv, check=False, stderr=-2)  # stderr into stdout
            if proc.returncode != 0:
                out = proc.stdout.decode(errors="replace")[-4000:]
                raise ImageBuildError(f"`{shlex.join(argv)}` failed ({proc.returncode}): {out}")

    # -- exec --------------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` with bash in the pod (as ``user``, via ``su``).

        A non-zero exit, a missing cwd or user is an ordinary result.

        Raises:
            ExecTimeoutError: past ``timeout_sec`` (at most 3600 s, the server's cap); the
                command's processes were killed.
            SandboxNotRunningError: not started, or stopped.
        """
        argv = self._exec_argv(command, self._resolve_user(user))
        workdir = effective_exec_cwd(cwd, self.task_env_config.workdir, self._workdir)
        return await self._run(argv, workdir, self._merge_env(env), timeout_sec)

    def _exec_argv(self, command: str, user: str | int | None) -> list[str]:
        # Pods exec as root: no `su` for root, whose process would be one more to survive
        # a `kill -1` of the command's own.
        if user in ("root", 0):
            user = None
        return super()._exec_argv(command, user)

    async def _run_shell(self, command: str, *, timeout_seconds: int) -> ExecResult:
        return await self._run(["sh", "-c", command], None, None, timeout_seconds)

    async def _run(
        self,
        argv: list[str],
        workdir: str | None,
        env: Mapping[str, str] | None,
        timeout_sec: float | None,
    ) -> ExecResult:
        sandbox = self._require_sandbox()
        budget = min(timeout_sec or MAX_TIMEOUT_SEC, MAX_TIMEOUT_SEC)
        # The server takes whole seconds (at least one) and is given a grace to report a
        # timeout; a fraction of a second is cut here, as the local provider cuts it.
        server_budget = max(1, math.ceil(budget))
        deadline = budget if budget < server_budget else server_budget + CLIENT_GRACE_SEC
        tag = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        started = loop.time()
        finished = lost = False

        async def run() -> tuple[int, str, str]:
            handle = await sandbox.exec.aio(
                *argv,
                workdir=workdir,
                timeout_seconds=server_budget,
                env={**(env or {}), EXEC_TAG: tag},
            )
            return await _read_result(handle)

        try:
            # Deliberately not retried: once sent, the command may be running.
            with anyio.move_on_after(deadline):
                code, out, err = await self._unless_lost(run)
                finished = True
        except TimeoutError:  # the SDK's own
            pass
        except Exception as exc:
            if self._stopping or self._sandbox is not sandbox:
                raise SandboxNotRunningError(
                    "the sandbox was stopped while the command ran"
                ) from exc
            lost = isinstance(exc, SandboxNotRunningError) or await self._lost_now()
            if lost:
                raise self._lost_error() from exc
            raise
        finally:
            if not (self._stopping or lost) and (not finished or loop.time() - started >= budget):
                with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_TIMEOUT_SEC):
                    await self._kill_tagged(tag)
        if self._stopping or self._sandbox is not sandbox:
            raise SandboxNotRunningError("the sandbox was stopped while the command ran")
        if not finished:
            answer = "" if deadline == budget else " (no answer)"
            raise ExecTimeoutError(f"command timed out after {budget:g} s{answer}")
        if code != 0 and loop.time() - started >= budget:
            capped = " (the server's cap)" if (timeout_sec or 0) > MAX_TIMEOUT_SEC else ""
            raise ExecTimeoutError(f"command timed out after {budget:g} s{capped}")
        if code == SIGKILLED and await self._lost_now():  # the pod went, and its processes
            raise self._lost_error()
        out, out_dropped = _cap(out, self._max_output)
        err, err_dropped = _cap(err, self._max_output)
        for stream, dropped in (("stdout", out_dropped), ("stderr", err_dropped)):
            if dropped:
                err += "\n" if err and not err.endswith("\n") else ""
                err += (
                    f"[skypilot: {stream} exceeded {self._max_output} bytes; "
                    f"{dropped} further bytes were dropped]\n"
                )
        return ExecResult(stdout=out, stderr=err, return_code=code)

    async def _kill_tagged(self, tag: str) -> None:
        """Kill every process carrying ``tag`` in its environment (daemons it left included)."""
        script = (
            f"for e in /proc/[0-9]*/environ; do grep -qzx '{EXEC_TAG}={tag}' \"$e\" 2>/dev/null"
            ' && p=${e#/proc/} && kill -KILL "${p%/environ}" 2>/dev/null; done; true'
        )
        if self._sandbox is None:
            return
        try:
            handle = await self._sandbox.exec.aio(
                "sh", "-c", script, timeout_seconds=KILL_TIMEOUT_SEC
            )
            await _read_result(handle)
        except Exception as exc:  # the pod may be gone; its TTL and the reaper remain
            log.warning("%s: could not kill a timed-out command: %s", self._sandbox_name, exc)

    # -- liveness ----------------------------------------------------------------------------

    async def _unless_lost(self, work: Callable[[], Awaitable[_T]]) -> _T:
        """``await work()``, checking every ``liveness_interval_sec`` that the pod is still
        there; raises ``SandboxNotRunningError`` once it is not (the work cancelled)."""
        if not self._liveness_interval:
            return await work()
        outcome: list[tuple[bool, Any]] = []
        async with anyio.create_task_group() as tg:

            async def working() -> None:
                try:
                    outcome.append((True, await work()))
                except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
                    outcome.append((False, exc))
                tg.cancel_scope.cancel()

            tg.start_soon(working)
            while True:
                await anyio.sleep(self._liveness_interval)
                if await self._lost_now(fresher_than=self._liveness_interval / 2):
                    tg.cancel_scope.cancel()
                    break
        if not outcome:
            raise self._lost_error()
        ok, value = outcome[0]
        if not ok:
            raise value
        return cast(_T, value)

    async def _lost_now(self, fresher_than: float = 0.0) -> bool:
        """Whether a listing at most ``fresher_than`` seconds old no longer shows the pod
        (never, with ``liveness_interval_sec=0``)."""
        if not self._liveness_interval:
            return False
        return await skylive.pods.lost(
            self.sdk, self._sandbox_name, fresher_than=time.monotonic() - fresher_than
        )

    def _lost_error(self) -> SandboxNotRunningError:
        return SandboxNotRunningError(
            f"the SkyPilot sandbox {self._sandbox_name} is gone (terminated, past its "
            "lifetime or its node lost) while a command ran"
        )

    # -- files -------------------------------------------------------------------------------

    def _path(self, path: str | Path) -> str:
        return transfer.sandbox_path(
            str(path), self.task_env_config.workdir or self._workdir or "/"
        )

    async def _put_archive(self, target_dir: str, pack: Any) -> None:
        def packed() -> bytes:
            # In memory: write_bytes takes the whole archive anyway, and a file descriptor
            # per upload waiting for a worker thread would add up at thousands in flight.
            archive = io.BytesIO()
            pack(archive)
            return archive.getvalue()

        data = await anyio.to_thread.run_sync(packed)
        staged = f"{STAGING}/.bk-up-{uuid.uuid4().hex}.tar"
        await self._require_sandbox().write_bytes.aio(data, staged)
        quoted = shlex.quote(target_dir)
        res = await self._run_shell(
            f"mkdir -p -- {quoted} && tar -x -p -C {quoted} -f {staged}; rc=$?; rm -f {staged}; exit $rc",
            timeout_seconds=MAX_TIMEOUT_SEC,
        )
        if res.return_code != 0:
            raise OSError(f"upload into {target_dir} failed: {(res.stderr or '').strip()}")

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file to ``target_path`` (mode kept, owned by root).

        Raises:
            SandboxPathError: the target escapes the sandbox. FileNotFoundError: no source.
        """
        parent, name = self._path(target_path).rsplit("/", 1)
        source = Path(source_path)
        await self._put_archive(parent or "/", lambda out: transfer.pack(source, name, out))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Merge a host directory's contents into ``target_dir`` (created if missing)."""
        target = self._path(target_dir)
        source = Path(source_dir)
        await self._put_archive(target, lambda out: transfer.pack_dir_contents(source, out))

    async def _get_archive(self, tar_args: str, what: str, extract: Any) -> None:
        """Tar in a fresh root-only dir in the pod, then bring it back in bounded chunks.

        The pod may change the staged file at any time, so no size it reports is trusted:
        each chunk is an exec's output, at most ``chunk`` bytes, counted as it arrives
        against ``max_download_bytes`` and spooled (to a host file past ``DOWNLOAD_IN_MEMORY``).
        """
        staging = f"{STAGING}/.bk-down-{uuid.uuid4().hex}"
        staged = f"{staging}/archive.tar"
        # base64 (76-column lines) must fit one exec's kept output.
        chunk = min(DOWNLOAD_CHUNK, self._max_download + 1, self._max_output * 57 // 77)
        try:
            # In memory while small (no descriptor per download in flight), on disk past that.
            with tempfile.SpooledTemporaryFile(max_size=DOWNLOAD_IN_MEMORY) as archive:
                received = 0
                while True:
                    read = f"tail -c +{received + 1} {staged} | head -c {chunk} | base64"
                    if received == 0:
                        read = (
                            f"mkdir -m 700 {staging} || exit 125; "
                            f"tar -c --sparse -f {staged} {tar_args}; rc=$?; "
                            f"[ $rc -le 1 ] || exit $rc; {read} || exit 125; exit $rc"
                        )  # tar's 1: a file changed while read; the archive is still whole
                    res = await self._run_shell(read, timeout_seconds=MAX_TIMEOUT_SEC)
                    if res.return_code not in (0, 1):
                        raise FileNotFoundError(
                            f"cannot download {what}: {(res.stderr or '').strip()}"
                        )
                    try:
                        data = binascii.a2b_base64(res.stdout or "")
                    except binascii.Error as exc:
                        raise OSError(f"cannot download {what}: corrupt transfer") from exc
                    received += len(data)
                    if len(data) > chunk or received > self._max_download:
                        raise unpack.DownloadTooLargeError(
                            f"cannot download {what}: larger than {self._max_download} bytes "
                            "(max_download_bytes)"
                        )
                    archive.write(data)
                    if len(data) < chunk:
                        break
                await anyio.to_thread.run_sync(extract, archive)
        finally:
            await self._run_shell(f"rm -rf {staging}", timeout_seconds=KILL_TIMEOUT_SEC)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy one sandbox file (links followed inside) to a host path, mode masked to 0755.

        Raises:
            FileNotFoundError: no such file. SandboxPathError: bad path. IsADirectoryError:
            a directory. OSError: not a regular file. DownloadTooLargeError: too large.
        """
        parent, name = self._path(source_path).rsplit("/", 1)
        target = Path(target_path)
        await self._get_archive(
            f"-h -C {shlex.quote(parent or '/')} -- {shlex.quote(name)}",
            source_path,
            lambda archive: _unpack(archive, target.parent, self._max_download, target.name),
        )

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox directory's contents into a host directory, as the local provider
        does: modes masked to 0755, links leading outside dropped, nothing written outside.

        Raises:
            FileNotFoundError: no such directory. SandboxPathError: a member would land
            outside. DownloadTooLargeError: past ``max_download_bytes``.
        """
        await self._download_tree(source_dir, target_dir, ["."])

    async def _download_tree(
        self,
        source_dir: str,
        target_dir: Path | str,
        members: list[str],
        stdin: bytes | None = None,
    ) -> None:
        source = self._path(source_dir)
        target = Path(target_dir)
        names = None
        if stdin is not None:  # `-T -`: the names go in a staged file, exec has no stdin
            names = f"{STAGING}/.bk-names-{uuid.uuid4().hex}"
            await self._require_sandbox().write_bytes.aio(stdin, names)
            members = [names if m == "-" else m for m in members]
        try:
            await self._get_archive(
                shlex.join(["-C", source, *members]),
                source,
                lambda archive: _unpack(archive, target, self._max_download, None),
            )
        finally:
            if names is not None:
                await self._run_shell(f"rm -f {names}", timeout_seconds=KILL_TIMEOUT_SEC)

    async def _list_files(self, source_dir: str) -> list[str]:
        source = self._path(source_dir)
        res = await self._run_shell(
            f"cd -- {shlex.quote(source)} && find . -type f -print0 | base64",
            timeout_seconds=MAX_TIMEOUT_SEC,
        )
        try:
            listing = binascii.a2b_base64(res.stdout or "")
        except binascii.Error:
            listing = None
        if res.return_code != 0 or listing is None:
            raise FileNotFoundError(
                f"cannot list {source} for download: {(res.stderr or '').strip()}"
            )
        return [os.fsdecode(n).removeprefix("./") for n in listing.split(b"\0") if n]


_CREATING: ContextVar[Callable[..., Awaitable[Any]] | None] = ContextVar(
    "skypilot_creating", default=None
)


class _Intercepted:
    """The SDK as Harbor's module calls it, but ``create`` goes to the creating sandbox's
    ``_create`` (set in ``_CREATING`` around Harbor's call)."""

    def __init__(self, sdk: Any) -> None:
        self._sdk = sdk
        self.create = SimpleNamespace(aio=self._create)  # Harbor calls create.aio

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sdk, name)

    async def _create(self, *args: Any, **kwargs: Any) -> Any:
        creating = _CREATING.get()
        if creating is None:  # Harbor's own environment, not ours
            return await self._sdk.create.aio(*args, **kwargs)
        return await creating(*args, **kwargs)


def _widen_default_executor(threads: int) -> None:
    loop = asyncio.get_running_loop()
    current = getattr(loop, "_default_executor", None)
    if current is None or getattr(current, "_max_workers", 0) < threads:
        loop.set_default_executor(
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sky-sdk")
        )


def reap_dead_runs() -> list[str]:
    """Check the SDK and API server, then terminate the sandboxes of runs whose owner died.

    Raises ``HostPrerequisiteError`` naming what is missing.
    """
    sdk = skysdk.load()
    skysdk.require_api_server()
    return skyruns.reap(sdk)


def _unpack(archive: BinaryIO, dest: Path, limit: int, single: str | None) -> None:
    unpack.into(archive, dest, max_bytes=limit, rename_single=single)


async def _read_result(handle: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of either result shape the SDK has had."""
    if isinstance(handle, Mapping):  # the older shape: a dict
        code = handle.get("exit_code", handle.get("returncode"))
        return (
            int(code if code is not None else 1),
            _text(handle.get("stdout")),
            _text(handle.get("stderr")),
        )
    code = handle.wait()
    if inspect.isawaitable(code):
        code = await code
    out = await harbor_skypilot.SkypilotEnvironment._drain_stream(getattr(handle, "stdout", None))
    err = await harbor_skypilot.SkypilotEnvironment._drain_stream(getattr(handle, "stderr", None))
    return int(code if code is not None else 1), out or "", err or ""


def _cap(text: str, limit: int) -> tuple[str, int]:
    """The first ``limit`` bytes of ``text`` and how many were dropped."""
    data = text.encode()
    if len(data) <= limit:
        return text, 0
    return data[:limit].decode(errors="ignore"), len(data) - limit


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    return value or ""


BUILDERS = ("docker", "podman", "buildah")


def image_builder() -> str:
    """The container builder to build Dockerfile tasks with. Raises ``HostPrerequisiteError``."""
    for name in BUILDERS:
        if shutil.which(name):
            return name
    raise HostPrerequisiteError(
        "a Dockerfile task on SkyPilot is built and pushed to a registry, which needs docker, "
        "podman or buildah on this host: install one (apt-get install podman), or give the task "
        "a prebuilt [environment].docker_image, or use a warm pool (pool=...)"
    )


__all__ = ["SkyPilotSandbox", "image_builder", "reap_dead_runs"]
