"""Harbor's other download paths (artifacts with `exclude`, logs with include/exclude filters)
reach the host through the same checked unpacker and limits as `download_dir`.

Harbor's own versions of these unpack a sandbox-made tar.gz with tarfile on the host, where a
crafted archive writes outside the target and a compressed bomb passes every size limit.
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harbor.environments.base import BaseEnvironment
from sky_support import fake_sky_server
from test_sandbox_escapes import (
    PATH_MAX_ARCHIVE,
    TAR_ONLY,
    env,
    fake_tar,
    host_dir,
    run_python,
)

from backends.sandbox.contract import PROVIDERS, Provider
from backends.sandbox.errors import SandboxPathError
from backends.sandbox.unpack import DownloadTooLargeError

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]
__all__ = ["env", "host_dir"]  # fixtures
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


# Each provider; the local one with files moved by the host, and by `tar` inside.
ANY = ["local-sandbox", "local-sandbox-tar", "skypilot"]


@pytest.fixture(params=ANY)
async def any_env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BaseEnvironment]:
    """A sandbox of each provider (SkyPilot over the fake API server, whose pods are local
    sandboxes), with an 8 MiB download limit."""
    provider: Provider = next(p for p in PROVIDERS if request.param.startswith(p.name))
    kwargs: dict[str, object] = {"max_download_bytes": 8 * MiB}
    if provider.name == "skypilot":
        request.getfixturevalue("fake_sky")
    else:
        kwargs["host_transfers"] = not request.param.endswith("-tar")
    sandbox = provider.make(tmp_path, kwargs=kwargs)
    await sandbox.start(force_build=False)
    try:
        yield sandbox
    finally:
        await sandbox.stop(delete=True)


# Whatever tar is asked for, it hands back the crafted archive: gzipped when asked for a
# `tar czf FILE ...` (Harbor's own path), plain into `-f FILE` or on stdout otherwise.
CRAFTED_TAR = (
    "#!/bin/sh\n"
    'if [ "$1" = czf ]; then gzip -c /crafted.tar > "$2"; exit; fi\n'
    'out=-; prev=; for a in "$@"; do [ "$prev" = -f ] && out=$a; prev=$a; done\n'
    '[ "$out" = - ] && exec cat /crafted.tar; exec cp /crafted.tar "$out"\n'
)


async def _download(env: BaseEnvironment, how: str, out: Path) -> None:
    if how == "exclusions":
        await env.download_dir_with_exclusions(
            source_dir="/logs/artifacts", target_dir=out, exclude=["*.pyc"]
        )
    else:
        await env.download_dir_filtered(
            source_dir="/logs/artifacts", target_dir=out, exclude=["*.pyc"]
        )


@pytest.mark.parametrize("how", ["exclusions", "filtered"])
@pytest.mark.parametrize("any_env", ["local-sandbox-tar", "skypilot"], indirect=True)
async def test_a_crafted_archive_writes_nothing_outside(
    any_env: BaseEnvironment, tmp_path: Path, host_dir: Path, how: str
) -> None:
    await run_python(any_env, tmp_path, PATH_MAX_ARCHIVE, str(host_dir))
    res = await any_env.exec("mkdir -p /logs/artifacts && echo hi > /logs/artifacts/a.txt")
    assert res.return_code == 0, res.stderr
    await fake_tar(any_env, CRAFTED_TAR)
    out = tmp_path / "out"
    try:
        await _download(any_env, how, out)
    except SandboxPathError:
        pass  # refusing the archive is fine; what matters is the host below
    victim = host_dir / "victim"
    assert victim.read_text() == "host secret\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert os.listdir(host_dir) == ["victim"]


@pytest.mark.parametrize("how", ["exclusions", "filtered"])
@pytest.mark.parametrize(
    ("name", "size"), [("reward.txt", 2 * MiB), ("big.bin", 16 * MiB)], ids=["parsed", "total"]
)
async def test_sparse_files_are_held_to_the_download_limits(
    any_env: BaseEnvironment, tmp_path: Path, how: str, name: str, size: int
) -> None:
    # Sparse, so it compresses to nothing: the limits count apparent sizes.
    res = await any_env.exec(
        f"mkdir -p /logs/artifacts && truncate -s {size} /logs/artifacts/{name}"
    )
    assert res.return_code == 0, res.stderr
    out = tmp_path / "out"
    with pytest.raises(DownloadTooLargeError):
        await _download(any_env, how, out)
    assert not (out / name).exists()


async def test_exclusions_and_filters_choose_the_files(
    any_env: BaseEnvironment, tmp_path: Path
) -> None:
    res = await any_env.exec(
        "mkdir -p /logs/artifacts/sub && cd /logs/artifacts && echo a > keep.txt && "
        "echo b > sub/drop.pyc && echo c > sub/keep.log && echo d > reward.txt && "
        "ln -s keep.txt link.txt"
    )
    assert res.return_code == 0, res.stderr
    excl = tmp_path / "excl"
    await any_env.download_dir_with_exclusions(
        source_dir="/logs/artifacts", target_dir=excl, exclude=["*.pyc"]
    )
    assert sorted(str(p.relative_to(excl)) for p in excl.rglob("*")) == [
        "keep.txt",
        "link.txt",
        "reward.txt",
        "sub",
        "sub/keep.log",
    ]
    assert (excl / "link.txt").is_symlink()
    filt = tmp_path / "filt"
    await any_env.download_dir_filtered(
        source_dir="/logs/artifacts",
        target_dir=filt,
        include=["*.log", "*.txt"],
        exclude=["keep.txt"],
        protect=["reward.txt"],
    )
    assert sorted(str(p.relative_to(filt)) for p in filt.rglob("*") if p.is_file()) == [
        "reward.txt",
        "sub/keep.log",
    ]
    assert (filt / "sub" / "keep.log").read_text() == "c\n"
    with pytest.raises(FileNotFoundError):
        await any_env.download_dir_filtered(
            source_dir="/logs/missing", target_dir=tmp_path / "none", include=["*"]
        )


async def test_a_link_named_like_a_parsed_file_is_held_to_its_limit(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    res = await env.exec("mkdir -p /out && cd /out && truncate -s 2M big && ln -s big reward.txt")
    assert res.return_code == 0, res.stderr
    with pytest.raises(DownloadTooLargeError, match=r"reward\.txt"):
        await env.download_dir("/out", tmp_path / "one")
    assert not (tmp_path / "one" / "reward.txt").exists()
    # Across two downloads: the link first leads to a small file, then the file grows.
    res = await env.exec(
        "mkdir -p /a /b && echo 1 > /a/f && ln -s f /a/reward.txt && truncate -s 2M /b/f"
    )
    assert res.return_code == 0, res.stderr
    await env.download_dir("/a", tmp_path / "two")
    with pytest.raises(DownloadTooLargeError, match=r"reward\.txt"):
        await env.download_dir("/b", tmp_path / "two")
    assert not (tmp_path / "two" / "reward.txt").is_symlink()


async def test_two_downloads_into_one_directory_cannot_combine_into_a_link_out(
    env: BaseEnvironment, tmp_path: Path, host_dir: Path
) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    names = [f"x{i}" for i in range(len(dest.resolve().parts) - 1)]  # enough to climb to /
    link = "/".join(names) + "/.." * len(names) + f"{host_dir}/victim"
    res = await env.exec(
        f"mkdir -p /one /two && ln -s '{link}' /one/secret.txt && "
        + " && ".join(f"ln -s . /two/{n}" for n in names)
    )
    assert res.return_code == 0, res.stderr
    await env.download_dir("/one", dest)
    await env.download_dir("/two", dest)
    assert not (dest / "secret.txt").exists()
    assert not (dest / "secret.txt").is_symlink()


DEEP_ARCHIVE = r"""
import io, tarfile
with tarfile.open("/deep.tar", "w", format=tarfile.PAX_FORMAT) as tar:
    info = tarfile.TarInfo("d/" * 1100 + "f")
    info.size = 1
    tar.addfile(info, io.BytesIO(b"x"))
"""


@TAR_ONLY
async def test_a_tree_deeper_than_the_limit_is_refused_by_name(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    await run_python(env, tmp_path, DEEP_ARCHIVE)
    await fake_tar(env, "#!/bin/sh\nexec cat /deep.tar\n")
    out = tmp_path / "out"
    with pytest.raises(SandboxPathError, match="1101 directories deep; at most 256"):
        await env.download_dir("/logs/verifier", out)
    assert os.listdir(out) == []


@TAR_ONLY
async def test_a_file_changing_while_read_does_not_fail_the_download(
    env: BaseEnvironment, tmp_path: Path
) -> None:
    # What GNU tar does when a daemon appends to a log it is reading: a whole archive, exit 1.
    await fake_tar(
        env,
        '#!/bin/sh\n/usr/bin/tar "$@" || exit\n'
        "echo 'tar: ./log: file changed as we read it' >&2\nexit 1\n",
    )
    res = await env.exec("echo 0 > /logs/verifier/reward.txt && echo x > /logs/verifier/log")
    assert res.return_code == 0, res.stderr
    await env.download_dir("/logs/verifier", tmp_path / "verifier")
    assert (tmp_path / "verifier" / "reward.txt").read_text() == "0\n"
    # A real failure still fails.
    with pytest.raises(FileNotFoundError):
        await env.download_dir("/logs/missing", tmp_path / "missing")
