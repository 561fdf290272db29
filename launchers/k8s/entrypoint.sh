#!/usr/bin/env bash
# The trainer pod's entrypoint (launchers/k8s/job.yaml): plan, then torchrun, then exit with the
# trainer's own exit code, so that the Job's podFailurePolicy can tell bad input (2), a failed
# save (74) and budget stops (75, 76) from a crash. torchrun itself reports 1 for any failure. A run stopped
# by a signal (SIGTERM to this script is forwarded to torchrun) exits 143, never 0: it is not done.
#   bash launchers/k8s/entrypoint.sh CONFIG [--section.key=value ...]   (NNODES, NPROC_PER_NODE set)
set -uo pipefail
source "$(dirname "$0")/../wait_for_job.sh" || exit 2
CONFIG=$1
shift
PY=${PY:-python3}
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
for v in NNODES NPROC_PER_NODE; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "entrypoint: $v must be a number, got '${!v}'" >&2; exit 2; }
done
# The kubelet's SIGTERM (eviction, pre-emption, a deleted pod) reaches this script alone, PID 1 of the
# container, where bash ignores a signal it has no trap for: it is forwarded to torchrun, whose ranks stop
# at the next step boundary with a checkpoint.
signalled=0
trainer=""
trap 'signalled=1; if [ -n "$trainer" ]; then kill -s TERM "$trainer" 2>/dev/null; fi' TERM INT
plan=$("$PY" -m core.plan --config "$CONFIG" --nproc "$((NNODES * NPROC_PER_NODE))" --json "$@") || exit 2
OUTPUT_DIR=$(printf '%s' "$plan" | "$PY" -c "import json, sys; print(json.load(sys.stdin)['output_dir'])")
status="$OUTPUT_DIR/exit_status.json"
# Rank 0's pod: a file left by an earlier pod (an output folder on a volume) must not speak for this one.
if [ "${JOB_COMPLETION_INDEX:-0}" = 0 ]; then rm -f "$status"; fi
if [ "$signalled" = 1 ]; then exit 143; fi  # stopped while it planned
"$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --node_rank="${JOB_COMPLETION_INDEX:-0}" --rdzv-backend=c10d \
    --rdzv-endpoint="${RDZV_ENDPOINT:-plait-0.plait:29500}" --rdzv-id="${RDZV_ID:-plait}" \
    -m core.train --config "$CONFIG" "$@" &
trainer=$!
wait_for_job "$trainer"  # sets $code
reason=""
if [ -f "$status" ]; then  # rank 0's pod: the trainer's own code
    read -r code reason < <("$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); print(int(s['exit_code']), s.get('reason', ''))" "$status" 2>/dev/null || echo "$code error")
fi
# A run stopped by a signal is not done: exit 0 would mark this index of the Job as succeeded.
case $reason in
    signal) code=143 ;;
    "" | error | stalled) if [ "$signalled" = 1 ]; then code=143; fi ;;
esac
exit "$code"
