#!/bin/bash
id -un > "$HOME/whoami.txt"
