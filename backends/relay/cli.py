"""Command functions for ``backends relay`` and ``backends scripted-policy``.

Plain functions with typer-annotated parameters; the CLI registers them with
``app.command("relay")(relay_command)`` and ``app.command("scripted-policy")(scripted_policy_command)``.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import anyio
import typer

from backends.relay.scripted import Script, ScriptedPolicy
from backends.relay.service import Relay
from backends.relay.upstream import RelaySettings


def relay_command(
    upstream: Annotated[
        str, typer.Option(help="Upstream OpenAI-compatible base URL, e.g. http://host:8000/v1.")
    ],
    host: Annotated[str, typer.Option(help="TCP address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0 picks a free one).")] = 8765,
    unix_socket: Annotated[
        Path | None, typer.Option(help="Also listen on this Unix socket (for local sandboxes).")
    ] = None,
    upstream_key_env: Annotated[
        str, typer.Option(help="Environment variable holding the upstream API key.")
    ] = "BACKENDS_UPSTREAM_API_KEY",
    admin_token_env: Annotated[
        str,
        typer.Option(help="Environment variable holding the admin token (else one is made)."),
    ] = "BACKENDS_RELAY_ADMIN_TOKEN",
    request_token_ids: Annotated[
        bool, typer.Option(help="Ask the upstream for token ids and logprobs (vLLM/SGLang).")
    ] = False,
    advertised_url: Annotated[
        str | None, typer.Option(help="Origin remote sandboxes use to reach this relay.")
    ] = None,
    upstream_ca_file: Annotated[
        Path | None, typer.Option(help="Extra CA certificates (PEM) for an https upstream.")
    ] = None,
    upstream_speaks: Annotated[
        list[str] | None,
        typer.Option(
            help="An agent format the upstream serves itself ('responses', 'messages'; "
            "repeatable): forwarded as is instead of translated to chat completions."
        ),
    ] = None,
) -> None:
    """Run the rollout-scoped policy relay as its own process.

    Rollouts are registered over HTTP: POST /admin/rollouts {"rollout_id": ...} returns a token
    and base URL; DELETE /admin/rollouts/{id} ends it and returns its trace. Both need
    'Authorization: Bearer <admin token>'. The upstream key is read from the environment, never
    from the command line (where other users could read it).
    """
    admin_token = os.environ.get(admin_token_env) or secrets.token_urlsafe(32)
    try:
        settings = RelaySettings(
            request_token_ids=request_token_ids,
            upstream_ca_file=str(upstream_ca_file) if upstream_ca_file else None,
            native_apis=frozenset(upstream_speaks or ()),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--upstream-speaks") from exc
    relay = Relay(
        upstream_url=upstream,
        upstream_api_key=os.environ.get(upstream_key_env),
        host=host,
        port=port,
        unix_socket_path=unix_socket,
        advertised_url=advertised_url,
        settings=settings,
        admin_token=admin_token,
    )

    async def main() -> None:
        async with relay:
            typer.echo(
                f"relay listening on {relay.base_url}"
                + (f" and {relay.unix_socket_path}" if relay.unix_socket_path else "")
            )
            if not os.environ.get(admin_token_env):
                typer.echo(f"admin token (set {admin_token_env} to choose one): {admin_token}")
            sys.stdout.flush()
            await _until_signalled()

    _run(main)


def scripted_policy_command(
    script: Annotated[
        Path | None, typer.Option(help="Script file (JSON); default: the shipped script.")
    ] = None,
    host: Annotated[str, typer.Option(help="TCP address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0 picks a free one).")] = 8766,
) -> None:
    """Serve the scripted policy: an OpenAI-compatible endpoint that answers from a script."""
    loaded = Script.load(script) if script is not None else Script.default_script()
    policy = ScriptedPolicy(loaded, host=host, port=port)

    async def main() -> None:
        async with policy:
            typer.echo(f"scripted policy {policy.model!r} at {policy.base_url} (not a model)")
            sys.stdout.flush()
            await _until_signalled()

    _run(main)


async def _until_signalled() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def _run(main: Callable[[], Awaitable[None]]) -> None:
    options: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401  (the faster loop, when installed)

        options["use_uvloop"] = True
    except ImportError:
        pass
    anyio.run(main, backend_options=options)
