"""One page per rollout try, ``RUN_DIR/report/<rollout id>.html``, rewritten only when it changed.

A try's files are written once (each try has its own folder), so a page depends on its results
line, the other tries of its slot, the stamps of its trajectory and artifacts and the templates.
Their hash is kept in ``report/.pages.json``; a report after a resume writes only the new
pages. Pages of tries no longer in ``results.jsonl`` are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import Template
from markupsafe import Markup

from backends.cli.runfiles import REPORT_FILE, ResultRecord, Slot
from backends.report.files import href, inside, list_artifacts
from backends.report.trajectory import load_trajectory
from backends.rollout.request import ROLLOUT_ID_PATTERN
from backends.trajectory.save import write_atomic

PAGES_DIR = "report"
INDEX_FILE = ".pages.json"


class RolloutPages:
    """Writes the pages; afterwards ``hrefs`` (from the main page) and ``artifacts`` (file
    counts) hold one entry per page."""

    def __init__(self, run_dir: Path, template: Template, style: str, csp: str) -> None:
        self.run_dir = run_dir
        self.dir = run_dir / PAGES_DIR
        self.template = template
        self.style = style
        self.csp = csp
        self.hrefs: dict[str, str] = {}
        self.artifacts: dict[str, int] = {}
        source = Path(template.filename).read_bytes() if template.filename else b""
        self._version = hashlib.sha256(source + style.encode() + csp.encode()).hexdigest()

    def write(
        self, records: Sequence[ResultRecord], tries: Mapping[Slot, list[ResultRecord]], run_id: str
    ) -> int:
        """Write the pages that changed; return how many were written."""
        self.dir.mkdir(exist_ok=True)
        old = self._index()
        index: dict[str, list[Any]] = {}
        written = 0
        for record in records:
            rid = record.rollout_id
            if not ROLLOUT_ID_PATTERN.match(rid) or rid in index:
                continue  # a name not safe as a file name, or a repeated line
            others = [r for r in tries[record.slot] if r.rollout_id != rid]
            key = self._key(record, others)
            path = self.dir / f"{rid}.html"
            if old.get(rid, [None])[0] == key and path.exists():
                count = int(old[rid][1])
            else:
                context = self._context(record, others, run_id)
                page = self.template.render(**context, style=Markup(self.style), csp=self.csp)
                write_atomic(path, page.encode())
                count = context["artifacts_total"]
                written += 1
            index[rid] = [key, count]
            self.hrefs[rid] = href(path, self.run_dir)
            self.artifacts[rid] = count
        for rid in set(old) - set(index):
            (self.dir / f"{rid}.html").unlink(missing_ok=True)
        write_atomic(self.dir / INDEX_FILE, json.dumps(index).encode())
        return written

    def _index(self) -> dict[str, list[Any]]:
        try:
            index = json.loads((self.dir / INDEX_FILE).read_bytes())
        except (OSError, ValueError):
            return {}
        if not isinstance(index, dict):
            return {}
        return {
            k: v
            for k, v in index.items()
            if isinstance(k, str) and ROLLOUT_ID_PATTERN.match(k) and isinstance(v, list)
            and len(v) == 2 and isinstance(v[1], int)
        }  # fmt: skip

    def _key(self, record: ResultRecord, others: list[ResultRecord]) -> str:
        parts = [self._version, record.model_dump_json()]
        parts += [f"{o.rollout_id}:{o.status}" for o in others]
        for recorded in (record.trajectory, record.artifacts):
            path = inside(self.run_dir, recorded)
            if path is not None:
                info = os.lstat(path)
                parts.append(f"{info.st_size}:{info.st_mtime_ns}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def _context(
        self, record: ResultRecord, others: list[ResultRecord], run_id: str
    ) -> dict[str, Any]:
        recorded = {
            "trajectory": record.trajectory,
            "artifacts": record.artifacts,
            "result": record.result,
        }
        paths = {name: inside(self.run_dir, value) for name, value in recorded.items()}
        trajectory, result = paths["trajectory"], paths["result"]
        artifacts, total = list_artifacts(paths["artifacts"])
        return {
            "record": record,
            "run_id": run_id,
            "back": href(self.run_dir / REPORT_FILE, self.dir),
            "trajectory": load_trajectory(trajectory) if trajectory else None,
            "trajectory_href": href(trajectory, self.dir) if trajectory else None,
            "result_href": href(result, self.dir) if result else None,
            "artifacts": [(a, href(a.path, self.dir) if a.path else None) for a in artifacts],
            "artifacts_total": total,
            # Paths the results line names that the report will not link.
            "unlinked": [(n, v) for n, v in recorded.items() if v and paths[n] is None],
            "others": [
                (o, href(self.dir / f"{o.rollout_id}.html", self.dir))
                if ROLLOUT_ID_PATTERN.match(o.rollout_id)
                else (o, None)
                for o in others
            ],
            "started": _when(record.started_at),
        }


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp)) if stamp else ""
