"""Large uploads and downloads stream through disk: the owner's memory does not grow with them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]

SIZE_MB = 128

# Run in a fresh interpreter so its peak RSS is ours alone to measure.
SCRIPT = f"""
import hashlib, resource, sys
from pathlib import Path
import anyio
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from backends.sandbox.contract import PROVIDERS

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

async def main():
    tmp = Path(sys.argv[1])
    big = tmp / "big.bin"
    with open(big, "wb") as f:
        for i in range({SIZE_MB}):
            f.write(hashlib.sha256(str(i).encode()).digest() * 32768)  # 1 MiB, not all zeros
    env = PROVIDERS[0].make(tmp)
    await env.start(force_build=False)
    try:
        await env.exec("true")
        before = peak_mb()
        await env.upload_file(big, "/data/big.bin")
        size = (await env.exec("stat -c %s /data/big.bin")).stdout.strip()
        await env.download_file("/data/big.bin", tmp / "back.bin")
        await env.download_dir("/data", tmp / "dir")
        grown = peak_mb() - before
    finally:
        await env.stop(delete=True)
    same = all(
        (tmp / p).read_bytes() == big.read_bytes() for p in ("back.bin", "dir/big.bin")
    )
    print(size, same, round(grown))

anyio.run(main)
"""


def test_large_transfers_do_not_pass_through_memory(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    size, same, grown_mb = out.stdout.split()
    assert size == str(SIZE_MB * 1024 * 1024)
    assert same == "True"
    # Buffered in memory, the round trip would raise the peak by 2-3x the file's size.
    assert int(grown_mb) < SIZE_MB // 2, f"peak RSS grew by {grown_mb} MiB"
