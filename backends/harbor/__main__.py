"""``python -m backends.harbor TASKS_DIR``: one JSONL row per task, for ``backends run -d``."""

import sys

from backends.harbor.tasks import dataset_rows


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m backends.harbor TASKS_DIR > tasks.jsonl")
    try:
        rows = dataset_rows(sys.argv[1])
    except (OSError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
