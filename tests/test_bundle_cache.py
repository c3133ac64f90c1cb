"""Pruning the bundle cache: least recently used first, never what someone (anywhere) holds.

The entries are laid out as the builder and the installer leave them (a bundle's manifest and
its wheels hard-linked from the wheelhouse, an environment's ``.complete`` naming its bundle);
the holders are real other processes using ``backends.bundle.cache``'s locks, as a running
backend does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.bundle import cache

MIB = 1024 * 1024
OLD = time.time() - 30 * 86400


def make_bundle(root: Path, key: str, wheels: list[str], *, used: float) -> Path:
    bundle = root / "bundles" / key
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "project").mkdir()
    (bundle / "project" / "main.py").write_text("x = 1\n")
    house = root / "bundles" / "wheelhouse" / "manylinux_2_36_x86_64-py3.12"
    house.mkdir(parents=True, exist_ok=True)
    for name in wheels:
        wheel = house / name
        if not wheel.exists():
            wheel.write_bytes(os.urandom(MIB))
        os.link(wheel, bundle / "wheels" / name)
    (bundle / "manifest.json").write_text(json.dumps({"key": key}))
    cache.stamp(bundle)
    os.utime(bundle / cache.STAMP, (used, used))
    return bundle


def make_environment(root: Path, key: str, bundle: str, *, mib: int, used: float) -> Path:
    env = root / "environments" / key
    (env / "lib").mkdir(parents=True)
    (env / "lib" / "blob").write_bytes(os.urandom(mib * MIB))
    (env / ".complete").write_text(json.dumps({"bundle": bundle}))
    cache.stamp(env)
    os.utime(env / cache.STAMP, (used, used))
    return env


@pytest.fixture
def holder() -> Iterator[list[subprocess.Popen[str]]]:
    """Start other processes that hold cache entries, as a running backend does."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def hold_in_another_process(entry: Path, started: list[subprocess.Popen[str]]) -> int:
    code = (
        "import sys; from pathlib import Path; from backends.bundle import cache; "
        f"h = cache.hold_blocking(Path({str(entry)!r})); print('held', flush=True); "
        "sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    started.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc.pid


def test_prune_goes_least_recently_used_first_down_to_the_bound(tmp_path: Path) -> None:
    now = time.time()
    make_bundle(tmp_path, "b-old", ["a-1-py3-none-any.whl"], used=OLD)
    make_bundle(tmp_path, "b-new", ["c-1-py3-none-any.whl"], used=now)
    oldest = make_environment(tmp_path, "e-oldest", "b-old", mib=4, used=OLD)
    middle = make_environment(tmp_path, "e-middle", "b-old", mib=4, used=now - 3600)
    newest = make_environment(tmp_path, "e-newest", "b-new", mib=4, used=now)
    # 12 MiB of environments, 2 of wheels, a little of the bundles' own: 11 MiB means the
    # oldest environment must go, and only it.
    report = cache.prune(max_bytes=11 * MIB, root=tmp_path)
    assert [e.path for e in report.removed] == [oldest]
    assert not oldest.exists() and middle.exists() and newest.exists()
    assert not cache.lock_path(oldest).exists()
    assert report.kept_bytes <= 11 * MIB

    # By age: what was not used for a week goes, a bundle with what is left of its
    # environments. Its wheel is unused from now on, not for a week: it stays.
    os.utime(middle / cache.STAMP, (OLD, OLD))
    report = cache.prune(older_than_sec=7 * 86400, root=tmp_path)
    assert {e.path.name for e in report.removed} == {"e-middle", "b-old"}
    assert newest.exists() and (tmp_path / "bundles" / "b-new").exists()
    house = tmp_path / "bundles" / "wheelhouse" / "manylinux_2_36_x86_64-py3.12"
    assert sorted(w.name for w in house.iterdir()) == [
        "a-1-py3-none-any.whl",
        "c-1-py3-none-any.whl",
    ]
    # Down to a bound, the unlinked wheel goes; one a held bundle links stays.
    using = cache.try_hold(tmp_path / "bundles" / "b-new")
    report = cache.prune(max_bytes=0, root=tmp_path)
    assert {e.path.name for e in report.removed} == {"e-newest", "a-1-py3-none-any.whl"}
    assert [w.name for w in house.iterdir()] == ["c-1-py3-none-any.whl"]
    assert using is not None
    using.release()


def test_lock_files_of_entries_that_never_were_go(tmp_path: Path) -> None:
    failed = tmp_path / "bundles" / "never-built"
    cache.try_hold(failed)  # a build that failed let go of it (this hold is dropped at once)
    building = tmp_path / "bundles" / "being-built"
    held = cache.try_hold(building)
    assert cache.lock_path(failed).exists() and held is not None
    cache.prune(root=tmp_path)
    assert not cache.lock_path(failed).exists()
    assert cache.lock_path(building).exists()  # its build still holds it
    held.release()


def test_a_dry_run_removes_nothing(tmp_path: Path) -> None:
    make_bundle(tmp_path, "b", ["a-1-py3-none-any.whl"], used=OLD)
    env = make_environment(tmp_path, "e", "b", mib=1, used=OLD)
    report = cache.prune(everything=True, dry_run=True, root=tmp_path)
    assert {e.path.name for e in report.removed} == {"e", "b"}
    assert env.exists() and (tmp_path / "bundles" / "b" / "manifest.json").exists()


def test_what_another_process_holds_is_never_pruned(
    tmp_path: Path, holder: list[subprocess.Popen[str]]
) -> None:
    make_bundle(tmp_path, "b", ["a-1-py3-none-any.whl"], used=OLD)
    env = make_environment(tmp_path, "e", "b", mib=1, used=OLD)
    other = make_environment(tmp_path, "e-other", "b", mib=1, used=OLD)
    pid = hold_in_another_process(env, holder)

    report = cache.prune(everything=True, root=tmp_path)
    # The free environment went; the held one stayed, and so did the bundle it binds.
    assert not other.exists()
    assert env.exists() and (tmp_path / "bundles" / "b").exists()
    assert {e.path.name for e in report.in_use} == {"e", "b"}

    os.kill(pid, signal.SIGKILL)  # a crashed user's hold goes with its process
    holder[0].wait()
    report = cache.prune(everything=True, root=tmp_path)
    assert not env.exists() and not (tmp_path / "bundles" / "b").exists()
    assert report.in_use == []


def test_a_user_waiting_on_a_removal_holds_the_new_entry_not_the_removed_one(
    tmp_path: Path,
) -> None:
    entry = tmp_path / "environments" / "e"
    entry.mkdir(parents=True)
    pruner = cache.try_hold(entry, exclusive=True)
    assert pruner is not None
    held: list[cache.Hold] = []
    user = threading.Thread(target=lambda: held.append(cache.hold_blocking(entry, poll_sec=0.01)))
    user.start()
    time.sleep(0.1)
    assert not held  # the user waits while the pruner removes
    cache.lock_path(entry).unlink()  # what prune does, before letting go
    pruner.release()
    user.join(5)
    assert held and held[0].held
    # The user's hold is on the lock file now at the path: a second pruner sees it.
    assert cache.try_hold(entry, exclusive=True) is None
    held[0].release()
    assert cache.try_hold(entry, exclusive=True) is not None


def test_a_build_linking_from_the_wheelhouse_keeps_its_wheels(
    tmp_path: Path, holder: list[subprocess.Popen[str]]
) -> None:
    house = tmp_path / "bundles" / "wheelhouse" / "manylinux_2_36_x86_64-py3.12"
    house.mkdir(parents=True)
    (house / "fresh-1-py3-none-any.whl").write_bytes(b"downloaded, not linked yet")
    hold_in_another_process(house, holder)
    report = cache.prune(everything=True, root=tmp_path)
    assert (house / "fresh-1-py3-none-any.whl").exists()
    assert report.removed == []


def test_sizes_and_ages_parse_and_bad_ones_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache.parse_size("20G") == 20 * 1024**3
    assert cache.parse_size("512MiB") == 512 * MIB
    assert cache.parse_age("7d") == 7 * 86400
    with pytest.raises(ValueError, match="not a size"):
        cache.parse_size("lots")
    with pytest.raises(ValueError, match="not a duration"):
        cache.parse_age("7 weeks")
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "none")
    assert cache.configured_max_bytes() is None
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "3G")
    assert cache.configured_max_bytes() == 3 * 1024**3


def test_cli_prune_reports_and_refuses_bad_input(tmp_path: Path) -> None:
    make_bundle(tmp_path, "b", ["a-1-py3-none-any.whl"], used=OLD)
    make_environment(tmp_path, "e", "b", mib=1, used=OLD)
    script = Path(sys.executable).with_name("backends")
    env = {**os.environ, "BACKENDS_CACHE": str(tmp_path)}
    done = subprocess.run(
        [str(script), "bundle", "prune", "--older-than", "7d", "--dry-run", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(done.stdout)
    assert doc["dry_run"] is True
    assert {Path(e["path"]).name for e in doc["removed"]} >= {"e", "b"}
    assert (tmp_path / "environments" / "e").exists()
    bad = subprocess.run(
        [str(script), "bundle", "prune", "--max-size", "huge"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a size" in bad.stderr
