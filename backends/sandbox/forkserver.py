"""Fork servers: run `python -m module ...` in a live sandbox by forking a pre-imported
interpreter, instead of exec'ing a fresh one that imports everything again.

Why: a workflow's imports (`openai` alone, 1-4 s here) dominate a bundled rollout that runs
it in a fresh interpreter. A fork server imports them once and forks each command straight
into the sandbox it is for, with what an exec there gets (see `forkserver_process`).

Why one server per uid range: only host root, or the host uid that owns a sandbox's user
namespace (its leased range's root), may join it, and the server must not be host root (it
runs the project's import-time code). So a server runs as that uid, outside every sandbox's
user and pid namespaces (a process may only join a pid namespace below its own), in the
mount, network, ipc and uts namespaces and the cgroup of a *host sandbox* (no host
filesystem, no network; its teardown and the reaper end the servers with it). The host sees
and trusts of a server only this: the pid it names must be its own child running as its uid.

Per command: the host opens the target sandbox's namespaces (as root; they go to the server
as fds), the server forks a launcher and forgets the request, the host moves the launcher
into the command's cgroups and lets it go, the launcher enters and forks the command. The
command's exit code comes to the host from the launcher on a pipe of its own, so a server
that dies loses no command already started; one that fails or is gone raises
`ForkServerUnavailable` before anything ran, and the caller runs the command cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from backends.sandbox import launcher, seccomp, uids
from backends.sandbox.cgroups import Join
from backends.sandbox.namespaces import open_namespaces, owner_uid
from backends.sandbox.pidfds import has_exited
from backends.sandbox.runtime import BwrapSandbox

log = logging.getLogger(__name__)

_ENTER = Path(__file__).with_name("forkserver_enter.py")
NAMESPACES = ("user", "mnt", "net", "ipc", "uts", "pid")  # forkserver_process.NAMESPACES
START_TIMEOUT_SEC = 300.0  # imports under a loaded host take seconds; a hung one is broken
REPLY_TIMEOUT_SEC = 30.0  # a fork and a reply
MAX_STARTS = 3  # per kind of server: past this many failed starts, commands run cold
MAX_SERVERS = 32  # per host sandbox (one per concurrent trial); the least recently used goes


class ForkServerUnavailable(Exception):
    """The fork server cannot run this command (it failed, or is gone); nothing ran."""


class ForkServer:
    """One fork server process, serving the sandboxes whose root is host uid `uid`."""

    def __init__(
        self, proc: launcher.SandboxProcess, sock: socket.socket, uid: int, kept: uids.Keep
    ) -> None:
        self.proc = proc
        self.sock = sock
        self.sock.setblocking(False)
        self.uid = uid
        self.dead = False
        self._lock = anyio.Lock()
        self._kept = kept  # its uid range: leased to nobody else while it runs

    @classmethod
    async def start(
        cls,
        host: BwrapSandbox,
        *,
        uid: int,
        python: str,
        cwd: str,
        env: dict[str, str],
        preload: tuple[str, list[Any]] | None,
    ) -> ForkServer:
        """Start a server as host uid `uid` in `host`'s namespaces and cgroup; wait until its
        preload is done.

        Raises:
            ForkServerUnavailable: it could not start (the message says why).
        """
        host_pidfd = host.init_pidfd
        if host_pidfd < 0:
            raise ForkServerUnavailable("the fork servers' host sandbox is not running")
        # Running as the range's root, the server may enter any sandbox of the range: no
        # other process may lease it until the server is gone.
        kept = uids.keep(uid)
        if kept is None:
            raise ForkServerUnavailable(f"uid {uid} is not the root of a range this process leases")
        try:
            return await cls._start(host, host_pidfd, kept, uid, python, cwd, env, preload)
        except BaseException:
            kept.release()
            raise

    @classmethod
    async def _start(
        cls,
        host: BwrapSandbox,
        host_pidfd: int,
        kept: uids.Keep,
        uid: int,
        python: str,
        cwd: str,
        env: dict[str, str],
        preload: tuple[str, list[Any]] | None,
    ) -> ForkServer:
        group = f"fork-server-{uid}"
        host.cgroup.new_exec_group(group)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        process_config = {
            "seccomp": seccomp.program().hex(),
            "keyctl": seccomp.syscall_number("keyctl"),
            "preload": list(preload) if preload else None,
        }
        config = {
            "uid": uid,
            "gid": uid,
            "keyctl": seccomp.syscall_number("keyctl"),
            "cwd": cwd,
            "argv": [
                python,
                "-m",
                "backends.sandbox.forkserver_process",
                json.dumps(process_config),
            ],
            "env": env,
        }
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        errors = tempfile.TemporaryFile()  # its stderr: read only if it fails to start
        try:
            proc = await launcher.spawner().spawn(
                [sys.executable, "-I", "-S", str(_ENTER), json.dumps(config)],
                env={},
                fds=(null, null, errors.fileno(), host_pidfd, theirs.fileno()),
                cgroup=host.cgroup.join(group),
            )
        except OSError as e:
            ours.close()
            raise ForkServerUnavailable(f"could not start a fork server: {e}") from e
        finally:
            theirs.close()
            os.close(null)
        server = cls(proc, ours, uid, kept)
        try:
            with anyio.fail_after(START_TIMEOUT_SEC):
                reply = await server._recv()
            if not reply.get("ready"):
                raise ForkServerUnavailable(
                    f"the fork server failed to start: {reply.get('error')}"
                )
            if shared := shared_writable_mappings(proc.pid):
                # Every fork writes through to such pages (an anonymous mmap is shared by
                # default): one rollout's data would reach the next one forked here.
                raise ForkServerUnavailable(
                    "the preload made shared writable memory, which forks would share: "
                    + "; ".join(shared[:3])
                )
        except (OSError, TimeoutError, ValueError, ForkServerUnavailable) as e:
            server.close()
            errors.seek(0)
            detail = errors.read()[-4000:].decode(errors="replace").strip()
            raise ForkServerUnavailable(
                f"{e or 'the fork server did not start in time'}: {detail or 'no output'}"
            ) from e
        except BaseException:
            server.close()
            raise
        finally:
            errors.close()
        return server

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        fds: Sequence[int],
        cgroup: Join,
        enter: dict[str, Any],
        enter_pidfd: int,
        cwd: str,
    ) -> launcher.SandboxProcess:
        """Run `argv` (`[python, "-m", module, *args]`) in the sandbox whose pid 1 is the pidfd
        `enter_pidfd`, as `enter`'s user, in `cwd`, with `fds` as its fds 0-2, in the server's
        environment.

        Raises:
            ForkServerUnavailable: the server cannot run it; nothing ran.
            OSError: the sandbox's pid 1 is gone.
        """
        if len(argv) < 3 or argv[1] != "-m" or len(fds) != 3:
            raise ForkServerUnavailable(f"a fork server runs `python -m module`, not {argv!r}")
        namespaces = open_namespaces(enter_pidfd, NAMESPACES)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        request = {
            "module": argv[2],
            "args": list(argv[3:]),
            "cwd": cwd,
            "uid": enter["uid"],
            "gid": enter["gid"],
            "groups": enter["groups"],
        }
        started = False
        try:
            try:
                async with self._lock:
                    if self.dead:
                        raise ForkServerUnavailable("the fork server is gone")
                    # Shielded: a request left unanswered would pair the next with its reply.
                    with anyio.CancelScope(shield=True), anyio.fail_after(REPLY_TIMEOUT_SEC):
                        await self._send(request, [*fds, status_w, go_r, *namespaces])
                        reply = await self._recv()
            except (OSError, TimeoutError, ValueError) as e:
                self.close()  # a server that fails to answer is not asked again
                raise ForkServerUnavailable(f"the fork server failed: {e or 'no reply'}") from e
            finally:
                for fd in (status_w, go_r, *namespaces):
                    os.close(fd)
            if "pid" not in reply:
                raise ForkServerUnavailable(f"the fork server refused: {reply.get('error')}")
            pid, pidfd = self._own_child(reply["pid"])
            try:
                _move(pid, cgroup)
                os.write(go_w, b"G")
                first = await launcher.read_fd(status_r, lambda b: len(b) >= 1)
                if first[:1] != b"S":
                    why = first[1:].decode(errors="replace") or "it died before it started"
                    raise ForkServerUnavailable(f"the forked command did not start: {why}")
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
                raise
            started = True
            return ForkedProcess(pid, pidfd, asyncio.get_running_loop(), status_r, first[1:])
        finally:
            os.close(go_w)
            if not started:
                os.close(status_r)

    def _own_child(self, pid: object) -> tuple[int, int]:
        """A pidfd of `pid` once it is checked to be our server's child, running as its uid
        (the server runs project code: it must not make the host touch another process)."""
        if not isinstance(pid, int) or pid <= 0:
            raise ForkServerUnavailable(f"the fork server named no process: {pid!r}")
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise ForkServerUnavailable(f"the forked process {pid} is gone") from None
        try:  # read after the pidfd pinned the process
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
        except (OSError, ValueError):
            fields = {}
        uids = fields.get("Uid", "").split()
        gone = has_exited(pidfd)  # then that status was another's
        if (
            gone
            or fields.get("PPid", "").strip() != str(self.proc.pid)
            or uids != [str(self.uid)] * 4
        ):
            os.close(pidfd)
            self.close()
            raise ForkServerUnavailable(f"the fork server named {pid}, which is not its child")
        return pid, pidfd

    async def _send(self, msg: dict[str, Any], fds: list[int]) -> None:
        data = json.dumps(msg).encode()
        while True:
            try:
                socket.send_fds(self.sock, [data], fds)
                return
            except BlockingIOError:
                await anyio.wait_writable(self.sock)

    async def _recv(self) -> dict[str, Any]:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
                break
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
        for fd in fds:  # the server has nothing to hand us
            os.close(fd)
        if not data:
            raise ForkServerUnavailable("the fork server exited")
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError(f"not a reply: {reply!r}")
        return reply

    def close(self) -> None:
        """Kill the server (the commands it started run on)."""
        self.dead = True
        self.proc.kill()
        self.sock.close()
        self._kept.release()


class ForkedProcess(launcher.SandboxProcess):
    """A command a fork server started: its exit code comes from its launcher's status pipe."""

    def __init__(
        self, pid: int, pidfd: int, loop: asyncio.AbstractEventLoop, status: int, got: bytes
    ) -> None:
        super().__init__(pid, pidfd, loop)
        self._loop = loop
        self._status: int | None = status
        self._got = bytearray(got)
        os.set_blocking(status, False)
        loop.add_reader(status, self._readable)

    def _readable(self) -> None:
        assert self._status is not None
        try:
            chunk = os.read(self._status, 64)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self._got += chunk
            return
        self._loop.remove_reader(self._status)
        os.close(self._status)
        self._status = None
        # No code: the launcher was killed (with it, the command, by its parent-death signal).
        code = struct.unpack("=i", self._got[:4])[0] if len(self._got) >= 4 else -signal.SIGKILL
        self._exited(code)


def shared_writable_mappings(pid: int) -> list[str]:
    """The mappings of process `pid` that its forks would share and could write (`rw-s`)."""
    with open(f"/proc/{pid}/maps") as maps:
        rows = [line.split(maxsplit=5) for line in maps]
    return [" ".join(r[5:]).strip() or r[0] for r in rows if r[1][:2] == "rw" and r[1][3] == "s"]


def _move(pid: int, cgroup: Join) -> None:
    """Move the (single-threaded) launcher into the command's cgroups, before it may fork."""
    for tasks in cgroup.v1_tasks:
        with open(tasks, "w") as f:
            f.write(str(pid))
    if cgroup.v2_dir is not None:
        with open(f"{cgroup.v2_dir}/cgroup.procs", "w") as f:
            f.write(str(pid))


class ForkServers:
    """The fork servers of one interpreter and preload, in one host sandbox: one per kind of
    command (uid range, user, environment), started on first use.

    Pass it as `spawner` to `BwrapSandbox.run` (or `LocalSandbox.exec_forked`).
    """

    def __init__(
        self,
        host: BwrapSandbox,
        *,
        python: str,
        cwd: str,
        preload: tuple[str, list[Any]] | None = None,
    ) -> None:
        self.host = host
        self.python = python
        self.cwd = cwd
        self.preload = preload
        self._servers: dict[str, ForkServer] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._failures: dict[str, int] = {}
        self.closed = False

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        fds: Sequence[int],
        cgroup: Join,
        enter: dict[str, Any],
        enter_pidfd: int,
        **_: Any,
    ) -> launcher.SandboxProcess:
        """`launcher.Spawner.spawn`'s contract for `enter` requests, through a fork server.

        Raises:
            ForkServerUnavailable: no server can run it (run it cold); nothing ran.
            OSError: the sandbox's pid 1 is gone.
        """
        if argv[:1] != [self.python]:
            raise ForkServerUnavailable(f"these fork servers run {self.python}, not {argv[:1]}")
        uid = owner_uid(enter_pidfd)
        key = json.dumps([uid, enter, env], sort_keys=True)
        server = await self._server(key, uid, env)
        try:
            return await server.spawn(
                argv,
                fds=fds,
                cgroup=cgroup,
                enter=enter,
                enter_pidfd=enter_pidfd,
                cwd=self.cwd,
            )
        finally:
            if server.dead and self._servers.get(key) is server:
                del self._servers[key]

    async def _server(self, key: str, uid: int, env: dict[str, str]) -> ForkServer:
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            server = self._servers.get(key)
            if server is not None and not server.dead:
                self._servers[key] = self._servers.pop(key)  # most recently used last
                return server
            if self.closed:
                raise ForkServerUnavailable("the fork servers are closed")
            if self._failures.get(key, 0) >= MAX_STARTS:
                raise ForkServerUnavailable("the fork server failed to start too often")
            try:
                # Its imports see the environment the commands get (never a rollout's data).
                server = await ForkServer.start(
                    self.host, uid=uid, python=self.python, cwd=self.cwd, env=env,
                    preload=self.preload,
                )  # fmt: skip
            except ForkServerUnavailable as e:
                self._failures[key] = self._failures.get(key, 0) + 1
                log.warning("%s; running commands cold", e)
                raise
            if self.closed:
                server.close()
                raise ForkServerUnavailable("the fork servers are closed")
            self._servers[key] = server
            while len(self._servers) > MAX_SERVERS:
                self._servers.pop(next(iter(self._servers))).close()
            return server

    def servers(self) -> list[ForkServer]:
        return list(self._servers.values())

    def close(self) -> None:
        """Kill every server (commands they started run on, in their own sandboxes)."""
        self.closed = True
        for server in self._servers.values():
            server.close()
        self._servers.clear()
