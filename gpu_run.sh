set -u
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT
timeout 220 python3 benchmarks/engine_bench.py --models hf_bert --batches 32 --rows kiln_torch,kiln_torch_unfrozen --torch-flavour compiled --profile 10 --out $OUT/eb > $OUT/eb.log 2>&1
tail -30 $OUT/eb.log
