#!/bin/bash
# A fresh environment: only /logs/artifacts came across from the agent's sandbox.
if [ "$(cat /logs/artifacts/answer.txt 2>/dev/null)" = 42 ] && [ ! -e /tmp/agent-was-here ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
