#!/usr/bin/env bash
# The trainer pod's entrypoint (launchers/k8s/job.yaml): plan, then torchrun, then exit with the
# trainer's own exit code, so that the Job's podFailurePolicy can tell bad input (2), a failed
# save (74) and budget stops (75, 76) from a crash. torchrun itself reports 1 for any failure.
#   bash launchers/k8s/entrypoint.sh CONFIG [--section.key=value ...]   (NNODES, NPROC_PER_NODE set)
set -uo pipefail
CONFIG=$1
shift
PY=${PY:-python3}
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
for v in NNODES NPROC_PER_NODE; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "entrypoint: $v must be a number, got '${!v}'" >&2; exit 2; }
done
plan=$("$PY" -m core.plan --config "$CONFIG" --nproc "$((NNODES * NPROC_PER_NODE))" --json "$@") || exit 2
OUTPUT_DIR=$(printf '%s' "$plan" | "$PY" -c "import json, sys; print(json.load(sys.stdin)['output_dir'])")
"$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --node_rank="${JOB_COMPLETION_INDEX:-0}" --rdzv-backend=c10d \
    --rdzv-endpoint="${RDZV_ENDPOINT:-plait-0.plait:29500}" --rdzv-id="${RDZV_ID:-plait}" \
    -m core.train --config "$CONFIG" "$@"
code=$?
status="$OUTPUT_DIR/exit_status.json"
if [ "$code" -ne 0 ] && [ -f "$status" ]; then  # rank 0's pod: the trainer's own code
    code=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['exit_code'])" "$status" 2>/dev/null || echo "$code")
fi
exit "$code"
