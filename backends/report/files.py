"""Files of a run directory the report may link to, and how it reads them.

Everything under a run directory was written by, or on behalf of, a rollout: a path in
``results.jsonl`` may point anywhere, an artifact may be a symlink to a host file, a trajectory
may be huge. The report links only regular files that resolve inside the run directory, through
no symlink, and reads each with a size bound. A file a browser would run (HTML, SVG, XML) is
shown as text, never linked.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

# Suffixes a browser renders as a document that may run script: listed and previewed as
# text, never linked (opened from disk they would run with the page's file:// access).
ACTIVE_SUFFIXES = frozenset(
    {".html", ".htm", ".xhtml", ".xht", ".svg", ".svgz", ".xml", ".xsl", ".mht", ".mhtml", ".shtml"}
)
PREVIEW_BYTES = 16 * 1024  # of each text artifact, on its rollout's page
PREVIEWS_PER_ROLLOUT = 20
ARTIFACTS_PER_ROLLOUT = 500


def inside(run_dir: Path, recorded: str | None) -> Path | None:
    """The path a results line recorded (relative to the run directory, or absolute), if it
    exists inside ``run_dir`` (already resolved) with no symlink on the way; else ``None``."""
    if not recorded or "\0" in recorded:
        return None
    root = str(run_dir)
    if ".." in recorded.split("/"):
        return None
    candidate = os.path.normpath(os.path.join(root, recorded))  # an absolute one replaces root
    if not candidate.startswith(root + os.sep):
        return None
    # realpath resolves every symlink on the way: any difference means one was there.
    if os.path.realpath(candidate) != candidate or not os.path.lexists(candidate):
        return None
    return Path(candidate)


def href(path: Path, base: Path) -> str:
    """A relative URL from a page in directory ``base`` to ``path``: every segment
    percent-encoded, so no name reads as a scheme (``javascript:``), a query or a fragment."""
    relative = os.path.relpath(path, base)
    return "./" + "/".join(quote(part, safe="") for part in relative.split(os.sep))


@dataclass(frozen=True)
class Artifact:
    name: str  # relative to the artifacts folder, as text
    size: int
    path: Path | None  # None: not linked (a symlink, a special file, an active document)
    note: str = ""
    preview: str | None = None


def list_artifacts(folder: Path | None) -> tuple[list[Artifact], int]:
    """The files under ``folder`` (walked without following links), at most
    ``ARTIFACTS_PER_ROLLOUT``, and how many there were in all."""
    if folder is None or not folder.is_dir():
        return [], 0
    found: list[Artifact] = []
    total = 0
    previews = 0
    for top, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        entries = sorted(files) + [d for d in dirs if os.path.islink(os.path.join(top, d))]
        for name in entries:
            total += 1
            if len(found) >= ARTIFACTS_PER_ROLLOUT:
                continue
            path = Path(top) / name
            shown = path.relative_to(folder).as_posix()
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISLNK(info.st_mode):
                found.append(Artifact(shown, 0, None, "a symlink: not followed"))
                continue
            if not stat.S_ISREG(info.st_mode):
                found.append(Artifact(shown, 0, None, "not a regular file"))
                continue
            preview = None
            if previews < PREVIEWS_PER_ROLLOUT and (text := read_text_prefix(path)) is not None:
                preview = text
                previews += 1
            if path.suffix.lower() in ACTIVE_SUFFIXES:
                note = "a document a browser would run: shown as text, not linked"
                found.append(Artifact(shown, info.st_size, None, note, preview))
            else:
                found.append(Artifact(shown, info.st_size, path, "", preview))
    return found, total


def read_text_prefix(path: Path, limit: int = PREVIEW_BYTES) -> str | None:
    """The first ``limit`` bytes of a regular file as text, or ``None`` if it looks binary."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        data = handle.read(limit + 1)
    if b"\0" in data:
        return None
    text = data[:limit].decode("utf-8", errors="replace")
    if text.count("\ufffd") > len(text) // 10 + 1:
        return None
    return text + ("\n[... cut at 16 KiB]" if len(data) > limit else "")


def read_bounded(path: Path, limit: int) -> bytes | None:
    """A regular file's bytes if it is at most ``limit`` long (no symlink followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        return handle.read(limit + 1)[:limit]
