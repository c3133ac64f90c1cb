"""A hostile sandbox flooding the relay with connections (run by tests/test_relay_serving.py).

    python tests/relay_flood.py <relay origin> <rollout base URL> <token> <connections> <source address>

Keeps ``connections`` open at once from ``source address`` (a pod's own), reopening each one the relay closes, of five kinds: silent,
trickling its headers, idle after a quick unauthenticated request, 200 pipelined requests whose
answers it never reads, and a real call on its own rollout's route (whose policy never answers).
Prints its counts as JSON once a second, and a last time when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
from collections import Counter
from urllib.parse import urlsplit

KINDS = ("silent", "trickle", "idle", "pipelined", "call")


async def connection(
    host: str, port: int, source: str, kind: str, call: bytes, counts: Counter[str]
) -> None:
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            counts["connect failed"] += 1
            await asyncio.sleep(0.05)
            continue
        counts["opened"] += 1
        try:
            if kind == "trickle":
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            elif kind == "idle":
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            elif kind == "pipelined":
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
            elif kind == "call":
                writer.write(call)
                head = await reader.read(64 * 1024)
                if head:
                    counts["429" if head.startswith(b"HTTP/1.1 429") else "call answered"] += 1
            if kind == "pipelined":  # never read the answers: wait for the relay to drop it
                await reader.readexactly(1 << 30)
            while await reader.read(64 * 1024):  # until the relay closes the connection
                pass
        except (OSError, asyncio.IncompleteReadError):
            pass
        counts["closed by the relay"] += 1
        writer.close()


async def main() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    origin, base_url, token, total, source = sys.argv[1:6]
    at = urlsplit(origin)
    host, port = at.hostname or "127.0.0.1", at.port or 80
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    call = (
        f"POST {urlsplit(base_url).path}/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts: Counter[str] = Counter()
    tasks = [
        asyncio.create_task(connection(host, port, source, KINDS[i % len(KINDS)], call, counts))
        for i in range(int(total))
    ]
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)
    while not stdin_closed.done():
        print(json.dumps(counts), flush=True)
        await asyncio.wait([stdin_closed], timeout=1)
    for task in tasks:
        task.cancel()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
