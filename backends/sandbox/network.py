"""Public network for a sandbox: its own network namespace with a NAT'd uplink (slirp4netns).

Why not the host's network namespace: there a sandbox could reach every service bound to the
host's loopback (the trainer's inference server, the relay's admin side), and two sandboxes
would share one port space (two relay forwarders on the same port, one sandbox's policy
calls landing in another's rollout). With slirp4netns each sandbox keeps its own loopback and
ports and reaches the outside through user-mode NAT, with the host's loopback cut off
(`--disable-host-loopback`). slirp4netns itself runs sandboxed and under seccomp; it is
killed at stop and exits on its own when its owner dies (its exit fd closes).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import anyio

from backends.sandbox import launcher
from backends.sandbox.errors import HostPrerequisiteError, SandboxStartError
from backends.sandbox.settings import run_dir

RESOLVER = "10.0.2.3"  # slirp4netns's DNS forwarder, to the host's resolvers
READY_TIMEOUT_SEC = 10.0


def require_slirp() -> str:
    """The path of slirp4netns.

    Raises:
        HostPrerequisiteError: not installed.
    """
    path = shutil.which("slirp4netns")
    if path is None:
        raise HostPrerequisiteError(
            "network_mode = 'public' needs slirp4netns for the sandbox's own NAT'd network: "
            "apt-get install -y slirp4netns"
        )
    return path


def resolv_conf() -> str:
    """A resolv.conf naming slirp4netns's DNS forwarder (bound into public sandboxes)."""
    path = run_dir() / ".resolv.conf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".resolv.conf.{os.getpid()}")
        tmp.write_text(f"nameserver {RESOLVER}\n")
        tmp.rename(path)
    return str(path)


@dataclass
class Uplink:
    process: launcher.SandboxProcess
    exit_fd: int  # slirp4netns exits when this closes (also when its owner dies)

    def close(self) -> None:
        """Stop slirp4netns (without waiting for it)."""
        fd, self.exit_fd = self.exit_fd, -1
        if fd >= 0:
            os.close(fd)
        self.process.kill()


async def connect(booted: launcher.Booted) -> Uplink:
    """Attach a NAT'd `tap0` to the network namespace of the booted sandbox.

    Raises:
        SandboxStartError: slirp4netns failed or did not become ready (its stderr included).
    """
    slirp = require_slirp()
    # By namespace fd, not pid: a pid number could be reused by a host process.
    try:
        netns = booted.open_namespace("net")
    except ProcessLookupError as e:
        raise SandboxStartError(f"sandbox died before its network came up: {e}") from e
    exit_r, exit_w = os.pipe()
    ready_r, ready_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    argv = [
        slirp, "--configure", "--mtu=65520", "--disable-host-loopback", "--enable-sandbox",
        "--enable-seccomp", "--exit-fd=3", "--ready-fd=4", "--netns-type=path",
        "/proc/self/fd/5", "tap0",
    ]  # fmt: skip
    try:
        try:
            proc = await launcher.spawner().spawn(
                argv,
                env=launcher.BOOT_ENV,
                fds=(null, null, err_w, exit_r, ready_w, netns),
            )
        finally:
            for fd in (null, exit_r, ready_w, err_w, netns):
                os.close(fd)
        try:
            with anyio.move_on_after(READY_TIMEOUT_SEC):
                if b"1" in await launcher.read_fd(ready_r, lambda b: b"1" in b):
                    return Uplink(proc, exit_w)
                await proc.wait()  # it closed the ready fd without saying ready: it failed
                err = (await launcher.read_fd(err_r)).decode(errors="replace").strip()
                raise SandboxStartError(
                    f"slirp4netns failed (exit {proc.returncode}): {err or 'no output'}"
                )
            raise SandboxStartError(f"slirp4netns was not ready within {READY_TIMEOUT_SEC} s")
        except BaseException:
            proc.kill()
            raise
    except BaseException:
        os.close(exit_w)
        raise
    finally:
        os.close(ready_r)
        os.close(err_r)
