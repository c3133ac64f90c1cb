#!/bin/bash
# The verifier also starts in WORKDIR.
if [ "$(pwd)" = /app ] && [ "$(cat sum.txt 2>/dev/null)" = 42 ] && [ -f .built ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "pwd=$(pwd) sum=$(cat sum.txt 2>&1)"
  echo 0 > /logs/verifier/reward.txt
fi
