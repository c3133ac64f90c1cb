"""The relay seen from inside a local sandbox: reached through its Unix socket, key never inside."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from backends.relay import Relay
from backends.relay.scripted import ScriptedPolicy

pytestmark = [pytest.mark.anyio, pytest.mark.sandbox]

KEY = "sk-upstream-" + uuid.uuid4().hex  # fresh per run: no stale copy anywhere can match

# An HTTP call with nothing but bash, as an agent inside would make with any client.
ASK = r"""
url=${OPENAI_BASE_URL#http://}; hostport=${url%%/*}; path=/${url#*/}/chat/completions
body='{"model":"m","messages":[{"role":"user","content":"What is 7 * 6?"}]}'
exec 3<>/dev/tcp/${hostport%:*}/${hostport#*:}
printf 'POST %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' \
  "$path" "$hostport" "$OPENAI_API_KEY" "${#body}" "$body" >&3
cat <&3
"""


@pytest.fixture
def sandbox_host() -> None:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("local sandboxes need root and bubblewrap")


async def test_sandbox_reaches_relay_and_holds_no_upstream_key(
    sandbox_host: None, tmp_path: Path
) -> None:
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    from backends.sandbox.local import DEFAULT_RELAY_PORT, LocalSandbox

    sock = tmp_path / "relay" / "relay.sock"
    env_dir = tmp_path / "environment"
    env_dir.mkdir()
    trial_paths = TrialPaths(trial_dir=tmp_path / "trial")
    trial_paths.mkdir()
    async with (
        ScriptedPolicy(api_key=KEY) as policy,
        Relay(upstream_url=policy.base_url, upstream_api_key=KEY, unix_socket_path=sock) as relay,
    ):
        grant = relay.register("sandboxed-1")
        sandbox = LocalSandbox(
            environment_dir=env_dir,
            environment_name="relay",
            session_id=f"relay__{uuid.uuid4().hex[:7]}__env",
            trial_paths=trial_paths,
            task_env_config=EnvironmentConfig(docker_image="debian:bookworm"),
            relay_socket=sock,
        )
        await sandbox.start(force_build=False)
        try:
            agent_env = {
                "OPENAI_BASE_URL": grant.url_at(f"http://127.0.0.1:{DEFAULT_RELAY_PORT}"),
                "OPENAI_API_KEY": grant.token,
            }
            answer = await sandbox.exec(ASK, env=agent_env, timeout_sec=30)
            assert answer.return_code == 0, answer.stderr
            assert " 200 " in answer.stdout.splitlines()[0]
            assert '"content": "42"' in answer.stdout and KEY not in answer.stdout

            # Search every file and every process environment inside. The value is fed to
            # grep in two pieces on stdin, so not even grep's argv holds it. A canary planted
            # in a file and in a process environment proves the search would find the key.
            async def places_holding(value: str) -> list[str]:
                head, tail = value[:12], value[12:]
                scan = await sandbox.exec(
                    f"v=$(printf '%s%s' '{head}' '{tail}')\n"
                    'printf "%s\\n" "$v" | grep -rlF -D skip -f - '
                    "--exclude-dir=proc --exclude-dir=sys --exclude-dir=dev / ; "
                    "for e in /proc/[0-9]*/environ; do "
                    'tr "\\0" "\\n" < "$e" 2>/dev/null | grep -qF "$v" && echo "$e"; done; true',
                    timeout_sec=120,
                    user="root",
                )
                assert scan.return_code == 0, scan.stderr
                return scan.stdout.split()

            canary = "canary-" + uuid.uuid4().hex
            planted = await sandbox.exec(
                f"echo {canary} > /tmp/planted; CANARY={canary} setsid sleep 60 >/dev/null 2>&1 &",
                user="root",
            )
            assert planted.return_code == 0
            found = await places_holding(canary)
            assert "/tmp/planted" in found and any(f.endswith("/environ") for f in found)
            assert await places_holding(KEY) == [], "the upstream key is inside the sandbox"
        finally:
            await sandbox.stop(delete=True)
        trace = relay.end("sandboxed-1")
    assert [c.status for c in trace.calls] == [200]
    assert trace.calls[0].choices[0].message == {"role": "assistant", "content": "42"}
    assert {c.authorization for c in policy.calls} == {f"Bearer {KEY}"}
