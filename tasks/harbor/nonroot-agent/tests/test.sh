#!/bin/bash
# The agent ran as "agent" (not root), and owns what it wrote; the verifier runs as root.
f=/home/agent/whoami.txt
if [ "$(cat $f 2>/dev/null)" = agent ] && [ "$(stat -c %U $f)" = agent ] && [ "$(id -u)" = 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
