"""The fork server's own process: an interpreter that imported a workflow once and forks each
command into the live sandbox the host names (the host side: `backends.sandbox.forkserver`).

Started by `forkserver_enter.py` as `python -m backends.sandbox.forkserver_process CONFIG`: as
the host uid that owns the sandboxes it serves (the leased range's root), with no capability,
no_new_privs, a session keyring of its own, in the mount, network, ipc and uts namespaces of a
sandbox of its own (no host filesystem, no network), and in that sandbox's cgroup. CONFIG is
JSON: {"seccomp": hex, "keyctl": syscall number, "preload": ["module:function", [args]]}.
It calls the preload (importing the workflow), says {"ready": true} on fd 3 (SOCK_SEQPACKET)
and then serves one request at a time; EOF on fd 3 ends it.

Per request `{"module", "args", "cwd", "uid", "gid", "groups"}` with the fds stdin,
stdout, stderr, status, go, and the sandbox's user, mnt, net, ipc, uts and pid namespaces, it
forks a *launcher* and answers `{"pid"}` (or `{"error"}`). It holds nothing of the request
after that: no rollout's data ever stays in this process. The launcher, once the host has moved
it into the sandbox's cgroups and written "G" on `go`, joins the namespaces (the user namespace
first: as its owner it may), forks the *command* into the sandbox's pid namespace, writes "S"
on `status`, waits for it and writes its exit code there (4 bytes). A launcher that fails
writes "E" and the reason instead. The command gets what an exec in the sandbox gets: a new
session, its own session keyring, no_new_privs and the sandbox's seccomp filter, the user's
ids and groups, fds 0-2 alone, and this process's environment (the host starts one server per
environment, with that environment alone); then it runs like
`python -m module args...` in `cwd`. It dies with its launcher (parent-death signal), which
only the host can name: neither is in the sandbox's pid namespace.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import sys
import threading
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
# The user namespace first: joining it as its owner gives the capabilities the others need.
NAMESPACES = (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWPID)
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
KEYCTL_JOIN_SESSION_KEYRING = 1
CONTROL_FD = 3
REQUEST_FDS = 5 + len(NAMESPACES)  # stdin, stdout, stderr, status, go, the namespaces
MAX_FD_NUMBER = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class Server:
    def __init__(self, sock: socket.socket, config: dict) -> None:
        self.sock = sock
        program = bytes.fromhex(config["seccomp"])
        self.program = ctypes.create_string_buffer(program, len(program))
        self.fprog = _SockFprog(len(program) // 8, ctypes.addressof(self.program))
        self.keyctl = int(config["keyctl"])

    def serve(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, REQUEST_FDS + 1)
            except OSError:
                data, fds = b"", []
            if not data:
                os._exit(0)  # the host is done (or gone)
            try:
                req = json.loads(data)
                if len(fds) != REQUEST_FDS:
                    raise ValueError(f"expected {REQUEST_FDS} fds, got {len(fds)}")
                pid = os.fork()
            except (OSError, ValueError) as e:
                for fd in fds:
                    os.close(fd)
                self.sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                continue
            if pid == 0:
                self.launcher(req, fds)  # never returns
            for fd in fds:
                os.close(fd)
            self.sock.send(json.dumps({"pid": pid}).encode())

    def launcher(self, req: dict, fds: list[int]) -> None:
        """In the forked launcher: enter the sandbox, fork the command, report. Never returns."""
        status = fds[3]
        try:
            # Host-uid credentials in the sandbox's user namespace with every capability in
            # it: nothing inside may trace this process or read its memory.
            _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(self.sock.detach())  # the server's socket never enters the sandbox
            _close_all_but(set(fds))
            stdio, go, namespaces = fds[:3], fds[4], fds[5:]
            if os.read(go, 1) != b"G":  # the host moved us into the cgroups, or gave up
                os._exit(1)
            os.close(go)
            for fd, kind in zip(namespaces, NAMESPACES, strict=True):
                os.setns(fd, kind)
                os.close(fd)
            pid = os.fork()  # into the sandbox's pid namespace
            if pid == 0:
                self.command(req, stdio, status)  # never returns
            os.write(status, b"S")
            for fd in stdio:
                os.close(fd)
            _, code = os.waitpid(pid, 0)
            os.write(status, struct.pack("=i", os.waitstatus_to_exitcode(code)))
        except BaseException as e:
            try:
                os.write(status, b"E" + f"{type(e).__name__}: {e}".encode(errors="replace"))
            except OSError:
                pass
        os._exit(0)

    def command(self, req: dict, stdio: list[int], status: int) -> None:
        """In the command, forked into the sandbox: harden like an exec, then run. Never returns."""
        try:
            os.close(status)
            os.setsid()
            # As sandbox root: a session keyring of its own (the filter denies keyctl after).
            ret = _libc.syscall(self.keyctl, KEYCTL_JOIN_SESSION_KEYRING, None, 0, 0, 0)
            if ret < 0:
                _check(ret, "keyctl(JOIN_SESSION_KEYRING)")
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
            _check(
                _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self.fprog), 0, 0),
                "prctl(PR_SET_SECCOMP)",
            )
            os.setgroups(req["groups"])
            os.setresgid(req["gid"], req["gid"], req["gid"])
            os.setresuid(req["uid"], req["uid"], req["uid"])
            # After the id change, which clears both: die with the launcher; and be as
            # traceable by the sandbox's own processes as any process exec'd there.
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
            if os.getppid() != 0:  # the launcher (outside) died already: pid 1 adopted us
                os._exit(126)
            _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
            for number, fd in enumerate(stdio):
                os.dup2(fd, number)
            os.closerange(3, MAX_FD_NUMBER)
            os.chdir(req["cwd"])
        except BaseException as e:
            os.write(2, f"fork server: {type(e).__name__}: {e}\n".encode(errors="replace"))
            os._exit(126)
        os._exit(_run_module(req["module"], req["args"]))


def _run_module(module: str, args: list[str]) -> int:
    """`python -m module args...` in this interpreter; its exit code."""
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What an interpreter's exit does: join threads, run exit handlers, flush.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _close_all_but(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, MAX_FD_NUMBER)


def _preload(spec: list) -> None:
    target, args = spec
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers report to the host, not to us
    sock = socket.socket(fileno=CONTROL_FD)
    config = json.loads(sys.argv[1])
    try:
        if config.get("preload"):
            _preload(config["preload"])
        if threading.active_count() != 1:
            raise RuntimeError("the preload started threads: forking this process is unsafe")
        # What the preload built stays out of every collection in the forks: a collection
        # there would write to (and so copy) every page of it.
        gc.collect()
        gc.freeze()
        server = Server(sock, config)
    except BaseException:
        sock.send(json.dumps({"error": traceback.format_exc()[-4000:]}).encode())
        os._exit(1)
    sock.send(json.dumps({"ready": True}).encode())
    server.serve()


if __name__ == "__main__":
    main()
