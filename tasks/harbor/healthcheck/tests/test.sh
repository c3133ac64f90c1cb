#!/bin/bash
[ "$(cat /app/greeting.txt 2>/dev/null)" = hello ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
