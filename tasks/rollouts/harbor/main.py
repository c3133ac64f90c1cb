"""Example HarborBackend rollouts, one per mode.

* ``dataset``: every task under tasks/harbor/, run by Harbor's ``oracle`` agent; each task's
  own tests give the reward (feed it the rows of ``python -m backends.harbor tasks/harbor``).
* ``terminus``: template mode. Each row of tasks/data/arithmetic.jsonl becomes the instruction
  of the ``arithmetic`` template for Harbor's ``terminus-2``; the template's tests reward an
  answer of the right form.
* ``graded``: the same, on a template without tests: ``ExactAnswer`` scores the answer file
  (collected as an artifact) against the row's ground truth, on the host.
"""

from pathlib import Path

from backends import Grader, GraderContext, HarborBackend

TASKS = Path(__file__).resolve().parents[2]


class ExactAnswer(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        answer = ctx.artifacts_dir / "app" / "answer.txt" if ctx.artifacts_dir else None
        text = answer.read_text().strip() if answer and answer.is_file() else ""
        ctx.set_reward(float(text == (ctx.label or "").strip()))


dataset = HarborBackend(tasks_dir=TASKS / "harbor", task_mode="dataset", agent="oracle")
terminus = HarborBackend(
    tasks_dir=TASKS / "harbor-templates" / "arithmetic", agent="terminus-2", max_concurrent=4
)
graded = HarborBackend(
    tasks_dir=TASKS / "harbor-templates" / "arithmetic-graded",
    agent="terminus-2",
    grader=ExactAnswer,
    max_concurrent=4,
)
