#!/bin/bash
# How long `pdserve up` (its defaults) takes to serve, and what each of its processes holds at idle.
#
#     benchmarks/up_start_memory.sh [CHECKOUT] [PORT]      (CHECKOUT: a clone with its .venv; default .)
#
# Starts `pdserve up --port PORT` in CHECKOUT, times the wait for "pdserve is up" (printed once
# /health answers), waits a second, then prints the resident memory of `up` and of every process
# under it (valkey, nats-server, gateway, kvstore, workers), and stops the stack. Run two checkouts
# alternately (A B B A) to compare them.
set -euo pipefail
dir=${1:-.}
port=${2:-8131}
cd "$dir"
log=$(mktemp)
.venv/bin/pdserve up --port "$port" >"$log" 2>&1 &
up=$!
t0=$(date +%s.%N)
for _ in $(seq 1 1200); do
  grep -q "pdserve is up" "$log" && break
  kill -0 $up 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.05
done
t=$(echo "$(date +%s.%N) - $t0" | bc)
sleep 1
name() {  # a process's role: the service module, or the program
  local cmd
  cmd=$(tr '\0' ' ' </proc/$1/cmdline)
  grep -oE "services\.[a-z]+|pdserve up|nats-server|valkey-server" <<<"$cmd" | head -1 || basename "${cmd%% *}"
}
descendants() { for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }
total=0
line=""
for p in $up $(descendants $up); do
  rss=$(( $(ps -o rss= -p "$p" 2>/dev/null || echo 0) / 1024 ))
  [ "$rss" -lt 1 ] && continue
  line="$line $(name "$p")=${rss}"
  total=$((total + rss))
done
echo "$(basename "$(pwd)") up in ${t}s, resident ${total} MB:$line"
kill -INT $up
wait $up || true
rm -f "$log"
