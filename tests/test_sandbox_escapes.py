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
