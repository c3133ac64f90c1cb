"""Rollout-scoped policy relay (placeholder docs; filled below)."""

from backends.relay.service import Relay, RelayCore
from backends.relay.tokens import Grant, UnknownRolloutError
from backends.relay.trace import CallRecord, PolicyFailure, RolloutTrace, policy_failure
from backends.relay.upstream import RelaySettings

__all__ = [
    "CallRecord",
    "Grant",
    "PolicyFailure",
    "Relay",
    "RelayCore",
    "RelaySettings",
    "RolloutTrace",
    "UnknownRolloutError",
    "policy_failure",
]
