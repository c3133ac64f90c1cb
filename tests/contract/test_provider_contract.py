"""The provider contract: what every sandbox provider must do, checked on real sandboxes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from host_support import unique_marker

from backends.sandbox.contract import Provider
from backends.sandbox.errors import ExecTimeoutError, SandboxNotRunningError, SandboxPathError

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]


async def test_exec_semantics(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path, env={"FROM_TASK": "t"})
    await env.start(force_build=False)
    try:
        res = await env.exec("echo out; echo err >&2; exit 3")
        assert (res.return_code, res.stdout, res.stderr) == (3, "out\n", "err\n")
        res = await env.exec("pwd; echo $A $FROM_TASK", cwd="/tmp", env={"A": "x"})
        assert res.stdout == "/tmp\nx t\n"
        res = await env.exec("id -u; echo $HOME", user="nobody")
        assert res.stdout.split() == ["65534", "/nonexistent"]
        assert (await env.exec("id -u", user=0)).stdout == "0\n"
        # A missing executable or directory is an ordinary failed result.
        assert (await env.exec("no-such-binary")).return_code == 127
        assert (await env.exec("true", cwd="/no/such/dir")).return_code != 0
        assert (await env.exec("ls /logs")).stdout.split() == ["agent", "artifacts", "verifier"]
        assert (await env.exec("stat -c %a /logs/agent")).stdout == "777\n"
        # The command inherits stdin, stdout and stderr, nothing of the machinery (fd 3 is
        # the listing's own).
        assert (await env.exec("ls /proc/self/fd")).stdout.split() == ["0", "1", "2", "3"]
    finally:
        await env.stop(delete=True)


async def test_exec_user_has_supplementary_groups(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path)
    await env.start(force_build=False)
    try:
        setup = await env.exec("groupadd -g 2001 devs && useradd -m -u 1500 -G devs alice")
        assert setup.return_code == 0, setup.stderr
        res = await env.exec(
            "id -u; id -g; id -G; cat /proc/self/status | grep CapEff", user="alice"
        )
        uid, gid, groups, caps = res.stdout.splitlines()
        assert (uid, gid) == ("1500", "1500")
        assert set(groups.split()) == {"1500", "2001"}
        assert caps.split()[1] == "0000000000000000"  # no capabilities left
        assert (await env.exec("id -G", user="nobody")).stdout.split() == ["65534"]
    finally:
        await env.stop(delete=True)


async def test_files_round_trip(provider: Provider, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o750)
    (src / "sub" / "data.txt").write_text("data")
    (src / "link").symlink_to("sub/data.txt")
    env = provider.make(tmp_path)
    await env.start(force_build=False)
    try:
        await env.upload_dir(src, "/work/in")
        res = await env.exec(
            "stat -c '%a %U' /work/in/run.sh; readlink /work/in/link; /work/in/run.sh"
        )
        assert res.stdout == "750 root\nsub/data.txt\nhi\n"
        await env.upload_file(src / "sub" / "data.txt", "/work/one/copy.txt")
        assert (await env.exec("cat /work/one/copy.txt")).stdout == "data"
        # Symlinks planted inside point at host paths: a host tool reading the download must
        # never be led to a host file, so only links that stay inside the target are kept.
        await env.exec(
            "ln -s /root/.ssh/id_rsa /work/in/trajectory.json && ln -s ../../../etc /work/in/up"
            " && chmod 4755 /work/in/run.sh && chmod 777 /work/in"
        )
        out = tmp_path / "out"
        out.mkdir(mode=0o700)
        await env.download_dir("/work/in", out)
        assert (out / "sub" / "data.txt").read_text() == "data"
        assert os.readlink(out / "link") == "sub/data.txt"
        assert not (out / "trajectory.json").is_symlink() and not (out / "up").is_symlink()
        assert (out / "run.sh").stat().st_mode & 0o7777 == 0o755  # setuid dropped
        assert out.stat().st_mode & 0o777 == 0o700  # the host's target keeps its own mode
        await env.download_file("/work/in/link", tmp_path / "single.txt")
        assert (tmp_path / "single.txt").read_text() == "data"
        with pytest.raises(IsADirectoryError):
            await env.download_file("/work/in/sub", tmp_path / "a-dir")
        with pytest.raises(OSError, match="not a regular file"):
            await env.download_file("/dev/null", tmp_path / "a-device")
        with pytest.raises(SandboxPathError, match="escapes"):
            await env.upload_file(src / "run.sh", "../../etc/x")
        with pytest.raises(SandboxPathError, match="escapes"):
            await env.download_dir("/../../etc", tmp_path / "nope")
        with pytest.raises(FileNotFoundError):
            await env.download_file("/no/such/file", tmp_path / "missing")
    finally:
        await env.stop(delete=True)


async def test_timeout_kills_tree(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path)
    await env.start(force_build=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(ExecTimeoutError, match="timed out"):
            await env.exec("(setsid sleep 1000 &) ; nohup sleep 1000 & sleep 1000", timeout_sec=1)
        assert time.monotonic() - t0 < 5
        res = await env.exec("ps -eo comm | grep -c sleep")
        assert res.stdout.strip() in ("0", "1")  # 1 = the keepalive
        # Cancellation (Harbor's agent timeout) kills the command too.
        with anyio.move_on_after(0.5):
            await env.exec("sleep 1000")
        assert (await env.exec("ps -eo args | grep -c '^sleep 1000'")).stdout.strip() == "0"
        # A fraction of a second is a timeout of its own, not "no limit" nor a whole second.
        t0 = time.monotonic()
        with pytest.raises(ExecTimeoutError, match="timed out"):
            await env.exec("sleep 10; echo done", timeout_sec=0.5)  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 5
        assert (await env.exec("echo fast", timeout_sec=2.5)).stdout == "fast\n"  # type: ignore[arg-type]
    finally:
        await env.stop(delete=True)


async def test_stop_kills_daemons_and_leaves_nothing(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path)
    await env.start(force_build=False)
    daemon = f"sleep {unique_marker()}"  # no other suite on the host runs it
    res = await env.exec(f"setsid nohup {daemon} >/dev/null 2>&1 & echo started")
    assert res.stdout == "started\n"
    deadline = time.monotonic() + 5  # the daemon may still be exec'ing when echo returns
    if not provider.local_internals:
        while not _host_processes(daemon):
            assert time.monotonic() < deadline, "the daemon never started"
            await anyio.sleep(0.01)
        await env.stop(delete=True)
        await env.stop(delete=True)  # idempotent
        assert not _host_processes(daemon)
        return
    box = env._box  # type: ignore[attr-defined]
    while not any(_cmdline(p) == daemon for p in box.cgroup.members()):
        assert time.monotonic() < deadline, "the daemon is not in the sandbox's cgroup"
        await anyio.sleep(0.01)
    await env.stop(delete=True)
    assert not _host_processes(daemon)
    assert not _leftovers(box)


def _leftovers(box, within: float = 5.0) -> list[str]:
    """Run dir, cgroups and mounts a stopped sandbox must not leave behind.

    Its processes must be gone when stop() returns; directories may be removed in the
    background, but within a bounded time.
    """
    deadline = time.monotonic() + within
    while True:
        left = [str(box.dir)] if box.dir.exists() else []
        left += [str(d) for d in box.cgroup._dirs if Path(d).exists()]
        if box.name in Path("/proc/self/mounts").read_text():
            left.append("mount")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


async def test_network_none_by_default_public_on_request(
    provider: Provider, tmp_path: Path
) -> None:
    probe = "python3 -c \"import socket; s=socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 53))\" 2>&1; ip=$(cat /proc/net/dev | grep -c :); echo ifaces=$ip"
    env = provider.make(tmp_path)
    await env.start(force_build=False)
    try:
        res = await env.exec(probe)
        assert "unreachable" in res.stdout.lower() and "ifaces=1" in res.stdout
    finally:
        await env.stop(delete=True)
    with pytest.raises(ValueError, match="allowlist"):
        provider.make(tmp_path, network_mode="allowlist", allowed_hosts=["example.org"])


CONNECT = """
import socket, sys
for host, port in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        print(socket.create_connection((host, int(port)), timeout=2).recv(64).decode().strip())
    except OSError as e:
        print(type(e).__name__)
"""


def _host_address() -> str | None:
    """This host's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


@contextlib.contextmanager
def _tcp_banner(host: str, text: str) -> Iterator[int]:
    srv = socket.create_server((host, 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(text.encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        srv.close()


async def test_public_network_is_its_own_not_the_hosts(provider: Provider, tmp_path: Path) -> None:
    (tmp_path / "connect.py").write_text(CONNECT)
    outside = _host_address()
    with (
        _tcp_banner("127.0.0.1", "host-loopback") as lo_port,
        _tcp_banner("0.0.0.0", "host-network") as any_port,
    ):
        one = provider.make(tmp_path, network_mode="public")
        two = provider.make(tmp_path, network_mode="public")
        await one.start(force_build=False)
        await two.start(force_build=False)
        try:
            await one.upload_file(tmp_path / "connect.py", "/connect.py")
            targets = f"127.0.0.1 {lo_port} 10.0.2.2 {lo_port}"
            if outside:
                targets += f" {outside} {any_port}"
            res = await one.exec(f"python3 /connect.py {targets}; grep -c : /proc/net/dev")
            lines = res.stdout.split()
            # The host's loopback services (an inference server, say) stay out of reach ...
            assert lines[0] == "ConnectionRefusedError" and lines[1] != "host-loopback"
            # ... the outside is reachable through NAT, on the sandbox's own interface.
            if outside:
                assert lines[2] == "host-network"
            assert lines[-1] == "2"  # lo and the uplink, not the host's interfaces
            # Each sandbox has its own ports: both can listen on the same one.
            listen = "socat TCP-LISTEN:18080,bind=127.0.0.1 EXEC:'echo {}' & sleep 0.3"
            for env, name in ((one, "one"), (two, "two")):
                await env.exec(
                    listen.format(name) + "; grep -c ':4E20 00000000:0000 0A' /proc/net/tcp"
                )
            res = await two.exec(
                "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', 18080)).recv(9).decode().strip())\""
            )
            assert res.stdout == "two\n"
        finally:
            await one.stop(delete=True)
            await two.stop(delete=True)


async def test_host_secrets_unreadable(provider: Provider, tmp_path: Path) -> None:
    _needs_local_internals(provider)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data").write_text("host data\n")
    binds = f"/etc:/host-etc:ro,{shared}:/shared:ro"
    env = provider.make(tmp_path, kwargs={"extra_binds": binds})
    await env.start(force_build=False)
    try:
        res = await env.exec("cat /host-etc/shadow; echo rc=$?; touch /host-etc/x; id -u")
        assert "Permission denied" in res.stderr and "rc=1" in res.stdout
        assert res.stdout.strip().endswith("0")  # root inside, yet not host root
        # Root inside cannot lift a read-only bind by remounting it writable.
        res = await env.exec(
            "mount -o remount,bind,rw /shared; echo changed > /shared/data; cat /shared/data"
        )
        assert res.stdout == "host data\n" and "Read-only file system" in res.stderr
        assert (shared / "data").read_text() == "host data\n"
    finally:
        await env.stop(delete=True)


async def test_limits_contain_memory_and_fork_bombs(provider: Provider, tmp_path: Path) -> None:
    pids = {"pids_limit": 64} if provider.local_internals else None  # a pod has its own
    cpus = 0.5 if provider.local_internals else 1  # pods take whole cores
    env = provider.make(tmp_path, memory_mb=128, cpus=cpus, kwargs=pids)
    await env.start(force_build=False)
    try:
        hog = await env.exec("python3 -c \"b=bytearray(512*1024*1024); print('survived')\"")
        assert hog.return_code == 137 and "survived" not in hog.stdout
        t0 = time.monotonic()
        bomb = env.exec("f() { f | f & }; f; sleep 30", timeout_sec=3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_swallow, bomb)
            await anyio.sleep(1)
            # The host stays responsive while the bomb hits pids.max: a host it filled would
            # refuse the fork or stall far longer than this (generous: the host may be loaded).
            t = time.monotonic()
            subprocess.run(["true"], check=True)  # noqa: ASYNC221 - measures host latency
            assert time.monotonic() - t < 5.0
        assert time.monotonic() - t0 < 15
        alive = await env.exec("echo alive")
        assert alive.stdout == "alive\n", alive
    finally:
        await env.stop(delete=True)


def _needs_local_internals(provider: Provider) -> None:
    if not provider.local_internals:
        pytest.skip(f"{provider.name}: host binds, disk images and owner death are local-only")


async def _swallow(aw) -> None:
    try:
        await aw
    except ExecTimeoutError:
        pass


def test_no_leak_when_owner_dies(provider: Provider, tmp_path: Path) -> None:
    _needs_local_internals(provider)
    daemon = f"sleep {unique_marker()}"  # no other suite on the host runs it
    script = f"""
import anyio, sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from pathlib import Path
from backends.sandbox.contract import PROVIDERS
p = [p for p in PROVIDERS if p.name == {provider.name!r}][0]
async def main():
    env = p.make(Path({str(tmp_path)!r}), storage_mb=64)  # with a disk image to detach too
    await env.start(force_build=False)
    await env.exec("setsid nohup {daemon} >/dev/null 2>&1 &")
    print(env._box.name, flush=True)
    await anyio.sleep(1000)
anyio.run(main)
"""
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    name = owner.stdout.readline().strip()
    assert name
    deadline = time.monotonic() + 5  # the daemon may still be exec'ing
    while not _host_processes(daemon):
        assert time.monotonic() < deadline, "the daemon never started"
        time.sleep(0.01)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 5
    while _host_processes(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _host_processes(daemon), "a daemon outlived its sandbox's owner"
    assert not _disk_attached(name), "the sandbox's disk image is still attached"
    from backends.sandbox.runtime import reap_orphans
    from backends.sandbox.settings import run_dir

    assert name in reap_orphans()
    assert not (run_dir() / name).exists()


def _disk_attached(name: str, within: float = 5.0) -> bool:
    """Is a loop device still backed by this sandbox's disk image (detach is asynchronous)?"""
    deadline = time.monotonic() + within
    while True:
        backing = [p.read_text() for p in Path("/sys/block").glob("loop*/loop/backing_file")]
        if not any(f"/{name}/" in b for b in backing) or time.monotonic() > deadline:
            return any(f"/{name}/" in b for b in backing)
        time.sleep(0.02)


async def test_storage_limit_contains_disk_writes(provider: Provider, tmp_path: Path) -> None:
    _needs_local_internals(provider)
    env = provider.make(tmp_path, storage_mb=64)
    # Opted out (for hosts without loop devices): the same task writes without a limit.
    free = provider.make(tmp_path, storage_mb=64, kwargs={"enforce_storage": "false"})
    await env.start(force_build=False)
    await free.start(force_build=False)
    try:
        # Everything the sandbox writes (/, /tmp, /logs) counts; past the limit: ENOSPC,
        # in that sandbox only, and it keeps working once space is freed.
        res = await env.exec("dd if=/dev/zero of=/logs/agent/fill bs=1M count=100")
        assert res.return_code != 0 and "No space left on device" in res.stderr
        res = await env.exec("head -c 1048576 /dev/zero > /tmp/more")
        assert res.return_code != 0 and "No space left on device" in res.stderr
        assert (await free.exec("dd if=/dev/zero of=/tmp/big bs=1M count=100")).return_code == 0
        await env.exec("rm /logs/agent/fill")
        ok = await env.exec("dd if=/dev/zero of=/ok bs=1M count=20 && echo x > /logs/agent/note")
        assert ok.return_code == 0, ok.stderr
        assert (await env.exec("cat /logs/agent/note")).stdout == "x\n"
        size = int((await env.exec("df -k --output=size / | tail -1")).stdout)
        assert 48 * 1024 < size <= 64 * 1024  # the sandbox sees its own disk's size
    finally:
        await env.stop(delete=True)
        await free.stop(delete=True)
    assert not _disk_attached(env._box.name if env._box else "")  # type: ignore[attr-defined]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _host_processes(cmdline: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)) == cmdline]


async def test_oversized_output_is_capped_and_said(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path, kwargs={"max_output_bytes": 4096})
    await env.start(force_build=False)
    try:
        # A megabyte on stdout: the command still runs to its end (it is drained, not
        # blocked), the caller gets the first 4 KiB and a note of what was dropped.
        res = await env.exec("head -c 1000000 /dev/zero | tr '\\0' a; echo done >&2; exit 4")
        assert res.return_code == 4
        assert res.stdout == "a" * 4096
        assert res.stderr is not None
        assert res.stderr.startswith("done\n")
        assert "stdout exceeded 4096 bytes; 995904 further bytes were dropped" in res.stderr
        small = await env.exec("echo fine")
        assert (small.stdout, small.stderr) == ("fine\n", "")
    finally:
        await env.stop(delete=True)


async def test_exec_edge_cases(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path)
    await env.start(force_build=False)
    try:
        assert (await env.exec("echo ok", timeout_sec=0)).stdout == "ok\n"  # 0: no limit
        res = await env.exec("id -u", user=70000)  # beyond the ids a sandbox maps
        if provider.local_internals:
            assert res.return_code == 126 and "outside" in (res.stderr or "")
        else:  # an unknown user is an ordinary failed result
            assert res.return_code != 0 and "does not exist" in (res.stderr or "")
        # A long command (120 KB of two-byte characters) runs like a short one.
        res = await env.exec("printf %s " + "é" * 60000 + " | wc -c")
        assert res.stdout.strip() == "120000"
        # A command cut short by stop() is not a result (137 would read as an OOM kill).
        async with anyio.create_task_group() as tg:
            outcome: list[BaseException] = []

            async def run_long() -> None:
                try:
                    await env.exec("sleep 30")
                except SandboxNotRunningError as e:
                    outcome.append(e)

            tg.start_soon(run_long)
            with anyio.fail_after(60):  # running, not still starting (that is another error)
                while (await env.exec("pgrep -f '^sleep 30$'")).return_code != 0:
                    await anyio.sleep(0.05)
            await env.stop(delete=True)
        assert outcome and "stopped" in str(outcome[0])
    finally:
        await env.stop(delete=True)


async def test_root_inside_cannot_end_the_sandbox(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path)
    await env.start(force_build=False)
    try:
        res = await env.exec("sleep 100 & kill -9 -1; kill -9 1; kill -TERM 1; echo after")
        assert res.stdout == "after\n"
        # Orphans are reaped, not left as zombies holding pids.
        await env.exec("for i in 1 2 3; do (sleep 0.05 &); (setsid sleep 0.05 &); done")
        zombies = "ps -eo stat= | grep -c '^Z' || true"
        with anyio.move_on_after(30):  # a loaded host may take a while to run pid 1's reaping
            while (await env.exec(zombies)).stdout.strip() != "0":
                await anyio.sleep(0.1)
        assert (await env.exec(zombies)).stdout.strip() == "0"
        assert (await env.exec("echo alive")).stdout == "alive\n"
    finally:
        await env.stop(delete=True)


async def test_downloads_are_bounded(provider: Provider, tmp_path: Path) -> None:
    env = provider.make(tmp_path, storage_mb=64, kwargs={"max_download_bytes": 8 * 1024 * 1024})
    await env.start(force_build=False)
    try:
        # A sparse file counts at its apparent size: past the cap it is refused, within the
        # cap it lands on the host still sparse.
        await env.exec("truncate -s 2G /logs/agent/sparse && echo end >> /logs/agent/sparse")
        with pytest.raises(OSError, match="larger than 8388608 bytes"):
            await env.download_dir("/logs/agent", tmp_path / "agent")
        await env.exec("truncate -s 6M /logs/agent/sparse && echo end >> /logs/agent/sparse")
        await env.download_dir("/logs/agent", tmp_path / "agent")
        got = tmp_path / "agent" / "sparse"
        assert got.stat().st_size == 6 * 1024**2 + 4 and got.stat().st_blocks * 512 < 2**20
        # Real data past the cap is refused; nothing is left half-written to trust.
        await env.exec("head -c 20000000 /dev/urandom > /logs/agent/big")
        with pytest.raises(OSError, match="larger than 8388608 bytes"):
            await env.download_file("/logs/agent/big", tmp_path / "big")
        assert not (tmp_path / "big").exists()
    finally:
        await env.stop(delete=True)


async def test_dev_is_not_spare_storage(provider: Provider, tmp_path: Path) -> None:
    _needs_local_internals(provider)
    env = provider.make(tmp_path, storage_mb=64, kwargs={"shm_size_mb": 16})
    await env.start(force_build=False)
    try:
        res = await env.exec("echo x > /dev/stash; echo rc=$?")
        assert "rc=1" in res.stdout and "Read-only file system" in res.stderr
        res = await env.exec("head -c 32000000 /dev/zero > /dev/shm/big")
        assert res.return_code != 0 and "No space left on device" in res.stderr
        res = await env.exec("rm /dev/shm/big; head -c 1000000 /dev/zero > /dev/shm/small")
        assert res.return_code == 0  # shared memory itself still works
    finally:
        await env.stop(delete=True)
