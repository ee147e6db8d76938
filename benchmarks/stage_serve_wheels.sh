#!/usr/bin/env bash
# Stage what `kiln serve` and its benchmarks need on the GPU host (Kiln's dependencies the host lacks, PyTriton's
# tritonserver, tritonclient and theirs), split into chunks for the device tool, as ../shared/device/stage-wheels.sh
# does for onnxruntime-gpu and TensorRT-RTX. Why a copy of it: PyTriton 0.7.0's wheel is manylinux_2_35, a platform
# that script does not ask pip for. Run from the project root on the CPU machine:
#   bash benchmarks/stage_serve_wheels.sh
# then on the GPU host, one device call per chunk: bash .devwheels/cK/device-install.sh collect cK (the last: install).
#   bash benchmarks/stage_serve_wheels.sh --engines
# stages only Kiln's own dependencies the host lacks (no server, no numpy 1.26 over the host's), one small chunk:
# building and timing engines on the GPU host then takes one device call, `install c0` and the work after it.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
install_script=$(cd "$root/../shared/device" && pwd)/device-install.sh
gd=$(git rev-parse --git-dir)
mkdir -p "$gd/info"
grep -qx '/.devwheels/' "$gd/info/exclude" 2>/dev/null || echo '/.devwheels/' >> "$gd/info/exclude"
pkgs=(onnx-graphsurgeon==0.6.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  onnxconverter-common==1.16.0 typing-extensions==4.16.0 nvidia-pytriton==0.7.0 tritonclient==2.73.0
  geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope-event==6.2 zope-interface==8.7 python-rapidjson==1.25
  pyzmq==27.3.0 sh==2.4.0 wrapt==2.5.2 grpcio==1.85.3 protobuf==6.33.6 brotli==1.2.1 numpy==1.26.4 typer==0.29.2
  typing-inspect==0.9.0 mypy-extensions==1.2.0 importlib-metadata==10.2.0 zipp==4.1.2 shellingham==1.5.4)
if [[ ${1:-} == --engines ]]; then
  pkgs=("${pkgs[@]:0:7}")  # onnx-graphsurgeon .. typing-extensions: what Kiln itself imports
elif [[ -n ${1:-} ]]; then
  echo "usage: bash benchmarks/stage_serve_wheels.sh [--engines]" >&2
  exit 2
fi
cache=${DEVWHEELS_CACHE:-$HOME/.cache/devwheels}
mkdir -p "$cache"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$cache" "${pkgs[@]}"
rm -rf .devwheels && mkdir -p .devwheels/stage
for p in "${pkgs[@]}"; do
  n=${p%%==*}; v=${p#*==}
  f=$(ls "$cache" | grep -i "^$(echo "${n//-/_}" | sed 's/\./_/g')-${v}-.*\.whl$" | head -1)
  [[ -n $f ]] || { echo "missing wheel for $p" >&2; exit 1; }
  cp "$cache/$f" .devwheels/stage/
done
(cd .devwheels/stage && tar cf ../all.tar ./*.whl)
rm -rf .devwheels/stage
(cd .devwheels && split -b 48M -d -a 2 all.tar part. && rm all.tar)
i=0
for f in .devwheels/part.*; do
  mkdir -p ".devwheels/c$i" && mv "$f" ".devwheels/c$i/" && cp "$install_script" ".devwheels/c$i/"
  i=$((i + 1))
done
echo "staged ${#pkgs[@]} wheels into $i chunks (.devwheels/c0 .. c$((i - 1)))"
