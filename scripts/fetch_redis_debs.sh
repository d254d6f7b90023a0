#!/usr/bin/env bash
# Download, HERE (a Debian bookworm machine with its apt sources), into ./.debs (git-ignored):
# Debian's redis-server and redis-tools and the shared libraries they link that a CUDA/Ubuntu
# image may lack. The H200 machine cannot fetch anything; the lead carries .debs there, and
# `bash scripts/h200.sh redis-gpu` unpacks them with dpkg -x into /tmp/redis (never into /)
# and starts redis-server from there (scripts/redis_from_debs.sh).
#
# What redis-server needs (checked with `dpkg -I` and `ldd` after `dpkg -x`): redis-tools
# holds the binary (redis-server is a link to redis-check-rdb), linked to libatomic1,
# liblzf1, libjemalloc2, libssl3 (libcrypto), libsystemd0; libsystemd0 in turn links
# libcap2, libgcrypt20, libgpg-error0, liblz4-1, libzstd1, liblzma5. libc6 and libstdc++6
# (glibc >= 2.34) are the image's own.
set -eu
cd "$(git rev-parse --show-toplevel)"
mkdir -p .debs
cd .debs
apt-get download redis-server redis-tools libjemalloc2 liblzf1 libatomic1 libssl3 libsystemd0 \
  libcap2 libgcrypt20 libgpg-error0 liblz4-1 libzstd1 liblzma5
ls -1 *.deb
du -sh .
