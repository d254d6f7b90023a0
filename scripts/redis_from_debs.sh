#!/usr/bin/env bash
# Unpack the .deb files of ./.debs (scripts/fetch_redis_debs.sh) into a folder (default
# /tmp/redis, never /), and start redis-server from there on a free loopback port, in the
# background, with persistence off. Prints the URL (redis://127.0.0.1:PORT) on its last line;
# the server's pid is in FOLDER/redis.pid. Needs no installed redis-server.
#   usage: bash scripts/redis_from_debs.sh [FOLDER] [PORT]
set -eu
dest=${1:-/tmp/redis}
port=${2:-6390}
debs=$(cd "$(dirname "$0")/.." && pwd)/.debs
ls "$debs"/*.deb >/dev/null
rm -rf "$dest" && mkdir -p "$dest/data"
for f in "$debs"/*.deb; do
  if command -v dpkg >/dev/null; then
    dpkg -x "$f" "$dest"
  else  # a .deb is an ar archive holding data.tar.*
    (cd "$dest" && ar p "$f" "$(ar t "$f" | grep '^data.tar')" | tar -x -a -f - 2>/dev/null || \
      ar p "$f" "$(ar t "$f" | grep '^data.tar')" | tar -x --zstd -f -)
  fi
done
libs="$dest/usr/lib/x86_64-linux-gnu:$dest/lib/x86_64-linux-gnu"
# The unpacked libraries serve redis-server alone (LD_LIBRARY_PATH for its process only).
LD_LIBRARY_PATH="$libs" "$dest/usr/bin/redis-server" --port "$port" --bind 127.0.0.1 --save "" \
  --appendonly no --dir "$dest/data" --daemonize yes --pidfile "$dest/redis.pid" \
  --logfile "$dest/redis.log" --loglevel warning --protected-mode yes
for _ in $(seq 100); do
  if LD_LIBRARY_PATH="$libs" "$dest/usr/bin/redis-cli" -p "$port" ping 2>/dev/null | grep -q PONG; then
    LD_LIBRARY_PATH="$libs" "$dest/usr/bin/redis-server" --version
    echo "redis://127.0.0.1:$port"
    exit 0
  fi
  sleep 0.1
done
echo "redis-server did not start:"; cat "$dest/redis.log"; exit 1
