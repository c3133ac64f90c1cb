"""``python -m backends.server ENTRYPOINT [--port N] ...``: ``backends serve`` on its own."""

import typer

from backends.server.cli import serve_command

if __name__ == "__main__":
    typer.run(serve_command)
