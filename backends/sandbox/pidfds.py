"""Asking a pidfd whether its process has exited, for any fd number.

A pidfd turns readable once its process exits (a zombie included). `select.select` refuses
fds numbered 1,024 or more, which an orchestrator with a hundred sandboxes and their relayed
connections passes: every check would raise. poll has no such bound.
"""

from __future__ import annotations

import select


def has_exited(pidfd: int) -> bool:
    """Has the process behind `pidfd` exited? (Asked without waiting.)"""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
