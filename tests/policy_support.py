"""A tiny OpenAI-compatible policy for tests: real HTTP on 127.0.0.1, answers chosen per test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from aiohttp import web

# reply(request body, Authorization header) -> (HTTP status, JSON body)
Reply = Callable[[dict[str, Any], str], tuple[int, dict[str, Any]]]


def completion(
    body: dict[str, Any],
    content: str = "42",
    *,
    token_ids: Sequence[int] | None = None,
    logprobs: Sequence[float] | None = None,
) -> dict[str, Any]:
    """A chat completion answering ``content``, with vLLM-style token ids and logprobs if given."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "finish_reason": "stop",
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if logprobs is not None:
        tokens = list(content) if len(content) == len(logprobs) else ["?"] * len(logprobs)
        choice["logprobs"] = {
            "content": [
                {"token": token, "logprob": value, "top_logprobs": []}
                for token, value in zip(tokens, logprobs, strict=True)
            ]
        }
    completion_tokens = len(token_ids) if token_ids is not None else 1
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", "policy"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": completion_tokens,
            "total_tokens": 5 + completion_tokens,
        },
    }


@contextlib.asynccontextmanager
async def policy_server(reply: Reply) -> AsyncIterator[str]:
    """Serve ``POST /v1/chat/completions`` with ``reply``; yield the base URL (``.../v1``)."""

    async def chat(request: web.Request) -> web.Response:
        status, payload = reply(await request.json(), request.headers.get("Authorization", ""))
        return web.json_response(payload, status=status)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()
