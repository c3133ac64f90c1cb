"""The rollout-scoped policy relay, and an embedded scripted policy.

Every policy call of a rollout goes through the relay: the agent in its sandbox holds only a
token valid for its own route (``/rollouts/{rollout_id}/v1``) while the rollout runs; the relay
holds the upstream key, forwards to the upstream OpenAI-compatible server (vLLM, SGLang,
OpenAI, ...) and records each call in the rollout's trace.

Host side, in process::

    async with Relay(upstream_url="http://gpu:8000/v1", upstream_api_key=key,
                     request_token_ids=True, unix_socket_path=sock) as relay:
        grant = relay.register(rollout_id)              # or with upstream_url=, upstream_api_key=,
        ...                                             # policy_version= for this rollout only
        agent_base_url = grant.base_url                 # http://127.0.0.1:<port>/rollouts/<id>/v1
        agent_api_key = grant.token                     # never the upstream key
        trace = relay.end(rollout_id)                   # token revoked; RolloutTrace returned
                                                        # (await relay.aend(...): parsed in a
                                                        # worker thread, for long rollouts)
        if (failure := trace.policy_failure()):         # upstream 5xx/429/timeout/unreachable
            ...                                         # -> label the rollout "policy_error"

Reaching the relay:
    * host processes: ``grant.base_url`` (the TCP address, ``relay.base_url``);
    * a local sandbox: ``LocalSandbox(relay_socket=relay.unix_socket_path)`` serves
      ``127.0.0.1:<port>`` inside from the host, forwarding to that socket (at most 64
      connections at once); the agent uses ``grant.url_at("http://127.0.0.1:<port>")``;
    * a remote sandbox: ``Relay(advertised_url=...)`` and ``relay.remote_base_url(rollout_id)``.

Errors, by what the caller gets:
    * ``register``: ``ValueError`` (id already live, unusable in a URL, or no upstream known);
    * ``end`` / ``trace``: ``UnknownRolloutError`` (a ``KeyError``) for an id that is not live;
    * the agent's HTTP calls: 401 no token, 403 wrong token or rollout ended, 404 unknown
      rollout or route, 400 malformed JSON, 413 body too large; 502 upstream unreachable or
      refusing the relay's key, 504 upstream timeout (OpenAI-style error bodies, type
      ``policy_error``); an upstream's own status passes through unchanged. A stream that
      breaks after it started ends with an SSE ``error`` event.

Wire formats: besides ``/chat/completions`` the route serves OpenAI Responses (``/responses``)
and Anthropic Messages (``/messages``; the token may come as ``x-api-key``), translated to chat
completions upstream unless ``RelaySettings.native_apis`` names the format
(``backends.relay.wire``). Errors then come in the agent's format; each call is traced with
``api`` set and its choices, usage, token ids and logprobs in chat-completions form.

Retries: a request the upstream cannot have processed (no connection; a pooled connection that
closed within a few ms, or two handshake times, of the request being written: the upstream had
closed it while idle) is retried by the relay; nothing else is, so a call an upstream dropped
after working on it is a 502, not a second generation. An SDK retry (same body,
``x-stainless-retry-count`` = n > 0) is folded into the record (``attempts``) of an earlier
finished attempt of that request which failed as SDKs retry (5xx, 408/409/429, a transport
error or timeout) and has n attempts; otherwise it is a call of its own.

Agents hanging up: whenever the agent disconnects before its answer is complete, the relay
closes the upstream connection (vLLM and SGLang then abort the generation) and records the call
as ``client_disconnected``.

Upstream credentials: ``upstream_api_key`` is sent as ``Authorization: Bearer``. Credentials in
the URL (``http://user:password@host/v1``) are sent as HTTP Basic auth instead, unless a key is
given (the key wins). They never appear in error messages or traces.

Standalone: ``backends relay --upstream URL`` (``backends.relay.cli.relay_command``) serves the
same app with an admin API (``RelayCore`` + ``admin_token``: ``POST /admin/rollouts``,
``GET /admin/rollouts/{id}/trace``, ``DELETE /admin/rollouts/{id}``).

Scripted policy (``backends.relay.scripted``): ``async with ScriptedPolicy(script) as policy``
serves an OpenAI-compatible endpoint at ``policy.base_url`` that answers from a ``Script``; the
shipped default script computes ``What is A * B`` style questions. Its answers carry the model
``scripted:<name>`` (``CallRecord.scripted``, ``RolloutTrace.scripted``).
"""

from backends.relay.scripted import Script, ScriptedPolicy
from backends.relay.service import Relay, RelayCore
from backends.relay.tokens import Grant, UnknownRolloutError
from backends.relay.upstream import RelaySettings
from backends.rollout.trace import (
    CallError,
    CallRecord,
    ChoiceRecord,
    PolicyFailure,
    RolloutTrace,
    policy_failure,
)

__all__ = [
    "CallError",
    "CallRecord",
    "ChoiceRecord",
    "Grant",
    "PolicyFailure",
    "Relay",
    "RelayCore",
    "RelaySettings",
    "RolloutTrace",
    "Script",
    "ScriptedPolicy",
    "UnknownRolloutError",
    "policy_failure",
]
