#!/bin/bash
echo first > /work/log.txt
