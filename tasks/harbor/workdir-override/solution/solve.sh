#!/bin/bash
echo ok > done.txt
