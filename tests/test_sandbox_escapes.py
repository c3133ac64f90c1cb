"""Escapes an adversarial review found in the local sandbox, each replayed as root inside.

Every test here reproduces one attack of issue 9 the way the review ran it and checks that the
host is left unharmed; on the code before the fix each of them failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harbor.environments.base import BaseEnvironment
from host_support import marked, unique_marker

from backends.sandbox.contract import PROVIDERS
from backends.sandbox.errors import SandboxPathError, SandboxStartError
from backends.sandbox.unpack import PARSED_FILE_LIMITS, DownloadTooLargeError

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]
LOCAL = PROVIDERS[0]
MiB = 1024 * 1024


# Files cross either way: by the host through the sandbox's root, or by `tar` inside.
TRANSFERS = ["host", "tar"]
# For tests of what a hostile `tar` inside can do to the host: only that path runs it.
TAR_ONLY = pytest.mark.parametrize("env", ["tar"], indirect=True)


@pytest.fixture(params=TRANSFERS)
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BaseEnvironment]:
    kwargs = {"max_download_bytes": 8 * MiB, "host_transfers": request.param == "host"}
    sandbox = LOCAL.make(tmp_path, kwargs=kwargs)
    await sandbox.start(force_build=False)
    try:
        yield sandbox
    finally:
        await sandbox.stop(delete=True)


async def run_python(env: BaseEnvironment, tmp_path: Path, source: str, *args: str) -> str:
    """Run a Python script as root inside the sandbox; returns its stdout."""
    script = tmp_path / f"probe-{uuid.uuid4().hex[:8]}.py"
    script.write_text(source)
    await env.upload_file(script, f"/probe/{script.name}")
    res = await env.exec(f"python3 /probe/{script.name} {' '.join(args)}", user="root")
    assert res.return_code == 0, res.stderr
    return res.stdout


async def fake_tar(env: BaseEnvironment, body: str) -> None:
    """Root inside decides what `tar` is: put a script first on the PATH."""
    assert not getattr(env, "host_transfers", False), "a fake tar needs the tar path (TAR_ONLY)"
    res = await env.exec(
        f"printf '%s' {_sh_quote(body)} > /usr/local/sbin/tar && chmod +x /usr/local/sbin/tar"
    )
    assert res.return_code == 0, res.stderr


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A host directory outside any download target, with a 0600 file in it."""
    d = Path(f"/var/tmp/backends-victim-{uuid.uuid4().hex[:8]}")
    d.mkdir()
    (d / "victim").write_text("host secret\n")
    (d / "victim").chmod(0o600)
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    d.rmdir()


# Laid out like CVE-2025-4517: long directory names reached through one-letter symlinks, a
# chain of `../` past PATH_MAX that a non-strict realpath stops resolving, a link out through
# it, then a hard link and a regular file written through that link.
PATH_MAX_ARCHIVE = r"""
import io, os, sys, tarfile
victim_dir = sys.argv[1]
comp = "d" * 247
steps = "abcdefghijklmnop"
with tarfile.open("/crafted.tar", "w") as tar:
    def add(name, kind, linkname="", data=None):
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, linkname, 0o644
        if data is not None:
            info.size = len(data)
        tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path = ""
    for step in steps:
        add(os.path.join(path, comp), tarfile.DIRTYPE)
        add(os.path.join(path, step), tarfile.SYMTYPE, comp)
        path = os.path.join(path, comp)
    linkpath = os.path.join("/".join(steps), "l" * 254)
    add(linkpath, tarfile.SYMTYPE, "../" * len(steps))
    # Lexically a path inside the target; resolved, "l..." is the target itself, so the
    # ".."s climb from there to / and on into the host directory.
    add("escape", tarfile.SYMTYPE, linkpath + "/.." * len(steps) + victim_dir)
    add("victim-link", tarfile.LNKTYPE, "escape/victim")
    add("victim-link", tarfile.REGTYPE, data=b"owned by the sandbox\n")
    add("escape/new-file", tarfile.REGTYPE, data=b"planted\n")
"""


@TAR_ONLY
async def test_a_crafted_archive_past_path_max_writes_nothing_outside(
    env: BaseEnvironment, tmp_path: Path, host_dir: Path
) -> None:
    await run_python(env, tmp_path, PATH_MAX_ARCHIVE, str(host_dir))
    await fake_tar(env, "#!/bin/sh\nexec cat /crafted.tar\n")
    out = tmp_path / "out"
    try:
        await env.download_dir("/logs/verifier", out)
    except SandboxPathError:
        pass  # refusing the archive is fine; what matters is the host below
    victim = host_dir / "victim"
    assert victim.read_text() == "host secret\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert os.listdir(host_dir) == ["victim"]
    assert not (out / "escape").is_symlink()


@TAR_ONLY
async def test_a_daemon_holding_the_download_pipe_cannot_write_past_the_cap(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    # A daemon from an earlier exec receives the download's stdout over an abstract socket
    # and writes 200 MiB into it, then keeps writing after the download returned.
    daemon = r"""
import os, socket, sys, time
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0fd-thief")
srv.listen()
if os.fork():
    os._exit(0)
os.setsid()
conn, _ = srv.accept()
_, fds, _, _ = socket.recv_fds(conn, 1, 1)
conn.close()
written, block = 0, b"x" * (1 << 20)
error = "none"
try:
    for _ in range(200):
        written += os.write(fds[0], block)
    time.sleep(1)  # the call has returned by now: try again
    written += os.write(fds[0], block)
except OSError as e:
    error = e.strerror
open("/thief.log", "w").write(f"{written} {error}")
"""
    await run_python(env, tmp_path, daemon)
    sender = r"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0fd-thief")
socket.send_fds(s, [b"x"], [1])
"""
    (tmp_path / "send.py").write_text(sender)
    await env.upload_file(tmp_path / "send.py", "/send.py")
    await fake_tar(env, "#!/bin/sh\npython3 /send.py\nsleep 2\n")
    with pytest.raises(DownloadTooLargeError, match="larger than 8388608 bytes"):
        await env.download_file("/etc/hostname", tmp_path / "got")
    res = await env.exec(
        "for i in $(seq 50); do test -e /thief.log && break; sleep 0.1; done; cat /thief.log"
    )
    written, error = res.stdout.split(" ", 1)
    assert int(written) <= 9 * MiB, "the daemon wrote past the cap"
    assert error == "Broken pipe"
    assert not (tmp_path / "got").exists()


@TAR_ONLY
async def test_the_upload_archive_reaches_the_sandbox_read_only(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    thief = r"""
import os, sys
try:
    os.write(0, b"x" * 4096)
    print("wrote")
except OSError as e:
    print(e.strerror)
try:
    os.open(f"/proc/self/fd/0", os.O_WRONLY)
    print("reopened")
except OSError as e:
    print(e.strerror)
"""
    (tmp_path / "thief.py").write_text(thief)
    await env.upload_file(tmp_path / "thief.py", "/thief.py")
    await fake_tar(env, "#!/bin/sh\nexec python3 /thief.py > /thief.log 2>&1\n")
    (tmp_path / "payload").write_text("payload")
    try:
        await env.upload_file(tmp_path / "payload", "/payload")
    except OSError:
        pass
    res = await env.exec("cat /thief.log")
    assert res.stdout.split("\n")[:2] == ["Bad file descriptor", "Permission denied"], res.stdout


async def test_sparse_files_count_at_their_apparent_size(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await env.exec("truncate -s 1T /logs/agent/huge && truncate -s 3G /logs/verifier/reward.txt")
    with pytest.raises(DownloadTooLargeError, match="full size"):
        await env.download_dir("/logs/agent", tmp_path / "agent")
    with pytest.raises(DownloadTooLargeError, match=r"reward\.txt"):
        await env.download_dir("/logs/verifier", tmp_path / "verifier")
    # Each parsed file's limit holds even where the total cap would allow more.
    limit = PARSED_FILE_LIMITS["reward.txt"]
    await env.exec(
        f"rm /logs/verifier/reward.txt; truncate -s {limit + 1} /logs/verifier/reward.txt"
    )
    with pytest.raises(DownloadTooLargeError, match="at most 1048576 bytes"):
        await env.download_file("/logs/verifier/reward.txt", tmp_path / "reward.txt")
    assert not (tmp_path / "reward.txt").exists()
    await env.exec(f"truncate -s {limit} /logs/verifier/reward.txt")
    await env.download_file("/logs/verifier/reward.txt", tmp_path / "reward.txt")
    assert (tmp_path / "reward.txt").stat().st_size == limit


async def test_downloads_leave_other_host_entries_alone(
    env: BaseEnvironment, tmp_path: Path, host_dir: Path
) -> None:
    target = tmp_path / "trial"
    target.mkdir()
    (target / "outside-link").symlink_to(host_dir)  # the host's own, pointing outside
    await env.exec("echo x > /logs/agent/x.txt")
    await env.download_file("/logs/agent/x.txt", target / "x.txt")
    await env.download_dir("/logs/agent", target)
    assert (target / "outside-link").is_symlink()
    assert (target / "x.txt").read_text() == "x\n"


async def test_no_world_writable_modes_land_on_the_host(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await env.exec(
        "cd /logs/agent && touch a b && chmod 0777 a && chmod 0666 b && mkdir -p t && chmod 1777 t"
        " && touch t/c && chmod 6777 t/c"
    )
    out = tmp_path / "agent"
    await env.download_dir("/logs/agent", out)
    modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in out.rglob("*")}
    assert modes == {"a": 0o755, "b": 0o644, "t": 0o755, "c": 0o755}
    await env.download_file("/logs/agent/b", tmp_path / "single")
    assert stat.S_IMODE((tmp_path / "single").stat().st_mode) == 0o644


# -- terminals, keyrings, kernel surface ----------------------------------------------------

TTY_OWNER = r"""
import anyio, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from backends.sandbox.contract import PROVIDERS
PROBE = '''
import fcntl, os, termios
try:
    fd = os.open("/dev/tty", os.O_RDWR)
except OSError as e:
    print("open", e.errno)
else:
    try:
        for ch in "echo pwned" + chr(10):
            fcntl.ioctl(fd, termios.TIOCSTI, ch.encode())
        print("typed")
    except OSError as e:
        print("ioctl", e.errno)
'''
async def main():
    env = PROVIDERS[0].make(Path(sys.argv[2]))
    await env.start(force_build=False)
    try:
        res = await env.exec(f"python3 -c '{PROBE}'")
        Path(sys.argv[3]).write_text(res.stdout + res.stderr)
    finally:
        await env.stop(delete=True)
anyio.run(main)
"""


def test_commands_have_no_controlling_terminal(tmp_path: Path) -> None:
    """Run from a terminal (as `harbor run` is), a sandbox must not type into it."""
    import fcntl
    import pty
    import subprocess
    import sys
    import termios

    master, slave = pty.openpty()

    def take_terminal() -> None:  # the owner's terminal becomes its controlling terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    result = tmp_path / "result"
    repo = str(Path(__file__).resolve().parents[1])
    owner = subprocess.run(
        [sys.executable, "-c", TTY_OWNER, repo, str(tmp_path), str(result)],
        stdin=slave, stdout=slave, stderr=slave, preexec_fn=take_terminal, timeout=120,
    )  # fmt: skip
    os.close(slave)
    os.set_blocking(master, False)
    try:
        typed = os.read(master, 65536)
    except OSError:
        typed = b""
    os.close(master)
    assert owner.returncode == 0, typed
    assert result.read_text().split() == ["open", "6"]  # ENXIO: no controlling terminal
    assert b"pwned" not in typed


KEYCTL_READ, KEY_SPEC_SESSION_KEYRING = 11, -3


def _keyctl_numbers() -> tuple[int, int]:
    from backends.sandbox.seccomp import syscall_number

    return syscall_number("keyctl"), syscall_number("add_key")


async def test_the_owners_keyring_is_out_of_reach(env: BaseEnvironment, tmp_path: Path) -> None:
    import ctypes

    keyctl, add_key = _keyctl_numbers()
    libc = ctypes.CDLL(None, use_errno=True)
    secret = f"host-{uuid.uuid4().hex}".encode()
    serial = libc.syscall(
        add_key, b"user", b"backends-probe", secret, len(secret), KEY_SPEC_SESSION_KEYRING
    )
    assert serial > 0, os.strerror(ctypes.get_errno())
    try:
        probe = f"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(256)
n = libc.syscall({keyctl}, {KEYCTL_READ}, {serial}, buf, 256)
print("read", buf.raw[:n] if n > 0 else errno.errorcode[ctypes.get_errno()])
n = libc.syscall({add_key}, b"user", b"planted", b"x", 1, {KEY_SPEC_SESSION_KEYRING})
print("add", n if n > 0 else errno.errorcode[ctypes.get_errno()])
"""
        out = await run_python(env, tmp_path, probe)
        assert secret.decode() not in out
        assert out.split("\n")[:2] == ["read EPERM", "add EPERM"], out
    finally:
        libc.syscall(keyctl, 3, serial)  # KEYCTL_REVOKE


async def test_kernel_surface_is_filtered(env: BaseEnvironment, tmp_path: Path) -> None:
    from backends.sandbox.seccomp import syscall_number

    calls = {
        name: syscall_number(name)
        for name in ("io_uring_setup", "bpf", "perf_event_open", "kexec_load", "clone3")
    }
    probe = f"""
import ctypes, errno, fcntl, os, termios
libc = ctypes.CDLL(None, use_errno=True)
for name, nr in {calls!r}.items():
    ret = libc.syscall(nr, 0, 0, 0, 0, 0)
    print(name, errno.errorcode.get(ctypes.get_errno(), ret) if ret < 0 else "ok")
master, slave = os.openpty()  # a terminal of the sandbox's own: still no typing into it
try:
    fcntl.ioctl(slave, termios.TIOCSTI, b"x")
    print("tiocsti ok")
except OSError as e:
    print("tiocsti", errno.errorcode[e.errno])
"""
    out = await run_python(env, tmp_path, probe)
    assert out.split("\n")[:6] == [
        "io_uring_setup EPERM",
        "bpf EPERM",
        "perf_event_open EPERM",
        "kexec_load EPERM",
        "clone3 ENOSYS",
        "tiocsti EPERM",
    ], out
    res = await env.exec("unshare -U true; mount -t tmpfs none /mnt; echo done")
    assert "unshare failed: Operation not permitted" in res.stderr, res.stderr
    assert "mount: /mnt: permission denied" in res.stderr, res.stderr
    # What tasks do keeps working: threads, namespaces other than user ones, su, ptrace (of
    # anything but pid 1); no no_new_privs on commands (bwrap sets it on pid 1 only).
    res = await env.exec(
        "python3 -c 'import threading; t = threading.Thread(target=print); t.start(); t.join()'"
        " && unshare -n true && su nobody -s /bin/sh -c 'id -u'"
        " && grep NoNewPrivs /proc/self/status"
        " && { sleep 60 & child=$!; python3 -c 'import ctypes, sys; p = ctypes.CDLL(None).ptrace;"
        " print(p(0x4206, int(sys.argv[1]), 0, 0), p(0x4206, 1, 0, 0))' $child; kill $child; }"
    )
    assert res.return_code == 0, res.stderr
    assert res.stdout.split("\n")[1:4] == ["65534", "NoNewPrivs:\t0", "0 -1"], res.stdout


# Calls the i386 entry point (int 0x80) from a 64-bit process: syscall number, then args.
I386_UMOUNT = r"""
import ctypes, errno, mmap
code = bytes.fromhex("53" "89f8" "89f3" "4989cb" "89d1" "4489da" "4489c6" "4489cf" "cd80" "5b" "c3")
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
i386 = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_uint] * 6)(
    ctypes.addressof(ctypes.c_char.from_buffer(buf))
)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
low = libc.mmap(None, 4096, 3, 0x22 | 0x40, -1, 0)  # MAP_32BIT: an address i386 args can hold
(ctypes.c_char * 16).from_address(low).value = b"/dev/shm"
ret = i386(22, low, 0, 0, 0, 0)  # umount("/dev/shm")
print(errno.errorcode.get(-ret, ret) if ret < 0 else "unmounted")
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the i386 entry point is x86's")
async def test_the_i386_umount_is_filtered(env: BaseEnvironment, tmp_path: Path) -> None:
    out = await run_python(env, tmp_path, I386_UMOUNT)
    assert out.strip() == "EPERM", out


# -- the sandbox ends with its owner ---------------------------------------------------------

HIJACK = Path(__file__).with_name("pid1_hijack.py")

OWNER = r"""
import anyio, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from backends.sandbox.contract import PROVIDERS
async def main():
    tmp = Path(sys.argv[2])
    env = PROVIDERS[0].make(tmp)
    await env.start(force_build=False)
    await env.upload_file(tmp / "hijack.py", "/hijack.py")
    res = await env.exec("python3 /hijack.py /bin/sleep 4242;"
                         f" (setsid nohup sleep {sys.argv[3]} >/dev/null 2>&1 &); sleep 0.5")
    print(env._box._booted.init_pid, res.stdout.strip().replace("\n", " "), res.stderr.strip().replace("\n", " "), flush=True)
    await anyio.sleep(1000)
anyio.run(main)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe injects x86_64 syscalls")
def test_root_inside_can_neither_seize_pid_1_nor_outlive_the_owner(tmp_path: Path) -> None:
    """Root inside once ptraced pid 1 into `sleep` (outliving the owner's closed pipe, and
    the kill before grading); now pid 1 cannot be traced, and a daemon dies with the owner."""
    import signal
    import subprocess
    import sys
    import time

    shutil.copy(HIJACK, tmp_path / "hijack.py")
    repo = str(Path(__file__).resolve().parents[1])
    marker = unique_marker()  # the daemon's: no other suite on the host runs it
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, repo, str(tmp_path), marker],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    try:
        line = owner.stdout.readline().split()
    finally:
        os.kill(owner.pid, signal.SIGKILL)  # whatever it said: never left running
        owner.wait()
    assert line[1:3] == ["refused", "EPERM"], line
    init_pid = int(line[0])
    deadline = time.monotonic() + 10
    while _alive(init_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = _alive(init_pid)
    if survived:  # do not leave it to the other tests
        os.kill(init_pid, signal.SIGKILL)
    assert not survived, "the sandbox outlived its owner"
    assert not marked(marker), "a daemon outlived its owner"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- per-sandbox host uids -------------------------------------------------------------------

INOTIFY_HOG = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if os.fork():
    os._exit(0)
os.setsid()
held = []
while len(held) < 100_000:
    fd = libc.inotify_init()
    if fd < 0:
        break
    held.append(fd)
open("/hog.log", "w").write(f"{len(held)} {ctypes.get_errno()}")
os.close(1)
os.close(2)
import time
time.sleep(1000)
"""

INOTIFY_ONCE = "import ctypes; print(ctypes.CDLL(None, use_errno=True).inotify_init() >= 0)"


def _host_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Uid:")).split()[1])


async def test_each_sandbox_has_its_own_host_uids(tmp_path: Path) -> None:
    import ctypes

    from backends.sandbox.settings import UID_BASE

    one, two = LOCAL.make(tmp_path), LOCAL.make(tmp_path)
    await one.start(force_build=False)
    await two.start(force_build=False)
    try:
        uids = [_host_uid(env._box._booted.init_pid) for env in (one, two)]  # type: ignore[attr-defined]
        assert uids[0] != uids[1] and abs(uids[0] - uids[1]) % 65536 == 0, uids
        # One sandbox takes every inotify instance its uid may have...
        (tmp_path / "hog.py").write_text(INOTIFY_HOG)
        await one.upload_file(tmp_path / "hog.py", "/hog.py")
        await one.exec("python3 /hog.py")
        res = await one.exec(
            "for i in $(seq 100); do test -e /hog.log && break; sleep 0.1; done; cat /hog.log"
        )
        held, err = res.stdout.split()
        assert err == "24" and int(held) >= 100, res.stdout  # EMFILE: it hit its limit
        # ... and the other sandbox and host root still get theirs.
        res = await two.exec(f"python3 -c '{INOTIFY_ONCE}'")
        assert res.stdout == "True\n", res
        fd = ctypes.CDLL(None, use_errno=True).inotify_init()
        assert fd >= 0, os.strerror(ctypes.get_errno())
        os.close(fd)
        # The layers are shared, seen through each sandbox's range: root owns /bin there, and
        # what a sandbox writes lands on disk in the layers' own range.
        assert (await two.exec("stat -c %u /usr/bin/bash; touch /mine")).stdout == "0\n"
        box = two._box  # type: ignore[attr-defined]
        assert (box.upper / "mine").stat().st_uid == UID_BASE
    finally:
        await one.stop(delete=True)
        await two.stop(delete=True)


def test_uid_ranges_are_leased_once_across_processes() -> None:
    import subprocess
    import sys

    from backends.sandbox import uids

    mine = uids.lease()
    try:
        code = "from backends.sandbox import uids; print(uids.lease().base)"
        others = {
            int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)
            for _ in range(3)
        }  # fmt: skip
        assert mine.base not in others
    finally:
        mine.release()


# -- a second round, against the fixes themselves ----------------------------------------------

CRAFTED_MEMBERS = r"""
import io, sys, tarfile
kind = sys.argv[1]
with tarfile.open("/crafted.tar", "w", format=tarfile.GNU_FORMAT) as tar:
    def add(name, type_, linkname="", data=None):
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = type_, linkname, 0o644
        if data is not None:
            info.size = len(data)
        tar.addfile(info, io.BytesIO(data) if data is not None else None)
    if kind == "header-bomb":  # a 9 MiB long name: tarfile would hold it in memory
        add("n" * (9 * 1024 * 1024), tarfile.REGTYPE, data=b"x")
    elif kind == "relink":  # a file, replaced by a symlink, then hard-linked: a link to a
        add("a", tarfile.REGTYPE, data=b"x")  # link could be aimed anywhere once in place
        add("a", tarfile.SYMTYPE, "c")
        add("b", tarfile.LNKTYPE, "a")
    elif kind == "through-host-link":  # a relative link into the host's own link out
        add("mine", tarfile.SYMTYPE, "outside-link/victim")
"""


async def _crafted_download(env: BaseEnvironment, tmp_path: Path, kind: str, out: Path) -> None:
    await env.exec("rm -f /usr/local/sbin/tar")
    await run_python(env, tmp_path, CRAFTED_MEMBERS, kind)
    await fake_tar(env, "#!/bin/sh\nexec cat /crafted.tar\n")
    await env.download_dir("/logs/verifier", out)


@TAR_ONLY
async def test_crafted_headers_links_and_relinks_are_refused(
    env: BaseEnvironment, tmp_path: Path, host_dir: Path
) -> None:
    with pytest.raises(SandboxPathError, match="not a file of this download"):
        await _crafted_download(env, tmp_path, "relink", tmp_path / "relink")
    assert os.listdir(tmp_path / "relink") == []  # what it had made is gone again
    out = tmp_path / "trial"
    out.mkdir()
    (out / "outside-link").symlink_to(host_dir)
    await _crafted_download(env, tmp_path, "through-host-link", out)
    assert not (out / "mine").is_symlink()  # would have led to the host's file
    assert (out / "outside-link").is_symlink()  # the host's own link stays


async def test_a_header_bomb_is_refused(tmp_path: Path) -> None:
    env = LOCAL.make(tmp_path, kwargs={"max_download_bytes": 64 * MiB, "host_transfers": False})
    await env.start(force_build=False)
    try:
        with pytest.raises(SandboxPathError, match="header larger than 8 MiB"):
            await _crafted_download(env, tmp_path, "header-bomb", tmp_path / "bomb")
    finally:
        await env.stop(delete=True)


async def test_no_machinery_fd_reaches_pid_1_or_commands(env: BaseEnvironment) -> None:
    # The spawner holds uid-range leases, idmap namespaces and pidfds: none may leak in.
    res = await env.exec("ls /proc/self/fd")
    assert res.stdout.split() == ["0", "1", "2", "3"], res.stdout
    init_pid = env._box._booted.init_pid  # type: ignore[attr-defined]
    assert sorted(os.listdir(f"/proc/{init_pid}/fd")) == ["0", "1", "2"]


async def test_pid_1_reaps_the_orphans_it_inherits(env: BaseEnvironment) -> None:
    res = await env.exec(
        "for i in $(seq 20); do (sleep 0.01 &); done; sleep 0.5;"
        " grep -h '^State' /proc/[0-9]*/status | sort | uniq -c"
    )
    assert "zombie" not in res.stdout, res.stdout


def test_uid_ranges_are_host_wide_whatever_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Host uids are host-wide: a process with a cache of its own must not lease a held range."""
    import subprocess
    import sys

    from backends.sandbox import uids

    # Four ranges, every free one held here (another process on the host may hold some).
    monkeypatch.setenv("BACKENDS_SANDBOX_UID_RANGES", "4")
    mine: list[uids.Lease] = []
    try:
        with contextlib.suppress(SandboxStartError):
            while True:
                mine.append(uids.lease())
        code = "from backends.sandbox import uids; print(uids.lease().base)"
        env = {**os.environ, "BACKENDS_CACHE": str(tmp_path / "another-cache")}
        other = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True
        )
        assert other.returncode != 0 and "in use" in other.stderr, other.stdout
    finally:
        for lease in mine:
            lease.release()
