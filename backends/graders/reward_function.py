"""``@reward_function``: a plain ``(solution_str, ground_truth, extra_info) -> float`` as a Grader.

The signature is checked when the decorator runs, so a wrong one fails at import with a message
naming the function, not in the middle of a training run.

    @reward_function
    def numeric_match(solution_str: str, ground_truth: str, extra_info: dict) -> float:
        return float(solution_str.strip() == ground_truth.strip())

    backend = LocalBackend(workflow=MyWorkflow, grader=numeric_match)
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, cast

import anyio

from backends.graders.text import final_answer
from backends.rollout.context import GraderContext
from backends.rollout.errors import VerifierError
from backends.rollout.workflow import Grader

PARAMETERS = ("solution_str", "ground_truth", "extra_info")

RewardFunction = Callable[[str, str | None, dict[str, Any]], float | Awaitable[float]]


class RewardFunctionGrader(Grader):
    """A ``Grader`` that calls ``reward_fn`` on the final answer, the label and the row metadata.

    A coroutine function is awaited; a plain one runs on a worker thread, so a slow check does
    not stall other rollouts. Its return value must be a finite number (``bool`` is refused).
    """

    reward_fn: ClassVar[RewardFunction]

    async def grade(self, ctx: GraderContext) -> Any:
        answer = final_answer(ctx.sample)
        extra_info = dict(ctx.metadata or {})
        fn = type(self).reward_fn
        if inspect.iscoroutinefunction(fn):
            value = await fn(answer, ctx.label, extra_info)
        else:
            value = await anyio.to_thread.run_sync(fn, answer, ctx.label, extra_info)
        ctx.set_reward(check_value(value, fn))


def reward_function(fn: RewardFunction) -> type[RewardFunctionGrader]:
    """Turn ``fn(solution_str, ground_truth, extra_info) -> float`` into a ``Grader`` class.

    Raises ``TypeError`` at decoration when ``fn`` is not callable or its parameters are not
    exactly ``solution_str, ground_truth, extra_info`` (in that order, positional, no defaults
    needed), or when their annotations contradict ``str``, ``str`` and ``dict``.
    """
    check_signature(fn)
    name = getattr(fn, "__name__", "reward_function")
    grader = type(
        name,
        (RewardFunctionGrader,),
        {
            "reward_fn": staticmethod(fn),
            "__doc__": fn.__doc__,
            "__module__": getattr(fn, "__module__", __name__),
            "__qualname__": getattr(fn, "__qualname__", name),
        },
    )
    return cast(type[RewardFunctionGrader], grader)


def check_signature(fn: Any) -> None:
    where = getattr(fn, "__qualname__", repr(fn))
    if not callable(fn) or isinstance(fn, type):
        raise TypeError(f"@reward_function needs a function, got {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"@reward_function: cannot read the signature of {where}: {exc}") from None
    params = list(signature.parameters.values())
    names = tuple(p.name for p in params)
    wanted = f"({', '.join(PARAMETERS)})"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if names != PARAMETERS or any(p.kind not in positional for p in params):
        raise TypeError(
            f"@reward_function: {where}{signature} must take exactly {wanted}: "
            "the final answer, the label and the row's metadata"
        )
    hints = _annotations(fn, where)
    for param, allowed in zip(params, (str, str, dict), strict=True):
        hint = hints.get(param.name, inspect.Parameter.empty)
        if hint is not inspect.Parameter.empty and not _accepts(hint, allowed):
            raise TypeError(
                f"@reward_function: {where}: {param.name} is annotated {hint!r}, "
                f"but it receives a {allowed.__name__}"
            )


def check_value(value: Any, fn: Any) -> float:
    where = getattr(fn, "__qualname__", repr(fn))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise VerifierError(f"reward function {where} returned {value!r}, not a number")
    if not math.isfinite(value):
        raise VerifierError(f"reward function {where} returned {value!r}, not a finite number")
    return float(value)


def _annotations(fn: Any, where: str) -> dict[str, Any]:
    try:
        return inspect.get_annotations(fn, eval_str=True)
    except Exception as exc:  # a string annotation naming something not importable here
        raise TypeError(
            f"@reward_function: {where}: cannot resolve its annotations: {exc}"
        ) from None


def _accepts(hint: Any, allowed: type) -> bool:
    # `str`, `str | None`, `Any`, `dict[str, Any]`, `Mapping[str, Any]`: anything `allowed` fits.
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts(arg, allowed) for arg in typing.get_args(hint))
    target = origin or hint
    return isinstance(target, type) and issubclass(allowed, target)
