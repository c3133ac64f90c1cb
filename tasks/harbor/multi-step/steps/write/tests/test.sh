#!/bin/bash
# docker_image tasks get environment/ uploaded into the workdir at start.
[ "$(cat /work/log.txt 2>/dev/null)" = first ] && [ -f /work/seed.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
