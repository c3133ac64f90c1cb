"""`LocalSandbox`: Harbor's `BaseEnvironment` backed by a bubblewrap sandbox, no Docker daemon.

Load it in Harbor with `EnvironmentConfig(import_path="backends.sandbox.local:LocalSandbox")`
(or `harbor run --env backends.sandbox.local:LocalSandbox`).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import anyio
from anyio.lowlevel import RunVar
from harbor.environments.base import (
    ExecResult,
)
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import require_agent_environment_definition
from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.models.trial.paths import EnvironmentPaths

from backends.net import is_loopback
from backends.sandbox import direct, layers, transfer, unpack
from backends.sandbox.cgroups import Limits
from backends.sandbox.errors import (
    ExecTimeoutError,
    SandboxNotRunningError,
    SandboxPathError,
    UnsupportedTaskError,
)
from backends.sandbox.filtered import CheckedDownloads
from backends.sandbox.launcher import Bind
from backends.sandbox.relay_forwarder import RelayForwarder
from backends.sandbox.runtime import (
    OUTPUT_LIMIT,
    BwrapSandbox,
    ExecSpawner,
    RunResult,
    SandboxSpec,
    User,
    reap_orphans,
)

log = logging.getLogger(__name__)

DEFAULT_RELAY_PORT = 18080
DEFAULT_PIDS_LIMIT = 2048


def _parse_binds(raw: Iterable[Any] | str | None) -> list[Bind]:
    """Accept Bind objects, dicts {source, target, read_only} or 'src:dst[:ro|rw]' strings."""
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [r for r in raw.split(",") if r]
    binds: list[Bind] = []
    for item in raw:
        if isinstance(item, Bind):
            binds.append(item)
        elif isinstance(item, dict):
            binds.append(
                Bind(Path(item["source"]), str(item["target"]), bool(item.get("read_only", True)))
            )
        else:
            parts = str(item).split(":")
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
                raise ValueError(f"bad bind {item!r}: expected 'host:sandbox[:ro|rw]'")
            binds.append(Bind(Path(parts[0]), parts[1], len(parts) == 2 or parts[2] == "ro"))
    for b in binds:
        if not b.target.startswith("/"):
            raise SandboxPathError(f"bind target {b.target!r} must be an absolute sandbox path")
        transfer.sandbox_path(b.target)
        if not b.source.exists():
            raise FileNotFoundError(f"bind source {b.source} does not exist on the host")
    return binds


def _host_mount_binds(mounts: Iterable[Any]) -> list[Bind]:
    """Harbor's host mounts (the trial's /logs when auto_mounting, user mounts) as binds."""
    binds = []
    for mount in mounts:
        if mount.get("type") != "bind":
            raise UnsupportedTaskError(
                f"mount {mount.get('target')!r} is of type {mount.get('type')!r}: local "
                "sandboxes bind host directories only"
            )
        binds.append(
            Bind(Path(mount["source"]), str(mount["target"]), bool(mount.get("read_only")))
        )
    return _parse_binds(binds)


DEFAULT_MAX_DOWNLOAD = 16 * 1024**3
TRANSFER_TIMEOUT_SEC = 1800  # a transfer the sandbox stalls must not hold a trial forever


class LocalSandbox(CheckedDownloads):
    """A Harbor environment run as a local bubblewrap sandbox.

    Isolation: a user namespace mapping sandbox root to a host uid range of its own (65,536
    ids leased per running sandbox from `BACKENDS_SANDBOX_UID_BASE`, default 1,000,000, so
    per-uid kernel limits are not shared; host secrets stay unreadable), a session of its
    own for every command (no controlling terminal), a fresh session keyring, a seccomp
    filter in the spirit of Docker's default (`backends.sandbox.seccomp`), pid/ipc/uts/mount
    namespaces, its own network namespace (only loopback, or
    with `network_mode = "public"` a NAT'd uplink through slirp4netns that cannot reach the
    host's loopback), a copy-on-write overlay over the image's layers, and limits from
    task.toml (`cpus`, `memory_mb` by cgroups, `storage_mb` by a disk image) plus a pids
    limit. `stop()` or the end of the owning process kills every process inside, daemons
    included.

    Images: `environment/Dockerfile` is built into cached overlay layers (see
    `backends.sandbox.layers`); `FROM` and `docker_image` resolve through
    `sandbox_images/substitutions.toml`, with a warning when a substitute stands in.

    Extra constructor kwargs (Harbor passes `EnvironmentConfig.kwargs` / `--ek k=v` here):

    - `extra_binds`: host paths to show inside, as a list of `Bind`, of dicts
      `{"source", "target", "read_only"=True}`, or a comma-separated string of
      `host:sandbox[:ro|rw]`. Sources need not be reachable by the sandbox uid: the launcher
      binds them as host root before entering the user namespace.
    - `relay_socket`: host path of a Unix socket (the policy relay). `127.0.0.1:<relay_port>`
      (default 18080) inside is forwarded to it from the host
      (`backends.sandbox.relay_forwarder`: no process inside), so a sandbox without network
      reaches exactly that one endpoint. The socket itself is not shown inside: the
      forwarder's cap on connections is then the only way in, so one sandbox cannot hold
      more than its share of the orchestrator's fds.
    - `relay_port`: the in-sandbox TCP port of that forwarder.
    - `host_python`: True binds this host interpreter's installation (`sys.base_prefix`)
      read-only at its original path (its RUNPATH needs that path); a string binds that
      prefix instead.
    - `network`: "public" or "none" to override the task's network mode.
    - `pids_limit`: maximum processes in the sandbox (default 2048; fork bombs stop there).
    - `build_network`: "public" (default, like `docker build`) or "none" for RUN steps.
    - `max_output_bytes`: output an `exec` keeps per stream (default 64 MiB); the rest is
      drained, dropped, and reported at the end of its stderr.

    - `transfer_timeout_sec`: the longest one upload or download may take (default 1800 s):
      root inside decides what `tar` is and may stall it. Past it the transfer is killed
      and raises `ExecTimeoutError`. The attribute of that name may be changed while the
      sandbox runs: HarborBackend sets it to each phase's own timeout (agent setup, agent,
      verifier), so a stalled transfer holds a trial no longer than that phase could.
    - `shm_size_mb`: size of /dev/shm (default: the task's memory_mb, else 64).
    - `max_download_bytes`: the most one download may bring to the host, both as archive
      bytes and as the files' apparent sizes (a sparse file counts at its full size; default:
      the disk limit plus 64 MiB when `storage_mb` is set, else 16 GiB); more is an error.
      Files that host tools read whole have a fixed limit of their own, whatever this is:
      reward.txt and reward.json 1 MiB, trajectory.json and ctrf.json 64 MiB
      (`backends.sandbox.unpack.PARSED_FILE_LIMITS`).
    - `host_transfers`: True (default) moves files by the host through the sandbox's root
      (`backends.sandbox.direct`: kernel-confined paths, the sandbox's own mounts only,
      sandbox root's ids for writes), about 0.5 ms each; anything that path cannot take, and
      every transfer with False, goes through `tar` run inside as sandbox root (~5 ms).
    - `enforce_storage`: True (default) enforces the task's `storage_mb` (the sandbox writes
      into a sparse ext4 image that size; past it, ENOSPC); False runs without a disk limit,
      for hosts without loop devices.
    - `auto_mounting` (Harbor's own switch): True binds the trial's /logs/agent,
      /logs/verifier and /logs/artifacts to its host directories, as Harbor's mounted
      environments do, sparing a download per directory. Refused with an enforced
      `storage_mb`: files written there would escape the disk limit. It trusts the sandbox
      with those host directories: whatever root inside plants there (a symlink to a host
      file, a sparse 1 TiB reward.txt) is what host-side readers such as Harbor's verifier
      open, unchecked and unbounded, so use it only for trusted agents. Harbor's `mounts`
      (bind type) are bound likewise.

    Not supported, and refused at construction with an error naming it: GPUs and TPUs,
    network allowlists, docker-compose environments, Windows.

    `stop(delete=False)` still removes the sandbox: its state lives in a scratch overlay that
    nothing could reattach to.
    """

    _reaped: ClassVar[bool] = False

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        *args: Any,
        extra_binds: Iterable[Any] | str | None = None,
        relay_socket: str | Path | None = None,
        relay_port: int | str = DEFAULT_RELAY_PORT,
        host_python: bool | str = False,
        network: str | None = None,
        pids_limit: int | str = DEFAULT_PIDS_LIMIT,
        build_network: str = "public",
        max_output_bytes: int | str = OUTPUT_LIMIT,
        max_download_bytes: int | str | None = None,
        shm_size_mb: int | str | None = None,
        enforce_storage: bool | str = True,
        transfer_timeout_sec: float | str = TRANSFER_TIMEOUT_SEC,
        host_transfers: bool | str = True,
        **kwargs: Any,
    ) -> None:
        self.transfer_timeout_sec = float(transfer_timeout_sec)
        self.host_transfers = _flag(host_transfers, "host_transfers")
        self._extra_binds = _parse_binds(extra_binds)
        self._relay_socket = Path(relay_socket) if relay_socket else None
        self._relay_port = int(relay_port)
        self._relay_forwarder: RelayForwarder | None = None
        if isinstance(host_python, str) and host_python.lower() in ("true", "false", "1", "0"):
            host_python = _flag(host_python, "host_python")
        self._host_python = host_python
        if network not in (None, "public", "none", "no-network"):
            raise ValueError(f"network must be 'public' or 'none', not {network!r}")
        self._network_override = network
        self._pids_limit = int(pids_limit)
        self._build_network = build_network != "none"
        self._enforce_storage = _flag(enforce_storage, "enforce_storage")
        self._max_output = int(max_output_bytes)
        if self._max_output < 0:
            raise ValueError(f"max_output_bytes must be >= 0, not {max_output_bytes!r}")
        self._box: BwrapSandbox | None = None
        self._image: layers.Image | None = None
        # Harbor's command line passes the flag as a string.
        kwargs["auto_mounting"] = _flag(kwargs.get("auto_mounting", False), "auto_mounting")
        self._binds_host_paths = kwargs["auto_mounting"] or bool(kwargs.get("mounts"))
        super().__init__(
            environment_dir,
            environment_name,
            session_id,
            trial_paths,
            task_env_config,
            *args,
            **kwargs,
        )
        if self.task_env_config.network_mode == NetworkMode.ALLOWLIST:
            # Harbor checks the trial's policy; a direct caller may only have the task's.
            raise ValueError(
                "network_mode='allowlist' is not supported by local-sandbox environment: it "
                "can give no network or the host's network, nothing in between"
            )
        storage = self._effective_storage_mb if self._enforce_storage else None
        self._host_binds = _host_mount_binds(self._host_mounts)
        if storage and self.auto_mounting:
            raise ValueError(
                "auto_mounting binds /logs to the host, outside the task's storage_mb limit: "
                "turn one of them off (enforce_storage=False to drop the limit)"
            )
        if max_download_bytes is not None:
            self._max_download = int(max_download_bytes)
        elif storage:
            self._max_download = (storage + 64) * 1024 * 1024
        else:
            self._max_download = DEFAULT_MAX_DOWNLOAD
        # /dev/shm: as docker's --shm-size; by default 64 MiB, or the memory limit when set
        # (its pages count against that limit anyway).
        memory = self._effective_memory_mb
        self._shm_mb = int(shm_size_mb) if shm_size_mb is not None else (memory or 64)
        if self._effective_storage_mb and not self._enforce_storage:
            log.warning(
                "%s: storage_mb=%s is not enforced (enforce_storage=False)",
                session_id,
                self._effective_storage_mb,
            )

    @staticmethod
    def type() -> str:
        return "local-sandbox"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # Mounted only when asked to: Harbor then derives the /logs binds from trial_paths.
        return EnvironmentCapabilities(disable_internet=True, mounted=self._binds_host_paths)

    def validate_network_policy_support(self, network_policy: NetworkPolicy | None = None) -> None:
        """Harbor's check, except that an allowlist of loopback addresses alone is no network.

        Harbor allowlists an installed agent's inference host; through the relay's forwarder
        that is 127.0.0.1, the sandbox's own loopback, which a sandbox without network has.
        """
        policy = network_policy or self.network_policy
        if policy.network_mode == NetworkMode.ALLOWLIST and all(
            is_loopback(host) for host in policy.allowed_hosts
        ):
            return
        super().validate_network_policy_support(network_policy)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    def _validate_definition(self) -> None:
        if (self.environment_dir / "docker-compose.yaml").exists():
            raise UnsupportedTaskError(
                f"{self.environment_dir}/docker-compose.yaml: multi-container (compose) "
                "tasks are not supported by local sandboxes"
            )
        require_agent_environment_definition(
            self.environment_dir, docker_image=self.task_env_config.docker_image
        )

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def network_enabled(self) -> bool:
        """Public network only when asked for: by kwarg or explicitly by the task."""
        if self._network_override is not None:
            return self._network_override == "public"
        if self.network_policy.network_mode != NetworkMode.PUBLIC:
            return False
        # Harbor's default is public; ours is none unless the task says public itself.
        explicit = {"network_mode", "allow_internet"} & self.task_env_config.model_fields_set
        return bool(explicit) and self.task_env_config.network_mode == NetworkMode.PUBLIC

    async def _resolve_image(self) -> layers.Image:
        dockerfile = self.environment_dir / "Dockerfile"
        if dockerfile.exists():
            return await layers.build(self.environment_dir, network=self._build_network)
        image = self.task_env_config.docker_image
        assert image  # _validate_definition guarantees one
        cached = layers.cached_base_image(image)
        if cached is not None:
            return cached
        return await anyio.to_thread.run_sync(layers.base_image, image)

    def _binds(self) -> list[Bind]:
        binds = [*self._extra_binds, *self._host_binds]
        if self._relay_socket is not None and not self._relay_socket.exists():
            raise FileNotFoundError(f"relay socket {self._relay_socket} does not exist")
        if self._host_python:
            prefix = Path(sys.base_prefix if self._host_python is True else str(self._host_python))
            binds.append(Bind(prefix, str(prefix), read_only=True))
        return binds

    async def start(self, force_build: bool) -> None:
        # force_build changes nothing: layers are content-addressed, a rebuild would be equal.
        if not LocalSandbox._reaped:
            LocalSandbox._reaped = True
            await anyio.to_thread.run_sync(reap_orphans)
        self._image = await self._resolve_image()
        paths = EnvironmentPaths.for_os(self.os)
        dirs = [str(paths.agent_dir), str(paths.verifier_dir), str(paths.artifacts_dir)]
        dirs += [t for t in self._mount_targets(writable_only=True) if t not in dirs]
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", self.session_id)[:40] + "-" + uuid.uuid4().hex[:8]
        box = BwrapSandbox(
            SandboxSpec(
                lowerdirs=self._image.lowerdirs,
                env=dict(self._image.env),
                workdir=self._image.workdir,
                network=self.network_enabled,
                binds=self._binds(),
                limits=Limits(
                    cpus=self._effective_cpus,
                    memory_mb=self._effective_memory_mb,
                    pids=self._pids_limit,
                ),
                precreate_dirs=dirs,
                storage_mb=self._effective_storage_mb if self._enforce_storage else None,
                shm_mb=self._shm_mb,
            ),
            name=name,
        )
        await box.start()
        self._box = box
        try:
            if self._relay_socket is not None:
                await self._start_relay_forwarder()
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self.stop(delete=True)
            raise

    async def _start_relay_forwarder(self) -> None:
        assert self._box is not None and self._relay_socket is not None
        try:
            self._relay_forwarder = await RelayForwarder.start(
                self._box.init_pidfd, self._relay_port, self._relay_socket
            )
        except OSError as e:  # ProcessLookupError too: the sandbox died
            raise SandboxNotRunningError(
                f"relay forwarder did not start on port {self._relay_port}: {e}"
            ) from e

    async def stop(self, delete: bool) -> None:
        forwarder, self._relay_forwarder = self._relay_forwarder, None
        box, self._box = self._box, None
        try:
            if forwarder is not None:
                await forwarder.aclose()
        finally:
            if box is not None:
                await box.stop()

    async def end_processes(self) -> bool:
        """Kill every process in the sandbox but its pid 1 (what an agent left running);
        True once all are gone. From the host, without running a command inside.

        Raises:
            SandboxNotRunningError: not started, stopped, or the sandbox died.
        """
        return await self._require().end_processes()

    def _require(self) -> BwrapSandbox:
        if self._box is None:
            raise SandboxNotRunningError(f"sandbox {self.session_id} is not started")
        return self._box

    @property
    def workdir(self) -> str:
        image_workdir = self._image.workdir if self._image else "/"
        return self.task_env_config.workdir or image_workdir

    # -- commands ---------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run `command` with bash in the sandbox.

        `user` falls back to Harbor's default user, then the image's USER, then root; `cwd`
        to the task's workdir, then the image's WORKDIR. A non-zero exit, a missing cwd or an
        unknown user is an ordinary result (exit 1 / 126 with the reason on stderr).

        Raises:
            ExecTimeoutError: past `timeout_sec`; the command's process tree was killed.
            SandboxNotRunningError: not started, stopped, or the sandbox died.
        """
        who, merged_env = await self._exec_user_env(user, env)
        if isinstance(who, ExecResult):
            return who
        workdir = transfer.sandbox_path(cwd or self.workdir, self.workdir)
        script = f"cd -- {shlex.quote(workdir)} || exit 1\n{command}"
        res = await self._require().run(
            ["/bin/bash", "-c", script],
            user=who,
            env=merged_env,
            timeout=timeout_sec or None,  # 0 is no limit, as in Harbor's docker environment
            output_limit=self._max_output,
        )
        return self._exec_result(res)

    async def exec_forked(
        self,
        spawner: ExecSpawner,
        argv: list[str],
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run `argv` (not a shell command) started by `spawner`, a fork server
        (`backends.sandbox.forkserver`), in the directory it runs commands in, with `stdin`
        on its stdin; otherwise as `exec` runs a command: the same user, environment,
        limits, kill and result.

        Raises:
            ForkServerUnavailable: the fork server cannot run it; nothing ran (use `exec`).
            ExecTimeoutError, SandboxNotRunningError: as `exec`.
        """
        who, merged_env = await self._exec_user_env(user, env)
        if isinstance(who, ExecResult):
            return who
        res = await self._require().run(
            argv,
            user=who,
            env=merged_env,
            timeout=timeout_sec or None,
            output_limit=self._max_output,
            spawner=spawner,
            stdin=stdin,
        )
        return self._exec_result(res)

    @property
    def sandbox(self) -> BwrapSandbox:
        """The running sandbox underneath (for a fork server's host: its namespaces, cgroup).

        Raises:
            SandboxNotRunningError: not started, or stopped.
        """
        return self._require()

    async def _exec_user_env(
        self, user: str | int | None, env: dict[str, str] | None
    ) -> tuple[User | ExecResult, dict[str, str] | None]:
        """The user a command runs as (an unknown one: the failed result) and its environment."""
        box = self._require()
        resolved = self._resolve_user(user)
        if resolved is None and self._image is not None:
            resolved = self._image.user
        merged_env = self._merge_env(env)
        try:
            return await box.resolve_user(resolved), merged_env
        except ValueError as e:
            return ExecResult(stdout="", stderr=f"{e}\n", return_code=126), merged_env

    def _exec_result(self, res: RunResult) -> ExecResult:
        stderr = res.stderr.decode(errors="replace")
        for stream, dropped in (("stdout", res.stdout_dropped), ("stderr", res.stderr_dropped)):
            if dropped:
                stderr += "\n" if stderr and not stderr.endswith("\n") else ""
                stderr += (
                    f"[local-sandbox: {stream} exceeded {self._max_output} bytes; "
                    f"{dropped} further bytes were dropped]\n"
                )
        return ExecResult(
            stdout=res.stdout.decode(errors="replace"), stderr=stderr, return_code=res.return_code
        )

    # -- files --------------------------------------------------------------------------------
    # Done by the host through the sandbox's root where it can (backends.sandbox.direct);
    # otherwise by `tar` run inside as sandbox root. Both give the same result.

    async def _direct(
        self, what: str, transfer_fn: Callable[[direct.SandboxRoot, direct.Watch], None]
    ) -> bool:
        """Run a transfer through the sandbox's root; False: it must go through `tar`.

        Like the tar path it gives up after `transfer_timeout_sec` and when cancelled (the
        worker thread stops at its next chunk or entry and removes what it made).
        """
        root = self._require().host_root() if self.host_transfers else None
        if root is None:
            return False
        watch = direct.Watch(self.transfer_timeout_sec, what)
        try:
            await anyio.to_thread.run_sync(
                transfer_fn, root, watch, abandon_on_cancel=True, limiter=_transfer_threads()
            )
        except direct.Unsupported as e:
            log.debug("%s goes through tar in the sandbox: %s", what, e)
            return False
        except TimeoutError:
            raise ExecTimeoutError(
                f"{what} took longer than {self.transfer_timeout_sec} s (transfer_timeout_sec)"
            ) from None
        finally:
            watch.stop()
        return True

    async def replace_dirs(self, dirs: dict[str, int]) -> None:
        """Put an empty root-owned directory of the given mode at each path, whatever stood
        there (what an agent left at /tests or in /logs/verifier never reaches its grader).

        Raises:
            OSError: not possible (a mount point there, say).
        """
        paths = {transfer.sandbox_path(p, self.workdir): mode for p, mode in dirs.items()}
        if await self._direct(
            f"emptying {', '.join(paths)}", lambda root, watch: root.replace_dirs(paths, watch)
        ):
            return
        # Inside instead, as Harbor empties directories (a mount point, such as a bound /logs
        # directory, keeps its root and loses its contents).
        # (A bound directory may not be ours to chmod: it keeps its mode.)
        script = " && ".join(
            [self._empty_dirs_command(list(paths), chmod=False)]
            + [f"{{ chmod {mode:o} {shlex.quote(p)} || true; }}" for p, mode in paths.items()]
        )
        res = await self.exec(script, user="root", timeout_sec=int(self.transfer_timeout_sec))
        if res.return_code != 0:
            raise OSError(f"cannot empty {', '.join(paths)}: {(res.stderr or '').strip()}")

    async def _untar_into(self, target_dir: str, pack: Callable[[BinaryIO], None]) -> None:
        box = self._require()
        root = await box.resolve_user(0)
        with tempfile.TemporaryFile() as archive:
            await anyio.to_thread.run_sync(pack, archive)
            res = await box.run(
                ["/bin/sh", "-c", 'mkdir -p -- "$0" && exec tar -x -p -C "$0" -f -', target_dir],
                user=root,
                stdin=archive,
                timeout=self.transfer_timeout_sec,
            )
        if res.return_code != 0:
            raise OSError(f"upload into {target_dir} failed: {res.stderr.decode().strip()}")
        box.forget_users()  # an upload may have replaced /etc/passwd

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file to `target_path` in the sandbox (mode kept, owned by root).

        Raises:
            SandboxPathError: target escapes the sandbox root. FileNotFoundError: no source.
        """
        target = transfer.sandbox_path(target_path, self.workdir)
        parent, name = target.rsplit("/", 1)
        source = Path(source_path)
        if await self._direct(
            f"upload to {target}",
            lambda root, watch: root.upload(source, target, watch, contents=False),
        ):
            self._require().forget_users()  # an upload may have replaced /etc/passwd
            return
        await self._untar_into(parent or "/", lambda out: transfer.pack(source, name, out))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Merge a host directory's contents into `target_dir` (created if missing)."""
        target = transfer.sandbox_path(target_dir, self.workdir)
        source = Path(source_dir)
        if await self._direct(
            f"upload to {target}",
            lambda root, watch: root.upload(source, target, watch, contents=True),
        ):
            self._require().forget_users()
            return
        await self._untar_into(target, lambda out: transfer.pack_dir_contents(source, out))

    async def _tar_out(
        self,
        argv: list[str],
        what: str,
        extract: Callable[[BinaryIO], None],
        stdin: bytes | None = None,
    ) -> None:
        box = self._require()
        limit = self._max_download
        with tempfile.TemporaryFile() as archive:
            # The archive is written by sandbox code (root inside decides what `tar` is): the
            # host copies it from a pipe, capped, and closes the pipe when the call ends, so
            # nothing inside can fill the host's disk or write into the file afterwards; a
            # timeout bounds how long a sandbox can hold the caller.
            res = await box.run(
                argv,
                user=await box.resolve_user(0),
                stdin=stdin,
                stdout=archive,
                timeout=self.transfer_timeout_sec,
                output_limit=limit,
            )
            if res.stdout_dropped:
                raise unpack.DownloadTooLargeError(
                    f"cannot download {what}: larger than {limit} bytes (max_download_bytes)"
                )
            if res.return_code == 1:
                # GNU tar's "some files differ": a file changed while it was read (a daemon
                # still appending to a log). The archive is whole; the unpacker checks it.
                log.warning("download of %s: %s", what, res.stderr.decode().strip()[-2000:])
            elif res.return_code != 0:
                raise FileNotFoundError(f"cannot download {what}: {res.stderr.decode().strip()}")
            await anyio.to_thread.run_sync(extract, archive)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy one sandbox file (symlinks followed inside the sandbox) to a host path.

        The host file gets the mode bits masked to 0755 at most (no setuid, no group or
        world write), like every downloaded entry.

        Raises:
            FileNotFoundError: no such file in the sandbox. SandboxPathError: bad path.
            IsADirectoryError: the source is a directory. OSError: not a regular file.
            DownloadTooLargeError (an OSError): past `max_download_bytes`, or past the
            limit of a file host tools read whole (reward.txt, ...).
        """
        source = transfer.sandbox_path(source_path, self.workdir)
        parent, name = source.rsplit("/", 1)
        target = Path(target_path)
        limit = self._max_download
        if await self._direct(
            f"download of {source}",
            lambda root, watch: unpack.into_members(
                root.file_member(source, watch),
                target.parent,
                max_bytes=limit,
                rename_single=target.name,
            ),
        ):
            return
        await self._tar_out(
            ["tar", "-c", "--sparse", "-h", "-C", parent or "/", "-f", "-", name],
            source,
            lambda archive: unpack.into(
                archive, target.parent, max_bytes=self._max_download, rename_single=target.name
            ),
        )

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox directory's contents into a host directory (modes, symlinks kept).

        Modes are masked to 0755 at most; symlinks resolving outside `target_dir` are
        skipped; entries of `target_dir` the download does not overwrite are left alone. A
        failed download removes what it had created.

        Raises:
            FileNotFoundError: no such directory. SandboxPathError: a member would land
            outside `target_dir` or go through a symlink (as a crafted archive would), or
            would replace a directory. DownloadTooLargeError (an OSError): past
            `max_download_bytes`, or past the limit of a file host tools read whole.
        """
        source = transfer.sandbox_path(source_dir, self.workdir)
        target = Path(target_dir)
        limit = self._max_download
        if await self._direct(
            f"download of {source}",
            lambda root, watch: unpack.into_members(
                root.tree_members(source, watch), target, max_bytes=limit
            ),
        ):
            return
        await self._download_tree(source_dir, target_dir, ["."])

    async def _list_files(self, source_dir: str) -> list[str]:
        box = self._require()
        source = transfer.sandbox_path(source_dir, self.workdir)
        listing = await box.run(
            ["/bin/sh", "-c", 'cd -- "$0" && exec find . -type f -print0', source],
            user=await box.resolve_user(0),
            timeout=self.transfer_timeout_sec,
        )
        if listing.return_code != 0 or listing.stdout_dropped:
            raise FileNotFoundError(
                f"cannot list {source} for download: {listing.stderr.decode().strip()}"
            )
        return [os.fsdecode(n).removeprefix("./") for n in listing.stdout.split(b"\0") if n]

    async def _download_tree(
        self,
        source_dir: str,
        target_dir: Path | str,
        members: list[str],
        stdin: bytes | None = None,
    ) -> None:
        source = transfer.sandbox_path(source_dir, self.workdir)
        target = Path(target_dir)
        await self._tar_out(
            ["tar", "-c", "--sparse", "-C", source, "-f", "-", *members],
            source,
            lambda archive: unpack.into(archive, target, max_bytes=self._max_download),
            stdin=stdin,
        )


_TRANSFER_THREADS: RunVar[anyio.CapacityLimiter] = RunVar("local-sandbox transfer threads")


def _transfer_threads() -> anyio.CapacityLimiter:
    """Worker threads of host-side transfers, apart from anyio's default pool: transfers a
    sandbox slows down (within their timeouts) never keep other work from its threads."""
    try:
        return _TRANSFER_THREADS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(16)
        _TRANSFER_THREADS.set(limiter)
        return limiter


def _flag(value: bool | str, name: str) -> bool:
    """A boolean kwarg, which Harbor's command line passes as a string."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{name} must be true or false, not {value!r}")
