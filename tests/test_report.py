"""`backends report RUN_DIR`: the page as headless Chromium renders it, and what an adversary's
rollout can and cannot do to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from backends.report.files import href, inside
from backends.rollout.errors import ErrorCategory, Phase
from tests.report_support import Rollout, make_run, rendered

INFRA = (ErrorCategory.INFRA_ERROR, Phase.SETUP, "sandbox start: SandboxStartError: no uids left")
VERIFIER = (ErrorCategory.VERIFIER_ERROR, Phase.GRADING, "the verifier produced no reward")
TIMEOUT = (ErrorCategory.TIMEOUT, Phase.AGENT, "agent ran past 300 s")


def report(run_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "backends.cli", "report", str(run_dir)]
    env = {**os.environ, "COLUMNS": "300"}  # error messages on one line
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def sample_run(tmp_path: Path) -> Path:
    rollouts = [
        Rollout(row=0, attempt=0, reward=1.0, artifacts={"reply.txt": "42\n"}),
        Rollout(row=0, attempt=1, reward=0.0),
        Rollout(row=1, attempt=0, reward=1.0, prompt="What is 2 + 2?"),
        Rollout(row=1, attempt=1, failure=INFRA),
        Rollout(row=1, attempt=1, retry=1, reward=1.0),  # the rerun of the infra failure
        Rollout(row=2, attempt=0, failure=VERIFIER),
        Rollout(row=2, attempt=1, failure=TIMEOUT),
    ]
    return make_run(tmp_path / "run-1", rollouts, rows=3, attempts=2)


def test_report_renders_its_charts_and_rows_in_chromium(tmp_path: Path) -> None:
    run_dir = sample_run(tmp_path)
    done = report(run_dir)
    assert done.returncode == 0, done.stderr
    assert f"report: {run_dir / 'report.html'} (6 rollouts, 7 rollout pages" in done.stdout

    dom, _ = rendered(run_dir / "report.html")
    body = dom.one("body")
    assert body.attrs["data-rendered"] == "6"  # the script ran, over the current try of each slot
    rows = dom.one("table", id="rollouts").all("tr", class_="rollout")
    assert len(rows) == 6
    cells = [[td.text() for td in tr.all("td")] for tr in rows]
    assert [c[0] for c in cells] == [
        "row-0-0",
        "row-0-1",
        "row-1-0",
        "row-1-1.retry-1",
        "row-2-0",
        "row-2-1",
    ]
    assert cells[3][2] == "success" and cells[3][9] == "2"  # two tries of that slot
    assert cells[4][2] == "failure · grading" and cells[4][3] == "\u2013"  # no reward, not 0
    assert "verifier_error: the verifier produced no reward" in cells[4][4]
    assert cells[0][8] == "1"  # one artifact, linked to its page
    link = rows[0].all("a")[0].attrs["href"]
    assert link == f"./report/{run_dir.name}.row-0-0.html"

    # Summary: 4 graded (1, 0, 1, 1), failures never counted as 0.
    assert dom.one(id="mean-reward").text() == "0.75"
    # Histogram: a bar for 0 (one rollout) and for 1 (three).
    bins = dom.one(id="histogram").all("g", class_="bin")
    assert [b.all("text", class_="count")[0].text() for b in bins] == ["1", "3"]
    # pass@k over rows with >= k graded attempts: pass@1 and pass@2 shown.
    pass_k = dom.one(id="pass-at-k").text()
    assert "pass@1" in pass_k and "pass@2" in pass_k
    # Failures by phase: the current failures only (the rerun infra failure is history).
    failures = dom.one(id="failures")
    legend = failures.one("div", class_="legend").text()
    assert "verifier_error" in legend and "timeout" in legend and "infra_error" not in legend
    times = dom.one(id="time-per-phase").all("text", class_="label")
    assert [t.text() for t in times] == ["queued", "setup", "agent", "grader"]

    # Each failure kind links to the rows it counts; a view can be named in the address.
    [grading] = [a for a in failures.all("a") if a.text() == "grading / verifier_error"]
    dom, _ = rendered(run_dir / "report.html", fragment=grading.attrs["href"][1:])
    rows = dom.one("table", id="rollouts").all("tr", class_="rollout")
    assert [tr.all("td")[0].text() for tr in rows] == ["row-2-0"]
    assert dom.one(id="count").text() == "1\u20131 of 1 (filtered from 6)"
    dom, _ = rendered(run_dir / "report.html", fragment="status=success&sort=-reward")
    rewards = [
        tr.all("td")[3].text() for tr in dom.one("table", id="rollouts").all("tr", class_="rollout")
    ]
    assert rewards == ["1", "1", "1", "0"]


def test_rollout_page_shows_the_trajectory_steps_and_artifacts(tmp_path: Path) -> None:
    run_dir = sample_run(tmp_path)
    assert report(run_dir).returncode == 0
    dom, _ = rendered(run_dir / "report" / f"{run_dir.name}.row-0-0.html")
    steps = dom.one(id="trajectory").all("div", class_="step")
    assert [s.one("span", class_="who").text() for s in steps] == [
        "system",
        "user",
        "agent",
        "agent",
    ]
    call = steps[2].one("div", class_="call")
    assert call.one("span", class_="name").text() == "calculator"
    assert '"expression": "6*7"' in call.one("pre").text()
    assert steps[2].one("div", class_="obs").one("pre").text() == "42"
    assert steps[3].one("pre", class_="message").text() == "42"
    artifacts = dom.one(id="artifacts")
    [a] = artifacts.all("a")
    assert (
        a.text() == "reply.txt"
        and a.attrs["href"] == f"./../rollouts/{run_dir.name}.row-0-0/artifacts/reply.txt"
    )
    assert (run_dir / "report" / a.attrs["href"]).resolve().read_text() == "42\n"
    # The failed try of a rerun slot links its rerun, and says why it failed.
    dom, _ = rendered(run_dir / "report" / f"{run_dir.name}.row-1-1.html")
    assert "infra_error" in dom.one(id="failure").text()
    assert any(a.text() == f"{run_dir.name}.row-1-1.retry-1" for a in dom.all("a"))


HOSTILE = "<script>document.body.setAttribute('data-pwned', 'yes')</script>"
ATTRIBUTE = "\"'><img src=x onerror=\"document.body.setAttribute('data-pwned','yes')\">"
CLOSER = "</script><script>document.body.setAttribute('data-pwned','yes')</script>"


def test_a_hostile_rollout_cannot_run_script_or_reach_outside(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host secret\n")
    messages = [
        {"role": "user", "content": HOSTILE},
        {
            "role": "assistant",
            "content": ATTRIBUTE,
            "tool_calls": [
                {
                    "id": CLOSER,
                    "type": "function",
                    "function": {
                        "name": ATTRIBUTE,
                        "arguments": f'{{"x": "{CLOSER}"}}'.replace('"', "'"),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": CLOSER, "content": HOSTILE},
        {"role": "assistant", "content": CLOSER},
    ]
    rollouts = [
        Rollout(
            row=0,
            messages=messages,
            prompt=CLOSER,
            task=ATTRIBUTE,
            artifacts={
                f"{ATTRIBUTE}.txt": HOSTILE,
                "page.html": HOSTILE,
                "drawing.svg": "<svg xmlns='http://www.w3.org/2000/svg' onload='alert(1)'/>",
            },
        ),
        Rollout(
            row=1,
            failure=(ErrorCategory.AGENT_ERROR, Phase.AGENT, CLOSER + ATTRIBUTE),
            # A results line pointing out of the run directory.
            overrides={
                "trajectory": str(secret),
                "result": "../host-secret.txt",
                "answer": CLOSER,
                "timings": {"agent_sec": float("inf"), "setup_sec": float("nan")},
                "reward": float("nan"),  # not JSON, nor a number to chart: no crash
            },
        ),
    ]
    run_dir = make_run(tmp_path / "run-evil", rollouts, rows=2, attempts=1)
    first = run_dir / "rollouts" / f"{run_dir.name}.row-0-0" / "artifacts"
    (first / "passwd").symlink_to(secret)
    done = report(run_dir)
    assert done.returncode == 0, done.stderr

    pages = [run_dir / "report.html", *sorted((run_dir / "report").iterdir())]
    for page in pages:
        dom, html = rendered(page)
        assert "data-pwned" not in dom.one("body").attrs, page
        assert not dom.all("img"), page  # no injected element survived as markup
        for a in dom.all("a"):
            target = a.attrs["href"]
            if target.startswith("#"):
                continue  # a view of the same page
            assert target.startswith("./"), (page, target)
            resolved = (page.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(run_dir), (page, target)
        assert "host secret" not in html
    main, _ = rendered(run_dir / "report.html")
    assert CLOSER in main.one("table", id="rollouts").text()  # shown as text
    dom, _ = rendered(run_dir / "report" / f"{run_dir.name}.row-0-0.html")
    steps = dom.one(id="trajectory").all("div", class_="step")
    assert steps[0].one("pre", class_="message").text() == HOSTILE
    assert steps[1].one("span", class_="name").text() == ATTRIBUTE
    linked = {a.text() for a in dom.one(id="artifacts").all("a")}
    assert linked == {f"{ATTRIBUTE}.txt"}  # not the HTML, the SVG, nor the symlink
    text = dom.one(id="artifacts").text()
    assert "page.html" in text and "shown as text, not linked" in text
    assert "passwd" in text and "a symlink: not followed" in text
    dom, _ = rendered(run_dir / "report" / f"{run_dir.name}.row-1-0.html")
    files = dom.text()
    assert f"not linked: {secret} is outside the run directory" in files
    assert "not linked: ../host-secret.txt is outside the run directory" in files


def test_linked_paths_stay_inside_the_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "rollouts" / "a").mkdir(parents=True)
    (run_dir / "rollouts" / "a" / "f.txt").write_text("x")
    (tmp_path / "outside.txt").write_text("x")
    (run_dir / "rollouts" / "link").symlink_to(tmp_path)
    run_dir = run_dir.resolve()
    assert inside(run_dir, "rollouts/a/f.txt") == run_dir / "rollouts/a/f.txt"
    assert inside(run_dir, str(run_dir / "rollouts/a/f.txt")) is not None
    for bad in ["../outside.txt", str(tmp_path / "outside.txt"), "rollouts/link/outside.txt",
                "rollouts/a/../../../outside.txt", "/etc/passwd", "rollouts/a/f.txt\0", "",
                "rollouts/a/missing.txt", "rollouts/link"]:  # fmt: skip
        assert inside(run_dir, bad) is None, bad
    # A name that looks like a URL scheme or a query stays a relative path segment.
    (run_dir / "report").mkdir()
    page = run_dir / "report" / "javascript:alert.html"
    assert href(page, run_dir) == "./report/javascript%3Aalert.html"
    weird = run_dir / "rollouts" / "a" / "x?y#z.txt"
    assert href(weird, run_dir / "report") == "./../rollouts/a/x%3Fy%23z.txt"


def test_a_directory_that_is_not_a_run_is_refused_by_name(tmp_path: Path) -> None:
    done = report(tmp_path)
    assert done.returncode == 2
    assert "has no run.json: not a run directory written by `backends run`" in done.stderr
    run_dir = sample_run(tmp_path)
    with (run_dir / "results.jsonl").open("a") as f:
        f.write('{"rollout_id": 3}\n')
    done = report(run_dir)
    assert done.returncode == 2
    assert "results.jsonl:8: not a result line" in done.stderr


def test_a_second_report_rewrites_only_pages_that_changed(tmp_path: Path) -> None:
    from backends.report import write_report

    run_dir = sample_run(tmp_path)
    first = write_report(run_dir)
    assert (first.pages, first.rewritten) == (7, 7)
    again = write_report(run_dir)
    assert (again.pages, again.rewritten) == (7, 0)
    # A rerun of row 2's verifier failure: its page and the new try's are written, no other.
    extra = make_run(tmp_path / "scratch", [Rollout(row=2, retry=1)], rows=1, attempts=1)
    line = (extra / "results.jsonl").read_text().replace("scratch", run_dir.name)
    with (run_dir / "results.jsonl").open("a") as f:
        f.write(line)
    third = write_report(run_dir)
    assert (third.pages, third.rewritten) == (8, 2)
    stale = run_dir / "report" / "gone.html"
    index = run_dir / "report" / ".pages.json"
    index.write_text(index.read_text().replace("{", '{"gone": ["x", 0], ', 1))
    stale.write_text("old")
    write_report(run_dir)
    assert not stale.exists()  # a page whose try is no longer in results.jsonl goes
