#!/bin/bash
wc -l < /work/items.txt > /work/count.txt
