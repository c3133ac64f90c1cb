#!/bin/bash
echo correct > /app/answer.txt
