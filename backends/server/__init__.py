"""The trainer-facing rollout server (the reference wire protocol), its state file and client."""

from backends.server.app import RolloutServer, create_rollout_server
from backends.server.client import RolloutClient, RolloutHandle, RolloutServerError
from backends.server.protocol import (
    LEASE_HEADER,
    CancelRolloutsRequest,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutResultResponse,
)

__all__ = [
    "LEASE_HEADER",
    "CancelRolloutsRequest",
    "RolloutClient",
    "RolloutHandle",
    "RolloutInitRequest",
    "RolloutInitResponse",
    "RolloutResultResponse",
    "RolloutServer",
    "RolloutServerError",
    "create_rollout_server",
]
