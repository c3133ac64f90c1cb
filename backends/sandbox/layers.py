"""Building a task's Dockerfile into a content-addressed stack of overlay layers.

Each filesystem-changing step (RUN, COPY/ADD, WORKDIR) becomes one layer: the upper directory
of a short-lived build sandbox booted over the layers below. A layer's key hashes its parent's
key, the instruction and (for COPY) the bytes it copies, so an unchanged Dockerfile resolves
entirely from cache: the second sandbox from the same Dockerfile pays only for hashing.
Metadata steps (ENV, ARG, USER) change the key but make no layer.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import posixpath
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from backends.sandbox import dockerfile as df
from backends.sandbox import rootfs
from backends.sandbox.errors import ImageBuildError, UnsupportedInstructionError
from backends.sandbox.runtime import DEFAULT_PATH, BwrapSandbox, SandboxSpec
from backends.sandbox.settings import cache_dir, private_dir

log = logging.getLogger(__name__)


@dataclass
class Image:
    """A bootable image: its layer stack plus the config later steps and execs see."""

    source: str  # the base image asked for
    rootfs: Path
    layers: list[Path] = field(default_factory=list)  # bottom-most first
    env: dict[str, str] = field(default_factory=lambda: {"PATH": DEFAULT_PATH})
    workdir: str = "/"
    user: str | None = None
    key: str = ""

    @property
    def lowerdirs(self) -> list[Path]:
        return [*reversed(self.layers), self.rootfs]


_warned: set[str] = set()


def layers_dir() -> Path:
    return cache_dir() / "layers"


_base_images: dict[str, tuple[tuple[int, int], Image]] = {}


def _marker_stamp(image: Image) -> tuple[int, int]:
    st = (image.rootfs / rootfs.MARKER).stat()
    return st.st_ino, st.st_mtime_ns


def cached_base_image(image: str) -> Image | None:
    """`base_image(image)` if this process resolved it before and the rootfs is unchanged."""
    hit = _base_images.get(image)
    if hit is None:
        return None
    stamp, found = hit
    try:
        if _marker_stamp(found) == stamp:
            return Image(source=found.source, rootfs=found.rootfs, key=found.key)
    except OSError:
        pass
    return None


def base_image(image: str) -> Image:
    """The image for a `docker_image` or `FROM` line, served from the substitution table.

    Raises:
        BaseImageNotFoundError: no substitute for the image.
    """
    found = _base_image(image)
    _base_images[image] = (_marker_stamp(found), found)
    return Image(source=found.source, rootfs=found.rootfs, key=found.key)


def _base_image(image: str) -> Image:
    sub = rootfs.resolve_image(image)
    path = rootfs.ensure_rootfs(sub.rootfs)
    if sub.note and image not in _warned:
        _warned.add(image)  # once per process: every sandbox would repeat it
        log.warning("image %s: %s", image, sub.note)
    marker = (path / rootfs.MARKER).read_text()
    return Image(source=image, rootfs=path, key=_h("base", sub.rootfs, marker))


def _h(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\x00")
    return h.hexdigest()


async def build(context: Path, *, network: bool = True) -> Image:
    """Build `context/Dockerfile` (cached) and return the resulting image.

    Raises:
        UnsupportedInstructionError: an instruction or form the builder refuses.
        BaseImageNotFoundError: the FROM image has no local substitute.
        ImageBuildError: a RUN step exited non-zero, or a COPY source is missing.
    """
    instructions = df.parse((context / "Dockerfile").read_text())
    args: dict[str, str] = {}
    image: Image | None = None
    for ins in instructions:
        variables = {**args, **(image.env if image else {})}
        if ins.keyword == "ARG":
            for k, v in df.parse_env(ins.args).items():
                args.setdefault(k, df.expand(v, variables))
            if image is not None:
                image.key = _h(image.key, "ARG", ins.args)
            continue
        if ins.keyword == "FROM":
            _, words = df.split_flags(ins.args)
            image = await anyio.to_thread.run_sync(base_image, df.expand(words[0], args))
            continue
        assert image is not None
        if ins.keyword in df.IGNORED:
            log.debug("ignoring %s (no effect in a sandbox)", ins.where())
            continue
        if ins.keyword == "ENV":
            for k, v in df.parse_env(ins.args).items():
                image.env[k] = df.expand(v, {**args, **image.env})
            image.key = _h(image.key, "ENV", ins.args)
        elif ins.keyword == "USER":
            image.user = df.expand(ins.args, variables).strip() or None
            image.key = _h(image.key, "USER", ins.args)
        elif ins.keyword == "WORKDIR":
            path = df.expand(ins.args, variables).strip()
            image.workdir = posixpath.normpath(posixpath.join(image.workdir, path))
            await _layer(image, ins, _h(image.key, "WORKDIR", image.workdir), network, args)
        elif ins.keyword == "RUN":
            await _layer(
                image,
                ins,
                _h(image.key, "RUN", ins.args, repr(sorted(args.items()))),
                network,
                args,
            )
        elif ins.keyword in ("COPY", "ADD"):
            flags, words = df.split_flags(ins.args)
            words = [df.expand(w, variables) for w in words]
            if len(words) < 2:
                raise UnsupportedInstructionError(
                    f"{ins.keyword} needs a source and a destination ({ins.where()})"
                )
            digest = await anyio.to_thread.run_sync(_hash_sources, context, words[:-1], ins)
            key = _h(image.key, "COPY", repr(flags), repr(words), image.workdir, digest)
            await _layer(image, ins, key, network, args, copy=(context, flags, words))
    assert image is not None
    return image


async def _layer(
    image: Image,
    ins: df.Instruction,
    key: str,
    network: bool,
    args: dict[str, str],
    copy: tuple[Path, dict[str, str], list[str]] | None = None,
) -> None:
    layer = layers_dir() / key
    if not (layer / ".done").exists():
        await anyio.to_thread.run_sync(
            _locked_build_wrapper, image, ins, layer, network, args, copy
        )
    image.layers.append(layer / "diff")
    image.key = key


def _locked_build_wrapper(
    image: Image,
    ins: df.Instruction,
    layer: Path,
    network: bool,
    args: dict[str, str],
    copy: tuple[Path, dict[str, str], list[str]] | None,
) -> None:
    # One builder per layer across processes: the lock is held in this worker thread while a
    # fresh event loop runs the build sandbox.
    with rootfs.file_lock(f"layer-{layer.name}"):
        if (layer / ".done").exists():
            return
        anyio.run(_build_layer, image, ins, layer, network, args, copy)


async def _build_layer(
    image: Image,
    ins: df.Instruction,
    layer: Path,
    network: bool,
    args: dict[str, str],
    copy: tuple[Path, dict[str, str], list[str]] | None,
) -> None:
    staging = layer.with_name(layer.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    private_dir(layers_dir())
    staging.mkdir()
    box = BwrapSandbox(
        SandboxSpec(
            lowerdirs=image.lowerdirs,
            env=dict(image.env),
            network=network,
            upper=staging / "diff",
        )
    )
    log.info("building layer %s (%s)", layer.name[:12], ins.where())
    await box.start()
    try:
        root = await box.resolve_user(0)
        if ins.keyword == "WORKDIR":
            # Like BuildKit: a WORKDIR it has to create belongs to the current USER.
            owner = await box.resolve_user(image.user)
            wd_script = '[ -d "$0" ] || { mkdir -p -- "$0" && chown "$1:$2" -- "$0"; }'
            argv = ["/bin/sh", "-c", wd_script, image.workdir, str(owner.uid), str(owner.gid)]
            res = await box.run(argv, user=root)
        elif ins.keyword == "RUN":
            user = await box.resolve_user(image.user)
            script = df.shell_form(ins.args)
            cd = ["/bin/sh", "-c", 'cd -- "$0" && exec "$@"', image.workdir]
            res = await box.run([*cd, *script], user=user, env=args)
        else:
            assert copy is not None
            res = await _copy(box, image, ins, *copy)
        if res.return_code != 0:
            out = (res.stdout + res.stderr).decode(errors="replace")[-3000:]
            raise ImageBuildError(
                f"Dockerfile step failed with exit {res.return_code} ({ins.where()}):\n{out}"
            )
    finally:
        await box.stop()
    (staging / ".done").write_text(ins.where())
    staging.rename(layer)


async def _copy(
    box: BwrapSandbox,
    image: Image,
    ins: df.Instruction,
    context: Path,
    flags: dict[str, str],
    words: list[str],
):
    root = await box.resolve_user(0)
    sources, dest = words[:-1], posixpath.join(image.workdir, words[-1])
    probe = await box.run(["test", "-d", dest], user=root)
    into_dir = words[-1].endswith("/") or len(sources) > 1 or probe.return_code == 0
    targets: list[str] = []
    with tempfile.TemporaryFile() as archive:
        with tarfile.open(fileobj=archive, mode="w") as tar:
            for src in _expand_sources(context, sources, ins):
                if src.is_dir():
                    for child in sorted(src.iterdir()):
                        arcname = posixpath.join(dest, child.name)
                        tar.add(str(child), arcname=arcname.lstrip("/"), filter=_as_root)
                        targets.append(arcname)
                else:
                    target = posixpath.join(dest, src.name) if into_dir else dest
                    tar.add(str(src), arcname=target.lstrip("/"), filter=_as_root)
                    targets.append(target)
        archive.seek(0)
        res = await box.run(["tar", "-x", "-p", "-C", "/", "-f", "-"], user=root, stdin=archive)
    if res.return_code == 0 and targets and (flags.get("chown") or flags.get("chmod")):
        if flags.get("chown"):
            res = await box.run(["chown", "-R", flags["chown"], "--", *targets], user=root)
        if res.return_code == 0 and flags.get("chmod"):
            res = await box.run(["chmod", "-R", flags["chmod"], "--", *targets], user=root)
    return res


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _expand_sources(context: Path, sources: list[str], ins: df.Instruction) -> list[Path]:
    root = context.resolve()
    found: list[Path] = []
    for pattern in sources:
        matches = sorted(glob.glob(str(root / pattern))) or []
        if not matches:
            raise ImageBuildError(
                f"{ins.keyword} source {pattern!r} not found in the build "
                f"context {context} ({ins.where()})"
            )
        for m in matches:
            path = Path(os.path.abspath(m))
            if not path.resolve().is_relative_to(root):
                raise ImageBuildError(
                    f"{ins.keyword} source {pattern!r} is outside the build "
                    f"context {context} ({ins.where()})"
                )
            found.append(path)
    return found


def _hash_sources(context: Path, sources: list[str], ins: df.Instruction) -> str:
    h = hashlib.sha256()
    for src in _expand_sources(context, sources, ins):
        paths = [src] + (sorted(src.rglob("*")) if src.is_dir() else [])
        for p in paths:
            st = p.lstat()
            h.update(f"{p.relative_to(context.resolve())}\0{st.st_mode}\0".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            elif p.is_file():
                h.update(p.read_bytes())
    return h.hexdigest()
