#!/bin/bash
# Runs in the image's WORKDIR (/app).
total=0
while read -r n; do total=$((total + n)); done < numbers.txt
echo "$total" > "$TARGET_FILE"
