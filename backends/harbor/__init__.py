"""HarborBackend: rollouts as Harbor trials in sandboxes, in template or dataset mode."""

from backends.harbor.backend import HarborBackend
from backends.harbor.tasks import TASK_ID_KEY, dataset_requests, discover_tasks, render_instruction

__all__ = [
    "TASK_ID_KEY",
    "HarborBackend",
    "dataset_requests",
    "discover_tasks",
    "render_instruction",
]
