"""A task's content hashes are Harbor's own answers, computed once per version of the task:
an edited, added, removed or renamed file is hashed again."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from harbor.models.task.task import Task
from harbor.publisher.packager import Packager
from harbor_support import write_task

from backends.harbor import taskhash

pytestmark = pytest.mark.filterwarnings("ignore:Task.checksum:DeprecationWarning")

Hashes = Callable[[Path], tuple[str, str]]


@pytest.fixture
def harbors(monkeypatch: pytest.MonkeyPatch) -> Hashes:
    """Harbor's unmemoized hashes; the memo is installed afresh (and undone) around the test."""
    content_hash = Packager.compute_content_hash
    checksum = Task.checksum.fget
    assert checksum is not None
    monkeypatch.setattr(taskhash, "_installed", False)
    monkeypatch.setattr(Packager, "compute_content_hash", staticmethod(content_hash))
    monkeypatch.setattr(Task, "checksum", Task.checksum)
    return lambda task_dir: (content_hash(task_dir)[0], checksum(Task(task_dir)))


def _hashes(task_dir: Path) -> tuple[str, str]:
    return Packager.compute_content_hash(task_dir)[0], Task(task_dir).checksum


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    walks: list[Path] = []
    collect = Packager.collect_files

    def counted(task_dir: Path) -> list[Path]:
        walks.append(task_dir)
        return collect(task_dir)

    monkeypatch.setattr(Packager, "collect_files", staticmethod(counted))
    return walks


def _same_size_and_mtime(path: Path) -> None:
    st = path.stat()
    path.write_text(path.read_text().swapcase())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_memoized_hashes_are_harbors_and_follow_edits(
    tmp_path: Path, harbors: Hashes, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = write_task(tmp_path, "t", test="echo 1 > /logs/verifier/reward.txt")
    taskhash.install()
    taskhash.install()  # idempotent
    walks = _count_walks(monkeypatch)
    expected = harbors(task)
    assert _hashes(task) == expected
    files = Packager.collect_files(task)
    walks.clear()
    for _ in range(5):
        assert _hashes(task) == expected
        assert Packager.compute_content_hash(task)[1] == files
    assert walks == [], "an unchanged task is not hashed again"

    tests = task / "tests"
    edits = {
        "edited": lambda: (tests / "test.sh").write_text("#!/bin/bash\necho 0\n"),
        "added": lambda: (tests / "helper.py").write_text("x = 1\n"),
        "renamed": lambda: (tests / "helper.py").rename(tests / "other.py"),
        "removed": lambda: (tests / "other.py").unlink(),
        "same size and mtime": lambda: _same_size_and_mtime(task / "instruction.md"),
    }
    seen = {harbors(task)}
    for what, edit in edits.items():
        edit()
        walks.clear()
        now = _hashes(task)
        assert walks, f"a task with a file {what} is hashed again"
        assert now == harbors(task), what
        seen.add(now)
    assert len(seen) == len(edits)  # removing the added file went back to an earlier tree


def test_fingerprint_follows_links_without_looping(tmp_path: Path) -> None:
    task = tmp_path / "t"
    (task / "data").mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("a")
    (task / "data" / "link.txt").symlink_to(outside)
    (task / "data" / "loop").symlink_to(task / "data")
    before = taskhash.fingerprint(task)
    outside.write_text("bb")
    assert taskhash.fingerprint(task) != before
