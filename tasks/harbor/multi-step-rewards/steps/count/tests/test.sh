#!/bin/bash
# Named rewards per step: reward, plus whether the file exists at all.
exists=0; right=0
[ -f /work/count.txt ] && exists=1
[ "$(tr -d ' ' < /work/count.txt 2>/dev/null)" = 3 ] && right=1
printf '{"reward": %s, "exists": %s}\n' "$right" "$exists" > /logs/verifier/reward.json
