"""Ready-made graders: exact match, a decorated reward function, an LLM judge with a rubric.

Each is a ``Grader`` for ``LocalBackend(grader=...)`` (or a host-side grader of a sandboxed
backend). A rollout these graders cannot score (no label, no answer, a judge that fails) is a
verifier error, never a reward of 0.
"""

from backends.graders.exact import ExactMatchConfig, ExactMatchGrader
from backends.graders.reward_function import RewardFunctionGrader, reward_function
from backends.graders.rubric import (
    ModelInfo,
    Rubric,
    RubricGrader,
    RubricGraderConfig,
    load_rubrics,
)
from backends.graders.text import final_answer

__all__ = [
    "ExactMatchConfig",
    "ExactMatchGrader",
    "ModelInfo",
    "RewardFunctionGrader",
    "Rubric",
    "RubricGrader",
    "RubricGraderConfig",
    "final_answer",
    "load_rubrics",
    "reward_function",
]
