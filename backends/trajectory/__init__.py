"""ATIF trajectories: conversion from chat messages, credential redaction, live previews."""

from backends.trajectory.atif import to_trajectory
from backends.trajectory.preview import build_preview, write_preview
from backends.trajectory.redact import Redactor, redact_text, redact_value
from backends.trajectory.save import TrajectoryWriter, save_trajectory, trajectory_of

__all__ = [
    "Redactor",
    "TrajectoryWriter",
    "build_preview",
    "redact_text",
    "redact_value",
    "save_trajectory",
    "to_trajectory",
    "trajectory_of",
    "write_preview",
]
