"""``backends serve ENTRYPOINT``: run a rollout server under uvicorn, draining on SIGTERM.

The entrypoint names either an app (``main.py:app``, made by ``create_rollout_server``) or a
backend (``main.py:backend``), which is wrapped with the options given here. The first
SIGTERM or Ctrl-C drains: new rollouts get 503, rollouts in flight finish (or are cancelled
after the drain timeout), clients get a moment to collect results, then the process exits.
A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer
import uvicorn

from backends.net import is_loopback
from backends.rollout.loading import load_object
from backends.server.app import RolloutServer, create_rollout_server

log = logging.getLogger(__name__)


def serve_command(
    entrypoint: Annotated[
        str,
        typer.Argument(
            help="What to serve: 'main.py:app' (made by create_rollout_server), "
            "'main.py:backend' or 'module:attr'."
        ),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    state_file: Annotated[
        Path | None,
        typer.Option(help="SQLite state file; default $BACKENDS_SERVER_STATE or ~/.backends/."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="BACKENDS_SERVER_API_KEY",
            help="Bearer token every request must carry (prefer the environment variable).",
        ),
    ] = None,
    artifacts_root: Annotated[
        Path | None, typer.Option(help="Where <rollout id>/trajectory.json is saved.")
    ] = None,
    preview_root: Annotated[
        Path | None, typer.Option(help="Publish live previews under this directory.")
    ] = None,
    drain_timeout_sec: Annotated[
        float | None,
        typer.Option(help="On SIGTERM, how long rollouts in flight may finish before cancel."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    relay: Annotated[
        bool,
        typer.Option(
            "--relay/--no-relay",
            help="Route policy calls through a rollout-scoped relay; results carry policy_trace.",
        ),
    ] = False,
    no_api_key: Annotated[
        bool,
        typer.Option(
            "--no-api-key",
            help="Listen on a non-loopback address without --api-key anyway (read the docs).",
        ),
    ] = False,
) -> None:
    """Load ``entrypoint`` and serve it until a signal drains it.

    ``--relay`` routes every rollout's policy calls through a rollout-scoped relay started
    with the server: agents never see the trainer's key, and each result carries the
    ``policy_trace`` (token ids and logprobs when the endpoint sends them).
    """
    if not is_loopback(host) and not api_key and not no_api_key:
        # Sandboxes with public network reach the host's non-loopback addresses: any agent
        # could start or cancel every rollout of an open server.
        raise typer.BadParameter(
            f"--host {host} listens beyond this machine, where the sandboxes' agents (public "
            "network) reach it too: set --api-key (or BACKENDS_SERVER_API_KEY), or pass "
            "--no-api-key if the server's own settings or the network keep them out",
            param_hint="--host",
        )
    app = load_app(
        entrypoint,
        state_file=state_file,
        api_key=api_key,
        artifacts_root=artifacts_root,
        preview_root=preview_root,
        drain_timeout_sec=drain_timeout_sec,
        relay=True if relay else None,
    )
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    serve(app, host=host, port=port, log_level=log_level)


def load_app(entrypoint: str, **options: Any) -> Any:
    """The ASGI app an entrypoint names; a backend is wrapped in ``create_rollout_server``.

    Options left ``None`` are not passed. Options given with an entrypoint that already is an
    app raise ``ValueError``: that app was built with its own settings.
    """
    given = {k: v for k, v in options.items() if v is not None}
    obj = load_object(entrypoint)
    if isinstance(obj, RolloutServer) or (callable(obj) and not hasattr(obj, "execute")):
        if given:
            raise ValueError(
                f"{entrypoint} is an app created with its own settings, so "
                f"{', '.join('--' + k.replace('_', '-') for k in given)} cannot apply; "
                "name the backend instead (e.g. main.py:backend)"
            )
        return obj
    if hasattr(obj, "execute"):
        return create_rollout_server(backend=obj, **given)
    raise ValueError(f"{entrypoint} is neither an ASGI app nor an execution backend: {obj!r}")


# A full garbage collection walks every live object: about a second at 10,000 rollouts in
# flight (a million objects), all that time with the event loop stopped. Python allows one
# after every 10 middle-generation collections, so a growing server pays it again and again
# (11 times while 10,000 rollouts arrive); 100 makes them rare. Young collections, which
# free most garbage, are untouched.
FULL_COLLECTION_EVERY = 100


def serve(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        # Neither is of use to a trainer, and each costs work on every response.
        proxy_headers=False,
        server_header=False,
        log_level=log_level,
        backlog=4096,
        timeout_graceful_shutdown=10,
    )
    _DrainingServer(config, app if isinstance(app, RolloutServer) else None).run()


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that the first signal drains the rollout server before stopping HTTP:
    trainers keep polling results while rollouts in flight finish."""

    def __init__(self, config: uvicorn.Config, app: RolloutServer | None) -> None:
        super().__init__(config)
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        if app is not None:
            app.add_drain_listener(self._stop)

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._app is not None and not self._signalled and self._loop is not None:
            self._signalled = True
            log.info("signal %s: draining (a second signal stops at once)", sig)
            self._loop.call_soon_threadsafe(self._app.request_drain)
            return
        super().handle_exit(sig, frame)

    def _stop(self) -> None:
        self.should_exit = True
