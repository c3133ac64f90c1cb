#!/bin/bash
echo second >> /work/log.txt
