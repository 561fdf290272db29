#!/usr/bin/env bash
# Every GPU measurement the open issues ask for, in one call on a lent GPU node with no network.
#
#   OUT=/tmp/gpu-out bash bench/gpu_session.sh [a|b]
#
# Wheels the node lacks (torchao, torchdata, plait's own for its entry points) are
# read from .whl/ when present. Each step has its own time limit so that one hang
# cannot take the others' figures with it; logs, profiles and the updated
# docs/benchmarks.md are copied to $OUT after every step.
set -u
OUT=${OUT:-/tmp/plait-gpu-out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/logs/install.txt" 2>&1 || { cat "$OUT/logs/install.txt"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
collect() { cp docs/benchmarks.md "$OUT/benchmarks.md"; tar -czf "$OUT/logs.tgz" -C "$OUT" logs; }
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/logs/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$OUT/logs/$name.txt"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  collect
}
{ nvidia-smi; python3 -c "import torch, torchao; print(torch.__version__, torch.version.cuda, torchao.__version__, torch.cuda.get_device_name(0))"; } \
  > "$OUT/logs/env.txt" 2>&1
cat "$OUT/logs/env.txt" | tail -n 3
part=${1:-a}
if [ "$part" = a ]; then
  step test_cuda 150 python3 -m pytest -q -x tests/test_cuda.py
  step gpu_1b 290 python3 -m bench.gpu_1b --only bf16-eager-mb4 bf16-compile-mb8 fp8-tensorwise-compile-mb8 fp8-rowwise-compile-mb8 \
    --profile "$OUT/logs/prof"
  step overhead 60 python3 -m bench.overhead --device cuda --precision bf16
  step checkpoint_stall 100 python3 -m bench.checkpoint_stall --flavor 1b --device cuda --repeats 2
  step guard_cost 90 python3 -m bench.guard_cost --device cuda --flavor 1b --seq-len 2048 --micro-batch 4 --steps 10 --rounds 3
else
  step gpu_1b_all 420 python3 -m bench.gpu_1b
  step overhead 60 python3 -m bench.overhead --device cuda --precision bf16
  step checkpoint_stall 100 python3 -m bench.checkpoint_stall --flavor 1b --device cuda --repeats 2
fi
collect
