#!/usr/bin/env bash
# The README's test command while busy loops hold the machine (default 7: a load average of about 8 on 2 cores,
# with pytest itself). Prints the load average each minute and the suite's wall time.
#   bash benchmarks/suite_under_load.sh [LOOPS]
set -u
cd "$(dirname "$0")/.."
loops=${1:-7}
pids=()
for _ in $(seq "$loops"); do python3 -c 'while True: pass' & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
( while true; do echo "load $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)" >&2; sleep 60; done ) & pids+=($!)
sleep 60  # let the load average climb first
start=$(date +%s)
python -m pytest -q -p no:cacheprovider
rc=$?
echo "README test command under $loops busy loops: exit $rc, $(( $(date +%s) - start )) s wall"
exit $rc
