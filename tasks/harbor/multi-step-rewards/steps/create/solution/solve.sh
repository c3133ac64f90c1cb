#!/bin/bash
printf 'a\nb\nc\n' > /work/items.txt
