"""A rollout's policy route: where its agent sends policy calls, from the host or a sandbox.

``RelayedBackend`` builds one per rollout from the relay's grant and hands it to the backend on
the request (``RolloutRequest.policy_route``), so a backend never rebuilds URLs from constants:
the host URL, the relay's Unix socket for a local sandbox's forwarder, the advertised URL for a
remote sandbox, and the rollout's token all come from the relay that issued them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from backends.rollout.context import ENV_API_KEY, ENV_CHAT_COMPLETIONS_URL, ENV_ROLLOUT_ID
from backends.rollout.errors import RolloutValidationError

if TYPE_CHECKING:
    from backends.rollout.request import RolloutRequest


class PolicyRoute(BaseModel):
    """One rollout's way to its policy. ``api_key`` is the rollout's token when relayed.

    ``relay_path`` (``/rollouts/<id>/v1``) is set only for a relay route; a direct route (no
    relay) carries the request's own endpoint and key, which must never enter a sandbox.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rollout_id: str
    base_url: str | None  # OpenAI base URL as seen from this host (clients add /chat/completions)
    api_key: str | None = Field(default=None, repr=False)
    relay_path: str | None = None
    relay_socket: Path | None = None  # the relay's Unix socket, a local sandbox's forwarder's
    advertised_url: str | None = None  # the relay's origin as remote sandboxes reach it
    # Set by RelayedBackend: ends this registration (its token is refused from then on, its
    # calls leave the rollout's trace) and returns the route of a fresh one, for a retry
    # that must start clean after policy calls were made.
    renew: Callable[[], Awaitable[PolicyRoute]] | None = Field(
        default=None, exclude=True, repr=False
    )

    @classmethod
    def direct(cls, request: RolloutRequest) -> PolicyRoute:
        """The request's own endpoint, for a backend running without a relay."""
        # The request validated these already; built once per rollout, so skip validating again.
        return cls.model_construct(
            rollout_id=request.rollout_id,
            base_url=request.chat_completions_url,
            api_key=request.api_key,
        )

    @classmethod
    def of(cls, request: RolloutRequest) -> PolicyRoute:
        """The route a backend uses for ``request``: its relay route, else the direct one."""
        return request.policy_route or cls.direct(request)

    @property
    def relayed(self) -> bool:
        return self.relay_path is not None

    def onto(self, request: RolloutRequest) -> RolloutRequest:
        """``request`` sent along this route: the URL and key its backend and agent see."""
        return request.model_copy(
            update={
                "chat_completions_url": self.base_url,
                "api_key": self.api_key,
                "policy_route": self,
            }
        )

    def sandbox_base_url(self, forwarder_port: int | None = None) -> str:
        """The base URL an agent inside a sandbox uses.

        With ``forwarder_port`` (a local sandbox whose forwarder reaches ``relay_socket`` and forwards
        ``127.0.0.1:<port>`` to it), the forwarder; otherwise the advertised URL. Raises
        ``RolloutValidationError`` when the rollout is not relayed (the sandbox would hold the
        upstream key) or the sandbox has no way to reach the relay.
        """
        if self.relay_path is None:
            raise RolloutValidationError(
                f"rollout {self.rollout_id!r} has no relay route, and a sandbox never gets the "
                "upstream endpoint's key: run it through a relay (RelayedBackend, the rollout "
                "server's relay=True, or `backends run`)"
            )
        if forwarder_port is not None:
            if self.relay_socket is None:
                raise RolloutValidationError(
                    "the relay has no Unix socket to forward to: start it with unix_socket_path"
                )
            return f"http://127.0.0.1:{forwarder_port}{self.relay_path}"
        if self.advertised_url is None:
            raise RolloutValidationError(
                "the relay has no advertised_url, so a remote sandbox cannot reach it"
            )
        return self.advertised_url.rstrip("/") + self.relay_path

    def environment(self, base_url: str) -> dict[str, str]:
        """Environment variables pointing OpenAI and Anthropic clients and ``RolloutContext`` at
        ``base_url`` (the relay serves the Messages API on the same route; Anthropic clients
        take the URL without its ``/v1``)."""
        env = {
            "OPENAI_BASE_URL": base_url,
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
            ENV_CHAT_COMPLETIONS_URL: base_url,
            ENV_ROLLOUT_ID: self.rollout_id,
        }
        if self.api_key is not None:
            env["OPENAI_API_KEY"] = env["ANTHROPIC_API_KEY"] = env[ENV_API_KEY] = self.api_key
        return env
