#!/bin/bash
# task.toml's workdir overrides the Dockerfile's WORKDIR for every exec.
if [ "$(pwd)" = /srv/work ] && [ "$(cat /srv/work/done.txt 2>/dev/null)" = ok ] && [ ! -e /app/done.txt ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
