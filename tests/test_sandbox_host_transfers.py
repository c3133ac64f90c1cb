"""Files moved by the host through a live sandbox's root (backends.sandbox.direct) give what
`tar` run inside as sandbox root gives, and never more: host root's own reach (a 0600 host
file behind a bind, /proc/kcore) stays out of the sandbox's, whatever root inside plants.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from harbor.environments.base import BaseEnvironment

from backends.sandbox.contract import PROVIDERS
from backends.sandbox.errors import ExecTimeoutError
from backends.sandbox.unpack import DownloadTooLargeError

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]
LOCAL = PROVIDERS[0]
SECRET = "host root only\n"


@pytest.fixture
def secret_dir() -> Iterator[Path]:
    """A host directory with a 0600 root file: bound read-only into the sandbox, where
    sandbox root (an unprivileged host uid) cannot read the file."""
    d = Path(f"/var/tmp/backends-bound-{uuid.uuid4().hex[:8]}")
    d.mkdir()
    (d / "secret").write_text(SECRET)
    (d / "secret").chmod(0o600)
    yield d
    for child in d.iterdir():
        child.unlink()
    d.rmdir()


@pytest.fixture(params=["host", "tar"])
async def env(
    request: pytest.FixtureRequest, tmp_path: Path, secret_dir: Path
) -> AsyncIterator[BaseEnvironment]:
    sandbox = LOCAL.make(
        tmp_path,
        kwargs={
            "extra_binds": [f"{secret_dir}:/bound:ro"],
            "host_transfers": request.param == "host",
        },
    )
    await sandbox.start(force_build=False)
    try:
        yield sandbox
    finally:
        await sandbox.stop(delete=True)


async def sh(env: BaseEnvironment, script: str, user: str = "root") -> str:
    res = await env.exec(script, user=user)
    assert res.return_code == 0, res.stderr
    return res.stdout


async def test_uploads_land_as_tar_would_make_them(env: BaseEnvironment, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    (src / "sub" / "data").write_text("data\n")
    (src / "sub" / "data").chmod(0o640)
    (src / "link").symlink_to("sub/data")
    await env.upload_dir(src, "/deep/new/tests")
    await env.upload_file(src / "run.sh", "/opt/one/run.sh")
    listing = await sh(
        env,
        "cd /deep/new/tests && stat -c '%n %a %u:%g %F' run.sh sub sub/data link && "
        "readlink link && ./run.sh && /opt/one/run.sh && stat -c '%a %u' /deep /deep/new",
    )
    assert listing.splitlines() == [
        "run.sh 755 0:0 regular file",
        "sub 755 0:0 directory",
        "sub/data 640 0:0 regular file",
        "link 777 0:0 symbolic link",
        "sub/data",
        "ran",
        "ran",
        "755 0",
        "755 0",
    ]


async def test_an_upload_replaces_a_planted_link_instead_of_following_it(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await sh(env, "mkdir -p /tests /elsewhere && ln -s /elsewhere/victim /tests/test.sh")
    src = tmp_path / "tests"
    src.mkdir()
    (src / "test.sh").write_text("real tests\n")
    await env.upload_dir(src, "/tests")
    out = await sh(
        env, "cat /tests/test.sh; test -L /tests/test.sh || echo not-a-link; ls /elsewhere"
    )
    assert out.splitlines() == ["real tests", "not-a-link"]


async def test_an_upload_through_a_link_into_a_host_bind_writes_nothing_there(
    env: BaseEnvironment, tmp_path: Path, secret_dir: Path
) -> None:
    await sh(env, "ln -s /bound /tests")
    src = tmp_path / "tests"
    src.mkdir()
    (src / "secret").write_text("overwritten\n")
    (src / "new").write_text("planted\n")
    with pytest.raises(OSError):
        await env.upload_dir(src, "/tests")  # a read-only bind: tar inside fails too
    assert sorted(os.listdir(secret_dir)) == ["secret"]
    assert (secret_dir / "secret").read_text() == SECRET


async def test_a_link_to_a_host_bind_file_is_not_read_with_host_roots_rights(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    # Sandbox root cannot read the file; host root could. The download must fail as it
    # would inside, not hand the host's file over.
    assert "Permission denied" in (await env.exec("cat /bound/secret")).stderr
    await sh(env, "ln -s /bound/secret /logs/agent/steal.txt")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError):
        await env.download_file("/logs/agent/steal.txt", out / "steal.txt")
    assert not (out / "steal.txt").exists()
    # In a tree the link stays a link, and one leading out of the target is dropped.
    await env.download_dir("/logs/agent", out / "agent")
    assert not (out / "agent" / "steal.txt").exists()


async def test_proc_is_never_read_by_the_host(env: BaseEnvironment, tmp_path: Path) -> None:
    # /proc/kcore is a regular file host root may read (the kernel's memory): from inside,
    # through a link, it must stay what it is to sandbox root (unreadable).
    await sh(env, "ln -s /proc/kcore /logs/agent/core.txt")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError):
        await env.download_file("/logs/agent/core.txt", out / "core.txt")
    assert not (out / "core.txt").exists() or (out / "core.txt").stat().st_size == 0


async def test_fifos_neither_hang_nor_cross(env: BaseEnvironment, tmp_path: Path) -> None:
    await sh(env, "mkfifo /logs/agent/pipe && echo ok > /logs/agent/file")
    out = tmp_path / "agent"
    await env.download_dir("/logs/agent", out)
    assert sorted(os.listdir(out)) == ["file"]
    with pytest.raises(OSError, match="not a regular file"):
        await env.download_file("/logs/agent/pipe", tmp_path / "pipe")


async def test_files_of_other_users_and_modes_come_back(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await sh(
        env,
        "useradd -m agent && mkdir -p /logs/agent/sub && echo secret > /logs/agent/sub/own && "
        "chown -R agent /logs/agent/sub && chmod 0600 /logs/agent/sub/own && "
        "chmod 0700 /logs/agent/sub && truncate -s 1M /logs/agent/sparse",
    )
    out = tmp_path / "agent"
    await env.download_dir("/logs/agent", out)
    assert (out / "sub" / "own").read_text() == "secret\n"
    assert stat.S_IMODE((out / "sub").stat().st_mode) == 0o700
    sparse = (out / "sparse").stat()
    assert sparse.st_size == 1024 * 1024 and sparse.st_blocks == 0  # holes stay holes


async def test_an_upload_into_another_users_directory_still_works(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    # Sandbox root may write there (its capabilities inside); the host path, holding only
    # sandbox root's ids, may not, and hands it to tar.
    await sh(env, "useradd -m agent && mkdir /work && chown agent /work && chmod 0755 /work")
    (tmp_path / "f").write_text("x\n")
    await env.upload_file(tmp_path / "f", "/work/f")
    assert (await sh(env, "stat -c '%u %a' /work/f; cat /work/f")).split() == ["0", "644", "x"]


async def test_the_host_path_runs_nothing_inside(env: BaseEnvironment, tmp_path: Path) -> None:
    # With a tar inside that fails, only the host path still moves files: proof that it is
    # the one taken (and costs no process in the sandbox).
    await sh(
        env, "printf '#!/bin/sh\\nexit 3\\n' > /usr/local/sbin/tar && chmod +x /usr/local/sbin/tar"
    )
    (tmp_path / "f").write_text("x\n")
    moves = [
        env.upload_file(tmp_path / "f", "/tests/f"),
        env.download_file("/etc/hostname", tmp_path / "hostname"),
        env.download_dir("/etc/apt", tmp_path / "apt"),
    ]
    if env.host_transfers:
        for move in moves:
            await move
        assert (tmp_path / "apt" / "sources.list.d").is_dir()
    else:
        for move in moves:
            with pytest.raises(OSError):
                await move


async def test_a_slow_host_transfer_gives_up_at_its_timeout(tmp_path: Path) -> None:
    env = LOCAL.make(tmp_path, kwargs={"transfer_timeout_sec": 0.001})
    await env.start(force_build=False)
    try:
        await sh(env, "head -c 64M /dev/urandom > /logs/agent/big")
        with pytest.raises(ExecTimeoutError, match="transfer_timeout_sec"):
            await env.download_dir("/logs/agent", tmp_path / "agent")
        assert os.listdir(tmp_path / "agent") == []  # what it had made is gone again
    finally:
        await env.stop(delete=True)


LEASE_HOLDER = r"""
import fcntl, os, signal, time
signal.signal(signal.SIGIO, signal.SIG_IGN)
fd = os.open("/logs/agent/leased", os.O_RDONLY)
fcntl.fcntl(fd, 1024, fcntl.F_WRLCK)  # F_SETLEASE: opening it elsewhere waits for a break
open("/logs/agent/ready", "w").close()
time.sleep(3600)
"""


async def test_a_file_lease_stalls_only_its_own_transfer_and_only_until_its_timeout(
    tmp_path: Path,
) -> None:
    # Breaking a lease makes an open wait 45 s: on the host that would hold a host thread.
    # The host path turns it down at once; so does tar inside (or it waits, killed at the
    # timeout): the download fails, soon, and nothing else waits for it.
    env = LOCAL.make(tmp_path, kwargs={"transfer_timeout_sec": 3})
    other = LOCAL.make(tmp_path)
    await env.start(force_build=False)
    await other.start(force_build=False)
    try:
        (tmp_path / "holder.py").write_text(LEASE_HOLDER)
        await env.upload_file(tmp_path / "holder.py", "/holder.py")
        await sh(
            env,
            "echo data > /logs/agent/leased; (python3 /holder.py &) ; "
            "for i in $(seq 100); do [ -e /logs/agent/ready ] && exit; sleep 0.05; done; exit 1",
        )
        started = anyio.current_time()
        async with anyio.create_task_group() as group:

            async def stalled() -> None:
                with pytest.raises(OSError):
                    await env.download_file("/logs/agent/leased", tmp_path / "leased")

            group.start_soon(stalled)
            for i in range(20):  # another sandbox's transfers go on meanwhile
                await other.download_file("/etc/hostname", tmp_path / f"hostname-{i}")
            assert anyio.current_time() - started < 3
        assert anyio.current_time() - started < 10
    finally:
        await env.stop(delete=True)
        await other.stop(delete=True)


async def test_a_bound_file_is_never_unmounted_by_an_upload(
    env: BaseEnvironment, tmp_path: Path, secret_dir: Path
) -> None:
    # /bound is a host directory bound in; a file on it stands where the upload goes.
    (tmp_path / "f").write_text("new\n")
    with pytest.raises(OSError):
        await env.upload_file(tmp_path / "f", "/bound/secret")
    assert (secret_dir / "secret").read_text() == SECRET
    assert " /bound " in await sh(env, "cat /proc/self/mountinfo")


async def test_a_tree_deeper_than_the_host_walk_still_comes_back(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await sh(env, "cd /logs/agent && for i in $(seq 60); do mkdir d && cd d; done && echo deep > f")
    await env.download_dir("/logs/agent", tmp_path / "agent")
    assert (tmp_path / "agent" / "/".join(["d"] * 60) / "f").read_text() == "deep\n"


async def test_replace_dirs_clears_whatever_stands_there(env: BaseEnvironment) -> None:
    await sh(
        env,
        "rm -rf /tests && echo x > /tests && cd /logs/verifier && echo 1 > reward.txt && "
        "for i in $(seq 300); do mkdir d && cd d; done",
    )
    await env.replace_dirs({"/tests": 0o755, "/logs/verifier": 0o777})  # type: ignore[attr-defined]
    listing = await sh(env, "stat -c '%F %a %u' /tests /logs/verifier; ls -A /tests /logs/verifier")
    assert listing.splitlines()[:2] == ["directory 755 0", "directory 777 0"]
    assert "reward.txt" not in listing and " d\n" not in listing


async def test_uploads_into_a_setgid_directory_are_roots_as_tar_makes_them(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await sh(env, "useradd -m agent && mkdir /t1 && chown agent:agent /t1 && chmod 2777 /t1")
    src = tmp_path / "tests"
    (src / "sub").mkdir(parents=True)
    (src / "test.sh").write_text("#!/bin/sh\n")
    (src / "test.sh").chmod(0o4775)
    (src / "sub").chmod(0o2775)
    await env.upload_dir(src, "/t1")
    listing = await sh(env, "stat -c '%n %U:%G %a' /t1/test.sh /t1/sub")
    assert listing.splitlines() == ["/t1/test.sh root:root 4775", "/t1/sub root:root 2775"]


async def test_a_sparse_native_trajectory_is_refused_before_the_host_parses_it(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    # Harbor's mini-swe-agent class reads this file whole after every trial.
    await sh(env, "truncate -s 1G /logs/agent/mini-swe-agent.trajectory.json")
    with pytest.raises(DownloadTooLargeError, match=r"mini-swe-agent\.trajectory\.json"):
        await env.download_dir("/logs/agent", tmp_path / "agent")


@pytest.mark.parametrize(
    ("plant", "refused"),
    [
        # Harbor's claude-code class reads every session file; codex the one sorting last.
        ("truncate -s 1G sessions/projects/-app/0000.jsonl", r"0000\.jsonl.*at most 33554432"),
        # Each under the per-file bound, together past the bound for all of them.
        (
            "for i in 1 2 3; do truncate -s 30M sessions/projects/-app/$i.jsonl; done",
            r"\*\.jsonl files to \d+; .*at most 67108864",
        ),
        # Hard links to one file: Harbor's glob reads each name.
        (
            "truncate -s 30M sessions/a.jsonl && ln sessions/a.jsonl sessions/b.jsonl "
            "&& ln sessions/a.jsonl sessions/c.jsonl",
            r"\*\.jsonl files to",
        ),
        # A link named like a session, to a large file that is not.
        ("truncate -s 1G big && ln -s ../../../big sessions/projects/-app/s.jsonl", r"s\.jsonl"),
    ],
    ids=["sparse", "total", "hard-links", "symlink"],
)
async def test_sparse_or_huge_agent_session_files_are_refused_naming_them(
    env: BaseEnvironment, tmp_path: Path, plant: str, refused: str
) -> None:
    await sh(env, f"cd /logs/agent && mkdir -p sessions/projects/-app && {plant}")
    with pytest.raises(DownloadTooLargeError, match=refused):
        await env.download_dir("/logs/agent", tmp_path / "agent")
    assert not list((tmp_path / "agent").rglob("*.jsonl"))


async def test_agent_session_files_within_the_bounds_download(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await sh(
        env,
        "mkdir -p /logs/agent/sessions/projects/-app && cd /logs/agent/sessions/projects/-app "
        "&& truncate -s 30M a.jsonl && truncate -s 30M b.jsonl",
    )
    await env.download_dir("/logs/agent", tmp_path / "agent")
    sizes = [p.stat().st_size for p in (tmp_path / "agent").rglob("*.jsonl")]
    assert sizes == [30 * 1024 * 1024] * 2
