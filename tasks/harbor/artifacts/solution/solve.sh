#!/bin/bash
echo done > /app/report.txt
echo "wrote /app/report.txt" > /logs/artifacts/notes.txt
