#!/usr/bin/env bash
# `.ci/run` on a clean clone of HEAD while busy loops hold the machine (default 7: a load average of about 8 on 2
# cores with CI's own work), Inductor's cache cold (a folder of its own), the load average and memory in use printed
# each minute.
#   bash benchmarks/ci_under_load.sh [LOOPS] > ci_under_load.log 2>&1
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
loops=${1:-7}
work=$(mktemp -d /tmp/kiln-ci-load.XXXX)
git clone -q "$repo" "$work/kiln"
pids=()
for _ in $(seq "$loops"); do python3 -c 'while True: pass' & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
( while true; do echo "load $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg), memory used $(free -m | awk '/^Mem/ {print $3}') MiB" >&2; sleep 60; done ) & pids+=($!)
sleep 60  # let the load average climb first
start=$(date +%s)
rm -rf /tmp/kiln-ci-venv /tmp/kiln-ci-demo
TORCHINDUCTOR_CACHE_DIR=$work/inductor bash "$work/kiln/.ci/run"
rc=$?
echo ".ci/run under $loops busy loops, commit $(git -C "$work/kiln" rev-parse --short HEAD): exit $rc, $(( $(date +%s) - start )) s wall"
exit $rc
