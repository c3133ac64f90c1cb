"""A tiny OpenAI-compatible policy for tests: real HTTP on 127.0.0.1, answers chosen per test."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from openai import AsyncOpenAI

from backends import AgentWorkflow, AgentWorkflowContext, Grader, GraderContext, get_rollout_context

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
async def fake_upstream(
    *routes: web.AbstractRouteDef, ssl_context: ssl.SSLContext | None = None, **runner: Any
) -> AsyncIterator[str]:
    """Serve aiohttp ``routes`` on a free port of 127.0.0.1 (HTTPS with ``ssl_context``), as a
    policy upstream; yield its base URL (``.../v1``). ``runner``: ``web.AppRunner`` options."""
    app = web.Application()
    app.add_routes(routes)
    served = web.AppRunner(app, **{"shutdown_timeout": 0.1, **runner})
    await served.setup()
    await web.TCPSite(served, "127.0.0.1", 0, ssl_context=ssl_context).start()
    port = served.addresses[0][1]
    try:
        yield f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}/v1"
    finally:
        await served.cleanup()


def chat_upstream(
    chat: Callable[[web.Request], Awaitable[web.StreamResponse]], **options: Any
) -> contextlib.AbstractAsyncContextManager[str]:
    """``fake_upstream`` answering ``POST /v1/chat/completions`` with ``chat``."""
    return fake_upstream(web.post("/v1/chat/completions", chat), **options)


def policy_server(reply: Reply) -> contextlib.AbstractAsyncContextManager[str]:
    """Serve ``POST /v1/chat/completions`` with ``reply``; yield the base URL (``.../v1``)."""

    async def chat(request: web.Request) -> web.Response:
        status, payload = reply(await request.json(), request.headers.get("Authorization", ""))
        return web.json_response(payload, status=status)

    return chat_upstream(chat)


# What the workflow below saw: the URL and key its rollout context handed it.
SEEN: dict[str, Any] = {}


class AskPolicy(AgentWorkflow[Any]):
    """Asks the policy once with the openai client, through whatever URL and key it is given.

    A failing call surfaces as the agent's own error, as a real agent's would.
    """

    async def run(self, ctx: AgentWorkflowContext[Any]) -> Any:
        rollout = get_rollout_context()
        assert rollout is not None
        SEEN["url"], SEEN["key"] = rollout.base_url, rollout.api_key
        client = AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.api_key, max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model="policy",
                messages=ctx.prompt,  # type: ignore[arg-type]
            )
        except Exception as exc:
            raise RuntimeError("my agent could not continue") from exc
        finally:
            await client.close()
        return [*ctx.prompt, reply.choices[0].message.model_dump(exclude_none=True)]


class Exact(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        ctx.set_reward(float(ctx.sample.messages[-1]["content"] == ctx.label))
