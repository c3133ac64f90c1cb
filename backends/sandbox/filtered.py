"""Harbor's filtered downloads (artifacts with ``exclude``, logs with include/exclude
filters) through a provider's own checked tar download.

Harbor's base versions unpack a sandbox-made tar.gz with tarfile on the host, where a crafted
archive writes outside the target (CVE-2025-4517) and a compressed bomb passes every size
limit. A provider mixes ``CheckedDownloads`` in before Harbor's class and supplies the two
primitives; the three public methods then go through the same unpacker and limits as its
``download_dir``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import anyio
from harbor.environments.base import BaseEnvironment, ServiceOperationsUnsupportedError
from harbor.utils.path_filter import filter_paths_by_patterns

log = logging.getLogger(__name__)


class CheckedDownloads(BaseEnvironment):
    """The three filtered downloads, over ``_download_tree`` and ``_list_files``."""

    async def _download_tree(
        self,
        source_dir: str,
        target_dir: Path | str,
        members: list[str],
        stdin: bytes | None = None,
    ) -> None:
        """Tar ``members`` (tar arguments; ``stdin`` feeds ``-T -``) of ``source_dir`` and
        unpack them into ``target_dir`` with the checked unpacker, bounded."""
        raise NotImplementedError

    async def _list_files(self, source_dir: str) -> list[str]:
        """The regular files under ``source_dir``, relative to it.

        Raises ``FileNotFoundError`` when it cannot be listed."""
        raise NotImplementedError

    async def download_dir_with_exclusions(
        self, *, source_dir: str, target_dir: Path | str, exclude: list[str]
    ) -> None:
        """``download_dir`` without the members matching tar's ``--exclude`` patterns."""
        await self._download_tree(
            source_dir, target_dir, [f"--exclude={p}" for p in exclude] + ["."]
        )

    async def service_download_dir_with_exclusions(
        self,
        *,
        source_dir: str,
        target_dir: Path | str,
        exclude: list[str],
        service: str | None = None,
    ) -> None:
        if not self.is_main_service(service):
            raise ServiceOperationsUnsupportedError(self._service_unsupported_message(str(service)))
        await self.download_dir_with_exclusions(
            source_dir=source_dir, target_dir=target_dir, exclude=exclude
        )

    async def download_dir_filtered(
        self,
        *,
        source_dir: str,
        target_dir: Path | str,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        protect: Sequence[str] | None = None,
    ) -> None:
        """``download_dir`` of the regular files matching Harbor's fnmatch filters.

        As Harbor's: ``include`` narrows, ``exclude`` wins on overlap, ``protect`` names (exact
        relative paths) come along regardless.
        """
        await anyio.Path(target_dir).mkdir(parents=True, exist_ok=True)
        paths = await self._list_files(source_dir)
        selected = filter_paths_by_patterns(paths, include=include, exclude=exclude)
        protected = set(protect or ()) - set(selected)
        selected += [p for p in paths if p in protected]
        if not selected:
            log.warning(
                "no files in %s matched include=%s exclude=%s", source_dir, include, exclude
            )
            return
        names = b"".join(os.fsencode("./" + p) + b"\0" for p in selected)
        await self._download_tree(
            source_dir, target_dir, ["--null", "--no-recursion", "-T", "-"], stdin=names
        )
