#!/usr/bin/env bash
# Build the base root filesystem that local sandboxes boot from.
#
# Usage: build-rootfs.sh DEST [SUITE]
#
# DEST must not exist yet; the caller (backends.sandbox.rootfs) builds into a
# staging directory and renames it into the cache when this script succeeds,
# so an interrupted build never leaves a half-made rootfs behind.
#
# The mirror is read from the machine's own apt sources, so the script works
# wherever apt works and no mirror host is hard-coded here.
set -euo pipefail

dest=${1:?usage: build-rootfs.sh DEST [SUITE]}
suite=${2:-bookworm}

if [[ $(id -u) -ne 0 ]]; then
  echo "build-rootfs.sh: must run as root (debootstrap needs it)" >&2
  exit 1
fi
for tool in debootstrap bwrap socat; do
  command -v "$tool" >/dev/null || {
    echo "build-rootfs.sh: '$tool' is missing; apt-get install -y bubblewrap debootstrap socat" >&2
    exit 1
  }
done

# First deb URI of the host's apt configuration (deb822 or one-line format).
mirror=$(
  { grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
    grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '{print $2}'
  } | grep -v security | head -n1 || true
)
if [[ -z $mirror ]]; then
  echo "build-rootfs.sh: no apt mirror found in /etc/apt/sources.list*" >&2
  exit 1
fi

# What Harbor agents and tasks expect to find, since a sandbox has no network
# at run time: a shell and coreutils (minbase), tmux for terminus-2, socat for
# the relay forwarder, python3 plus the shared libraries a bound host Python
# needs (ssl, sqlite3, readline, ctypes, ...), useradd for Dockerfile USER
# steps, ps/kill for tasks that manage processes.
packages=(
  tmux socat procps passwd python3 ca-certificates
  libssl3 libsqlite3-0 libreadline8 libncursesw6 libffi8 libexpat1
  libbz2-1.0 liblzma5 zlib1g libuuid1
)
include=$(IFS=,; echo "${packages[*]}")

debootstrap --variant=minbase --include="$include" "$suite" "$dest" "$mirror"

# Drop package caches and lists: they are large and useless without network.
rm -rf "$dest"/var/cache/apt/archives/*.deb "$dest"/var/lib/apt/lists/*
# Mount points the sandbox launcher binds over.
mkdir -p "$dest"/logs "$dest"/run/backends "$dest"/tmp
chmod 1777 "$dest"/tmp
# An empty resolv.conf: public-network sandboxes get the host's bound on top.
: > "$dest"/etc/resolv.conf
echo "sandbox" > "$dest"/etc/hostname
echo "build-rootfs.sh: built $suite rootfs in $dest" >&2
