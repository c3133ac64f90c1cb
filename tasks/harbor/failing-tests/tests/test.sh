#!/bin/bash
# The check wants 43, which the instruction never asks for: the tests always fail.
if [ "$(cat /app/answer.txt 2>/dev/null)" = 43 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "expected 43, got $(cat /app/answer.txt 2>&1)"
  echo 0 > /logs/verifier/reward.txt
  exit 1
fi
