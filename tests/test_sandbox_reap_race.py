"""Processes sharing one cache never take each other's live sandboxes for orphans.

Every process's first LocalSandbox start reaps the cache's orphans, and `backends sandbox
reap` may run at any time: here one process reaps in a tight loop while others start, use and
stop sandboxes (files crossing both ways), and every command of theirs must succeed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]
ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(
    """
    import anyio, sys, tempfile
    from pathlib import Path
    from backends.sandbox.contract import PROVIDERS

    async def main(cycles: int) -> None:
        with tempfile.TemporaryDirectory() as d:
            for i in range(cycles):
                env = PROVIDERS[0].make(Path(d))
                await env.start(force_build=False)
                try:
                    for _ in range(3):
                        res = await env.exec("sleep 0.02; echo ok")
                        assert (res.return_code, res.stdout) == (0, "ok\\n"), res
                    (Path(d) / "up").write_text(str(i))
                    await env.upload_file(Path(d) / "up", "/tmp/up")
                    await env.download_file("/tmp/up", Path(d) / "down")
                    assert (Path(d) / "down").read_text() == str(i)
                finally:
                    await env.stop(delete=True)
        print("worker done")

    anyio.run(main, int(sys.argv[1]))
    """
)

REAPER = textwrap.dedent(
    """
    import sys, time
    from backends.sandbox.runtime import reap_orphans
    deadline = time.monotonic() + float(sys.argv[1])
    loops = 0
    while time.monotonic() < deadline:
        reap_orphans()
        loops += 1
    print("reaper loops", loops)
    """
)


def test_a_reaper_looping_beside_live_sandboxes_takes_none_of_them(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, "8"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    reaper = subprocess.Popen(
        [sys.executable, "-c", REAPER, "20"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        outputs = [w.communicate(timeout=600)[0] for w in workers]
    finally:
        reaper.kill()
        reaper.wait()
    for worker, out in zip(workers, outputs, strict=True):
        assert worker.returncode == 0 and "worker done" in out, out[-3000:]
