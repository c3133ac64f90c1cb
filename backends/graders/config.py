"""A grader's config as its own config class, whatever the user passed."""

from __future__ import annotations

from typing import Any

from backends.rollout.config import BaseConfig


def config_as[C: BaseConfig](cls: type[C], config: Any) -> C:
    """``config`` as ``cls``: ``None`` gives the defaults, another config's fields are re-read
    (so ``GraderConfig(name=..., strip=False)`` works as an ``ExactMatchConfig``)."""
    if config is None:
        return cls()  # type: ignore[call-arg]  # every grader config defaults its name
    if isinstance(config, cls):
        return config
    if isinstance(config, BaseConfig):
        return cls.model_validate(config.model_dump())
    if isinstance(config, dict):
        return cls.model_validate(config)
    raise TypeError(f"{cls.__name__} expects a config, got {type(config).__name__}")
