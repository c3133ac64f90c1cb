"""Escapes an adversarial review found in the local sandbox, each replayed as root inside.

Every test here reproduces one attack of issue 9 the way the review ran it and checks that the
host is left unharmed; on the code before the fix each of them failed.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harbor.environments.base import BaseEnvironment

from backends.sandbox.contract import PROVIDERS
from backends.sandbox.errors import SandboxPathError
from backends.sandbox.unpack import PARSED_FILE_LIMITS, DownloadTooLargeError

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]
LOCAL = PROVIDERS[0]
MiB = 1024 * 1024


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[BaseEnvironment]:
    sandbox = LOCAL.make(tmp_path, kwargs={"max_download_bytes": 8 * MiB})
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
    # What tasks do keeps working: threads, namespaces other than user ones, su, ptrace;
    # no no_new_privs on commands (bwrap sets it on pid 1 only).
    res = await env.exec(
        "python3 -c 'import threading; t = threading.Thread(target=print); t.start(); t.join()'"
        " && unshare -n true && su nobody -s /bin/sh -c 'id -u'"
        " && grep NoNewPrivs /proc/self/status"
        " && python3 -c 'import ctypes, os; print(ctypes.CDLL(None).ptrace(0x4206, 1, 0, 0))'"
    )
    assert res.return_code == 0, res.stderr
    assert res.stdout.split("\n")[1:4] == ["65534", "NoNewPrivs:\t0", "0"], res.stdout


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
