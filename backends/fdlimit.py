"""The orchestrator's open-file limit, raised once to what the host allows.

Every local sandbox, relayed connection, trial log and SQLite handle is an fd of one process.
Many distributions start processes with a soft limit of 1,024 under a hard limit hundreds of
times larger, which a batch of sandboxes reaches long before the machine runs out of
anything: raising the soft limit to the hard one (needing no privilege) removes that cliff.
"""

from __future__ import annotations

import resource


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard
