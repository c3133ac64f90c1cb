#!/bin/bash
# State carries over between steps: the sandbox is the same.
[ "$(cat /work/log.txt 2>/dev/null)" = "$(printf 'first\nsecond')" ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
