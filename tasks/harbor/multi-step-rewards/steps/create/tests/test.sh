#!/bin/bash
[ "$(cat /work/items.txt 2>/dev/null)" = "$(printf 'a\nb\nc')" ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
