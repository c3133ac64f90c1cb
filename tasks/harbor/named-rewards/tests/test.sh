#!/bin/bash
# reward.txt says 0, but reward.json takes precedence: "reward" is the one to train on.
correct=0
[ "$(cat /app/answer.txt 2>/dev/null)" = correct ] && correct=1
echo 0 > /logs/verifier/reward.txt
printf '{"reward": %s, "correctness": %s, "style": 0.5}\n' "$correct" "$correct" > /logs/verifier/reward.json
