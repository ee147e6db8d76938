#!/usr/bin/env bash
# Runs on the GPU host (see ../shared/device/README.md), from the repo root, after the wheels are installed into
# /tmp/site:  PYTHONPATH=/tmp/site bash benchmarks/gpu_session.sh PHASE...   (results go to $OUT)
# `python3 -P` and pytest's append import mode keep the checkout's own kiln/ folder (the package root without its
# subpackages, which live beside it) from shadowing the installed wheel.
# Phases: check (environment, GPU-marked tests, the demo pipeline on CUDA), cached, engine, choice (issue 12), coordesc, replay,
# convprobe, gemmalgo, attention, train, train-compile, train-phases, precision, serve, bytecode, tte.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-gpu-out}
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*"; }
for phase in "$@"; do
  stamp "phase $phase"
  case $phase in
    check)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
      python3 -c "import sys, torch, onnxruntime as ort; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0), 'ort', ort.__version__, ort.get_available_providers())"
      python3 -P -m pytest -q -rfE -m gpu -p no:cacheprovider --import-mode=append tests > "$OUT/gpu_tests_full.txt" 2>&1; tail -40 "$OUT/gpu_tests_full.txt"
      python3 -P -m kiln.cli run -w /tmp/kiln-gpu --quiet --set 'build.onnxruntime.devices=[cpu,cuda]' \
        --set 'signature.batch_sizes=[1,32]'; echo "kiln run rc=$?"
      cp /tmp/kiln-gpu/report.md "$OUT/gpu_demo_report.md"; cp /tmp/kiln-gpu/report.json "$OUT/gpu_demo_report.json"
      grep -A12 "## Validation" /tmp/kiln-gpu/report.md ;;
    # a run whose stages are all cached loads no torch (kiln.core.env keeps the GPU's facts): the demo on CUDA, then
    # three reruns timed, and the facts kept
    cached)
      python3 -P -m kiln.cli run -w /tmp/kiln-gpu-cached --quiet > /dev/null; echo "first kiln run rc=$?"
      TIMEFORMAT='cached rerun %R s'
      for i in 1 2 3; do time python3 -P -m kiln.cli run -w /tmp/kiln-gpu-cached --quiet > /dev/null; done
      python3 -P -X importtime -m kiln.cli run -w /tmp/kiln-gpu-cached --quiet 2>&1 >/dev/null \
        | grep -E '\| (torch|onnx|onnxruntime)$' || echo "cached rerun imported no torch, onnx or onnxruntime"
      cp /tmp/kiln-gpu-cached/cache/device-facts.json "$OUT/"; cat "$OUT/device-facts.json"
      python3 -c "import json; r = json.load(open('/tmp/kiln-gpu-cached/report.json')); print({n: s['status'] for n, s in r['stages'].items()})" ;;
    engine) python3 benchmarks/engine_bench.py --out "$OUT" ${ENGINE_ARGS:-} ;;
    # the host's image ships torch without bytecode and sets PYTHONDONTWRITEBYTECODE=1, so every process compiles
    # what it imports (benchmarks/README.md, Time to an engine): compile it once, as a pip install does
    bytecode)
      python3 -m compileall -q -j 0 "$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" \
        /tmp/site > /dev/null 2>&1; echo "compileall rc=$?" ;;
    tte) python3 -P benchmarks/time_to_engine.py --gpu --models hf_bert --out "$OUT/tte" ${TTE_ARGS:-} ;;
    # issue 12: every engine kind on the GPU, PyTorch eager/compile baselines on the GPU, memory, chosen engine
    choice)
      python3 -P -m kiln.cli run -w /tmp/kiln-gpu-choice --quiet \
        --set 'build.backends=[onnxruntime,tensorrt,torch]' --set 'build.onnxruntime.devices=[cpu,cuda]' \
        --set 'build.torch.devices=[cuda]' --set 'signature.batch_sizes=[1,32]' \
        --set 'validate.baselines=[eager,compile]' --set 'validate.baseline_precisions=[fp32,fp16]'
      echo "kiln run rc=$?"
      cp /tmp/kiln-gpu-choice/report.md "$OUT/gpu_choice_report.md"
      cp /tmp/kiln-gpu-choice/validate/validation.json "$OUT/gpu_choice_validation.json"
      sed -n '/## Validation/,/## Training/p' /tmp/kiln-gpu-choice/report.md ;;
    # build.torch.coordinate_descent (auto: off without convolutions): BERT-base with it off (default) and on, in
    # two fresh Inductor caches so each build tunes anew; ResNet-18 (default: on) against off. ~9 minutes in all.
    coordesc)
      for i in 1 2; do
        TORCHINDUCTOR_CACHE_DIR=/tmp/ind-bert-$i python3 benchmarks/engine_bench.py --models hf_bert --batches 1,32 \
          --profile 20 --rows kiln_torch,kiln_torch_cd --torch-variant cd:coordinate_descent=on \
          --out "$OUT/coordesc_hf_bert_$i"
      done
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind-resnet python3 benchmarks/engine_bench.py --models resnet18 --batches 1,32 \
        --profile 20 --rows kiln_torch,kiln_torch_nocd --torch-variant nocd:coordinate_descent=off \
        --out "$OUT/coordesc_resnet18" ;;
    # what a torch engine's call costs around its CUDA graph (input copy, runner), ResNet-18: ~1 minute
    replay) python3 benchmarks/replay_copy.py --models resnet18 --out "$OUT" ;;
    # cuDNN's fused conv + bias (+ add) + ReLU against Inductor's kernels, torchvision's ResNet-18: ~5 minutes
    convprobe) python3 benchmarks/conv_epilogue_probe.py --out "$OUT/convprobe" ;;
    # build.torch.gemm_algorithms=measured (issue 33): the probe per GEMM, the GPU-marked tests of the measured path,
    # then BERT-base's FP16 and FP8 engines with the heuristic's algorithm and the measured one, side by side
    gemmalgo)
      python3 -P benchmarks/cublaslt_fp8_probe.py --rows 4096,128 --rounds 20 --algos 16 --out "$OUT/probe"
      python3 -P -m pytest -q -m gpu -p no:cacheprovider --import-mode=append tests/stages/engines/torch/test_cublaslt.py \
        tests/stages/engines/torch/test_fp8_epilogues.py tests/stages/engines/torch/test_lowbit.py \
        tests/stages/engines/torch/test_gemm_epilogues.py 2>&1 | tail -15 | tee "$OUT/gemmalgo_tests.txt"
      python3 -P benchmarks/engine_bench.py --models hf_bert --batches 1,32 --profile 20 --out "$OUT/eb" \
        --rows kiln_torch,kiln_torch_meas,kiln_torch_fp8,kiln_torch_fp8meas \
        --torch-variant meas:gemm_algorithms=measured --torch-variant fp8meas:precision=fp8,gemm_algorithms=measured ;;
    # build.torch.fused_attention (issue 33): its GPU-marked test, then a ViT's and a BERT's FP16 engines with fused
    # attention (auto) and without, beside eager FP16; ATTN_MODELS picks the models
    attention)
      python3 -P -m pytest -q -rfE -m gpu -p no:cacheprovider --import-mode=append \
        tests/stages/engines/torch/test_attention.py 2>&1 | tail -8 | tee "$OUT/attention_tests.txt"
      python3 -P benchmarks/engine_bench.py --models "${ATTN_MODELS:-hf_vit,hf_bert}" --batches 1,32 --profile 20 \
        --out "$OUT/attn" --rows eager16,kiln_torch,kiln_torch_noattn --torch-variant noattn:fused_attention=off ;;
    train) python3 benchmarks/train_bench.py --out "$OUT" ${TRAIN_ARGS:-} ;;
    # torch.compile table, one model per call keeps each under 10 minutes: TRAIN_COMPILE_ARGS="--models resnet18"
    train-compile) python3 benchmarks/train_bench.py --compile --out "$OUT" ${TRAIN_COMPILE_ARGS:-} ;;
    # the same with host ms per part of the step (issue 16), one model per call: ~1.5-2.5 minutes each
    train-phases)
      for m in bert_base resnet18 bert_base_hf; do
        python3 benchmarks/train_bench.py --compile --phases --models $m --windows 6 --out "$OUT/phases_$m"
      done ;;
    precision) python3 benchmarks/precision_bench.py --gpu --out "$OUT" ${PRECISION_ARGS:-} ;;
    serve) python3 benchmarks/serve_bench.py --resnet18-fp16 --concurrency 1,2,4,8,16,32,64 --duration 10 \
             --out "$OUT" ${SERVE_ARGS:-} ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
stamp done
