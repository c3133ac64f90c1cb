"""Start a fork server (`forkserver_process`): the few steps that need host root, then exec.

Run by the spawner as host root, in the host sandbox's cgroup, as
`python -I -S forkserver_enter.py CONFIG` with the host sandbox's pid 1 as a pidfd on fd 3 and
the server's control socket on fd 4. CONFIG is JSON: {"uid", "gid", "keyctl", "cwd", "argv",
"env"}. It joins the host sandbox's mount, network, ipc and uts namespaces (not its user or
pid namespace: the server must stay where it may enter other sandboxes from), drops to `uid`
and `gid` with no supplementary groups and no capabilities, joins a session keyring of its own
(the spawner's is host root's), sets no_new_privs and execs `argv` there with `env` alone, the
control socket on fd 3.

Nothing here may import the project: it runs with `-I -S`, standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
KEYCTL_JOIN_SESSION_KEYRING = 1
HOST_FD, CONTROL_FD = 3, 4


def main() -> None:
    config = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    # Through the pidfd: if that pid 1 is gone this fails, rather than reach a reused number.
    os.setns(HOST_FD, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    os.close(HOST_FD)
    os.chdir(config["cwd"])  # joining the mount namespace put us at its root
    os.setgroups([])
    os.setresgid(config["gid"], config["gid"], config["gid"])
    os.setresuid(config["uid"], config["uid"], config["uid"])
    if libc.syscall(config["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None, 0, 0, 0) < 0:
        raise OSError(ctypes.get_errno(), "keyctl(JOIN_SESSION_KEYRING)")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.dup2(CONTROL_FD, 3)
    os.close(CONTROL_FD)
    os.execve(config["argv"][0], config["argv"], config["env"])


if __name__ == "__main__":
    main()
