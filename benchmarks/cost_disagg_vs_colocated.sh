#!/usr/bin/env bash
# pdserve cost: the same chat workload against the disaggregated and the colocated stack (BENCHMARKS.md, issue 13)
set -e
cd "$(dirname "$0")/.."
run() {
  mode=$1; port=$2
  .venv/bin/pdserve up --mode $mode --port $port --workdir /tmp/costrun-$mode > /tmp/costrun-$mode.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 1; done
  .venv/bin/pdserve bench --base-url http://127.0.0.1:$port --workload chat --num-requests 80 --max-concurrency 8 \
     --seed 7 --no-progress --out /tmp/cost-$mode.json > /tmp/cost-bench-$mode.txt 2>&1
  kill -INT $pid; wait $pid || true
}
rm -rf /tmp/costrun-*
run disaggregated 8101
run colocated 8102
.venv/bin/pdserve cost /tmp/cost-disaggregated.json --compare /tmp/cost-colocated.json --price prefill=1,decode=1,gb=0.02
