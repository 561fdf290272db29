#!/usr/bin/env bash
# Every GPU measurement the open issues ask for, in one call on a lent GPU node with no network.
#
#   OUT=/tmp/gpu-out bash bench/gpu_session.sh [a|b]   # a: what issue 13 asks for; b: the rest
#
# Wheels the node lacks (torchao, torchdata, plait's own for its entry points) are
# read from .whl/ when present. Each step has its own time limit so that one hang
# cannot take the others' figures with it; logs, profiles and the updated
# bench/results.jsonl are copied to $OUT after every step.
set -u
OUT=${OUT:-/tmp/plait-gpu-out}
# Logs are kept outside $OUT and come back as one archive: the device tool returns at most 8 files.
LOGS=${LOGS:-/tmp/plait-gpu-logs}
mkdir -p "$OUT" "$LOGS/logs"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/logs/install.txt" 2>&1 || { cat "$LOGS/logs/install.txt"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
collect() { cp bench/results.jsonl "$OUT/results.jsonl"; tar -czf "$OUT/logs.tgz" -C "$LOGS" logs; }
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/logs/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/logs/$name.txt"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  collect
}
{ nvidia-smi; python3 -c "import torch, torchao; print(torch.__version__, torch.version.cuda, torchao.__version__, torch.cuda.get_device_name(0))"; } \
  > "$LOGS/logs/env.txt" 2>&1
cat "$LOGS/logs/env.txt" | tail -n 3
part=${1:-a}
# Step limits come from the first H100 session (2026-11-25): test_cuda took 139 s, four 1b
# variants 82 s, the config variant 31 s, the overhead 16-25 s, an async stall run of two
# saves about 100 s and a sync one 43 s; part a fits one 10-minute call with room to spare.
if [ "$part" = a ]; then  # what issue 13 asks for
  step test_cuda 200 python3 -m pytest -q tests/e2e/test_cuda.py
  step gpu_1b 200 python3 -m bench.gpu_1b --only config-1b_h100 bf16-compile-mb8 fp8-tensorwise-compile-mb8 fp8-rowwise-compile-mb8 \
    bf16-compile-mb16 fp8-tensorwise-compile-mb16 fp8-tensorwise-head-compile-mb16 --profile "$LOGS/logs/prof"
  step overhead 50 python3 -m bench.overhead --device cuda --precision bf16 --steps 100
  step checkpoint_stall 130 python3 -m bench.checkpoint_stall --flavor 1b --device cuda --modes async --repeats 2
else  # the rest: every 1b variant, where the overhead goes, sync saves, the guard's cost
  step gpu_1b_all 240 python3 -m bench.gpu_1b
  step overhead_parts 90 python3 -m bench.overhead_parts
  step cuda_profile 60 python3 -m bench.cuda_profile --steps 20
  step checkpoint_stall_sync 80 python3 -m bench.checkpoint_stall --flavor 1b --device cuda --modes sync --repeats 1
  step guard_cost 90 python3 -m bench.guard_cost --device cuda --flavor 50m --seq-len 1024 --micro-batch 8 --steps 10 --rounds 3
fi
collect
