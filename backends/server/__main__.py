"""``python -m backends.server ENTRYPOINT [--port N] ...``: the serve command without the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

from backends.server.cli import serve_command


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m backends.server", description=__doc__)
    parser.add_argument("entrypoint", help="main.py:app, module:app or main.py:backend")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--state-file", type=Path)
    parser.add_argument("--api-key")
    parser.add_argument("--artifacts-root", type=Path)
    parser.add_argument("--preview-root", type=Path)
    parser.add_argument("--drain-timeout-sec", type=float)
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--relay",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="route policy calls through a rollout-scoped relay; results carry policy_trace",
    )
    args = parser.parse_args(argv)
    serve_command(**vars(args))


if __name__ == "__main__":
    main()
