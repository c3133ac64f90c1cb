"""Reading the event-loop watchdog's figures, which a loaded host makes a little larger.

The watchdog charges a block from the heartbeat it delayed, so a `time.sleep(1.5)` on the
loop reads as 1.45-1.5 s plus however late the host wakes the sleeper: on a loaded machine
"1.6s" is as right as "1.5s". A test checks the figure is the block's, not its last digit.
"""

from __future__ import annotations

import re

BEAT_SEC = 0.05  # the watchdog's heartbeat: a block may start up to one beat after it was due
WAKE_SLACK_SEC = 1.0  # how much later a loaded host may wake the blocking sleeper


def reported_block(text: str, before: str, after: str = "") -> float:
    """The seconds figure in `text` between `before` and `after` ("... for 1.5s by ...")."""
    found = re.search(re.escape(before) + r"(\d+(?:\.\d+)?)s" + re.escape(after), text)
    assert found, f"no {before!r}<seconds>s{after!r} in {text!r}"
    return float(found.group(1))


def is_block_of(seconds: float, blocked_sec: float) -> bool:
    """Is `seconds` (as the watchdog printed it, to 0.1 s) the time a `blocked_sec` block took?"""
    return blocked_sec - BEAT_SEC - 0.05 <= seconds <= blocked_sec + WAKE_SLACK_SEC
