"""The sandbox's seccomp filter: kernel surface no task needs, closed the way Docker's default is.

Sandbox root holds every capability inside its user namespace, so what Docker's default profile
keeps out by dropping capabilities (mounts, new namespaces) and by its syscall list (keyrings,
io_uring, bpf, perf, kexec, modules) is closed here by one filter. On top of that: typing into
a terminal (TIOCSTI, TIOCLINUX) and creating user namespaces (nested ones are a steady source of
kernel bugs, and a way around the uid map). ptrace stays allowed, as in Docker on any recent
kernel: strace and gdb work inside; only the sandbox's pid 1 may not be traced, have its memory
read or written, or its limits set (ptrace, process_vm_readv/writev, prlimit64 with pid 1; the
launcher also hides /proc/1/mem): through those root inside could end the sandbox, even with the
SIGKILL the host's own kill sends, and pass its failure off as the infrastructure's.

The filter is compiled by libseccomp (through pyseccomp) into classic BPF, once per process;
bubblewrap loads it into the sandbox's pid 1 (`--seccomp FD`) and the spawner into every process
that enters the sandbox. Denied calls fail with EPERM (clone3 with ENOSYS, so libc falls back to
clone, whose flags a filter can read).
"""

from __future__ import annotations

import errno
import functools
import os
import platform

import pyseccomp as sc

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
CLONE_NEWUSER = 0x10000000

DENIED = (
    # keyrings: shared per host uid, outside any namespace
    "add_key",
    "keyctl",
    "request_key",
    # io_uring: a large, often-patched attack surface that Docker and Podman close
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # the kernel itself: programs, modules, a new kernel, tracing of other processes' events
    "bpf",
    "perf_event_open",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    # mounts and namespaces: root inside may not rearrange its own mount tree
    "mount",
    "umount2",
    "umount",  # i386 only (int 0x80, nr 22): the same unmount without flags
    "pivot_root",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "setns",
    # host-wide state
    "open_by_handle_at",
    "userfaultfd",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "lookup_dcookie",
)


@functools.cache
def program() -> bytes:
    """The compiled filter: classic BPF instructions, as `--seccomp FD` and PR_SET_SECCOMP take."""
    flt = sc.SyscallFilter(sc.ALLOW)
    if platform.machine() == "x86_64":  # 32-bit programs still run, under the same rules
        flt.add_arch(sc.Arch.X86)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        flt.add_rule(deny, name)
    for request in (TIOCSTI, TIOCLINUX):
        flt.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    flt.add_rule(deny, "unshare", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    # clone's flags are its first argument on x86 and arm64 (s390 swaps them; not a target).
    flt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    # Pid 1 only (ptrace's pid is its second argument, the others' the first); prlimit64,
    # because a CPU limit on pid 1 would have the kernel SIGKILL it.
    flt.add_rule(deny, "ptrace", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, 1))
    for name in ("process_vm_readv", "process_vm_writev", "prlimit64"):
        flt.add_rule(deny, name, sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, 1))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags in memory: unreadable to a filter
    out = os.memfd_create("sandbox-seccomp", os.MFD_CLOEXEC)
    try:
        flt.export_bpf(_Fd(out))
        return os.pread(out, os.fstat(out).st_size, 0)
    finally:
        os.close(out)


def syscall_number(name: str) -> int:
    """This machine's number of a syscall (the spawner makes keyctl calls by number)."""
    return sc.resolve_syscall(sc.Arch.NATIVE, name)


class _Fd:
    """What `export_bpf` writes to: anything with a fileno()."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd
