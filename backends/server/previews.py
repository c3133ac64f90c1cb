"""Publish live previews of running rollouts, about every few seconds, when the host asks.

The backend exposes a running rollout's ``RolloutContext`` through ``rollout_context(id)``
(LocalBackend does); its sample source's ``get_preview`` gives the latest messages. A rollout
opts out with ``preview_enabled = False`` on its context. Previews never touch the sample.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from backends.trajectory.preview import MAX_PREVIEW_STEPS, build_preview, write_preview

if TYPE_CHECKING:
    from backends.server.app import RolloutServer

log = logging.getLogger(__name__)

SOURCE_TIMEOUT_SEC = 1.0


async def publish_previews(server: RolloutServer) -> None:
    """Run until cancelled: one pass over the rollouts in flight per interval."""
    hook = getattr(server.backend, "rollout_context", None)
    root = server.preview_root
    if hook is None or root is None:
        log.info("live previews are on, but this backend exposes no rollout contexts")
        return
    while True:
        await anyio.sleep(server.preview_interval_sec)
        for rid in server.active_ids():
            try:
                await _preview_one(server, hook, root, rid)
            except Exception as exc:  # a preview is diagnostic: never let it hurt a rollout
                log.debug("preview of rollout %s failed: %s", rid, exc)


async def _preview_one(server: RolloutServer, hook: Any, root: Path, rid: str) -> None:
    ctx = hook(rid)
    if ctx is None or not ctx.preview_enabled or ctx.sample_source is None:
        return
    sample = None
    with anyio.move_on_after(SOURCE_TIMEOUT_SEC):
        sample = await ctx.sample_source.get_preview(MAX_PREVIEW_STEPS)
    if sample is None or not ctx.preview_enabled:  # it may have opted out meanwhile
        return
    messages = sample.trajectory_messages or sample.messages
    status = server.backend.status(rid)
    await anyio.to_thread.run_sync(
        _write,
        root,
        rid,
        messages,
        [ctx.api_key, *server.rollout_secrets(rid)],
        status.value if status else None,
    )


def _write(
    root: Path,
    rid: str,
    messages: Sequence[Mapping[str, Any]],
    secrets: Iterable[str | None],
    status: str | None,
) -> None:
    doc = build_preview(messages, rollout_id=rid, secrets=secrets, status=status)
    if doc is not None:
        write_preview(root, rid, doc)
