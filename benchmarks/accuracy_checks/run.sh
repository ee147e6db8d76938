#!/usr/bin/env bash
# Issue 32's model cases, on whatever machine this runs (the GPU host adds ONNX Runtime CUDA engines and the
# torch FP16 ResNet-18 of time_to_engine.py). Usage: bash benchmarks/accuracy_checks/run.sh OUT_DIR [--gpu]
set -u
out=${1:?OUT_DIR}; gpu=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d); mkdir -p "$out"
cp "$here"/handbert.py "$here"/handbert.yaml "$work"/
(cd "$work" && python3 handbert.py && PYTHONPATH="$work:${PYTHONPATH:-}" python3 -m kiln.cli run handbert.yaml -w wd --quiet;
 echo "handbert exit $?" >"$out/handbert.exit"; cp wd/report.md "$out/handbert.report.md"; cp wd/report.json "$out/handbert.report.json")
if [ "$gpu" = "--gpu" ]; then
  python3 "$here/../time_to_engine.py" --gpu --models resnet18 --out "$out" >"$out/resnet18.log" 2>&1
  echo "resnet18 exit $?" >>"$out/handbert.exit"
fi
