#!/usr/bin/env bash
# The trainer pod's entrypoint (launchers/k8s/job.yaml): plan, then torchrun, then exit with the
# trainer's own exit code, so that the Job's podFailurePolicy can tell bad input (2), a failed
# save (74) and budget stops (75, 76) from a crash. torchrun itself reports 1 for any failure. A run stopped
# by a signal (SIGTERM to this script is forwarded to torchrun) exits 143, never 0: it is not done.
#   bash launchers/k8s/entrypoint.sh CONFIG [--section.key=value ...]   (NNODES, NPROC_PER_NODE set)
set -uo pipefail
source "$(dirname "$0")/../wait_for_job.sh" || exit 2
source "$(dirname "$0")/../trainer_end.sh" || exit 2
CONFIG=$1
shift
PY=${PY:-python3}
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
AGENT_GRACE_S=${AGENT_GRACE_S:-330}  # torchrun's own exit barrier waits up to 300 s
ENDED_GRACE_S=${ENDED_GRACE_S:-15}   # ... but not once this attempt's exit_status.json records the run's end
for v in NNODES NPROC_PER_NODE AGENT_GRACE_S ENDED_GRACE_S; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "entrypoint: $v must be a number, got '${!v}'" >&2; exit 2; }
done
# The kubelet's SIGTERM (eviction, pre-emption, a deleted pod) reaches this script alone, PID 1 of the
# container, where bash ignores a signal it has no trap for: it is forwarded to torchrun, whose ranks stop
# at the next step boundary with a checkpoint.
signalled=0
trainer=""
# has_children PID: whether PID (torchrun) has child processes (its ranks) now; unknown (no /proc children file): yes.
has_children() {
    local f kids
    for f in /proc/"$1"/task/*/children; do
        [ -r "$f" ] || return 0
        kids=""
        read -r kids <"$f" || true
        if [ -n "$kids" ]; then return 0; fi
    done
    return 1
}
trap 'signalled=1; if [ -n "$trainer" ]; then kill -s TERM "$trainer" 2>/dev/null; fi' TERM INT
plan=$("$PY" -m core.plan --config "$CONFIG" --nproc "$((NNODES * NPROC_PER_NODE))" --json "$@") || exit 2
OUTPUT_DIR=$(printf '%s' "$plan" | "$PY" -c "import json, sys; print(json.load(sys.stdin)['output_dir'])")
status="$OUTPUT_DIR/exit_status.json"
# Rank 0's pod: a file left by an earlier pod (an output folder on a volume) must not speak for this one.
if [ "${JOB_COMPLETION_INDEX:-0}" = 0 ]; then rm -f "$status"; fi
if [ "$signalled" = 1 ]; then exit 143; fi  # stopped while it planned
# torchrun's output goes to the pod's log and to a file of this container's own (not the run's volume, which may be the
# full disk): when rank 0 could not write exit_status.json, its last lines there say why (trainer_end.sh).
said=$(mktemp "${TMPDIR:-/tmp}/plait-entrypoint.XXXXXX") || exit 1
trap 'rm -f "$said" "$said.outlived" "$said.started"' EXIT
exec 3> >(tee -a "$said")
teed=$!
: >"$said.started"  # an exit_status.json newer than this is this attempt's
"$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --node_rank="${JOB_COMPLETION_INDEX:-0}" --rdzv-backend=c10d \
    --rdzv-endpoint="${RDZV_ENDPOINT:-plait-0.plait:29500}" --rdzv-id="${RDZV_ID:-plait}" \
    -m core.train --config "$CONFIG" "$@" >&3 2>&3 &
trainer=$!
# torchrun can outlive this node's ranks: by up to 300 s in its exit barrier (waiting for the other nodes' agents: a
# pre-empted node's never comes), and for good when the node that serves the rendezvous store is lost without a word (a
# frozen or cut-off machine: its reads wait on it; seen with torch 2.13). Once no rank of this node has lived for
# AGENT_GRACE_S, or for ENDED_GRACE_S when rank 0 has recorded the run's end in this attempt's exit_status.json (every
# rank had stopped by then: this pod would only hold its GPUs idle), it is ended, and this pod exits with the trainer's
# own code, or 1 (a restart) without one.
outlived="$said.outlived"
outlive_watch() {
    local seen=0 gone=0 grace why
    while kill -0 "$trainer" 2>/dev/null; do
        if has_children "$trainer"; then seen=1 gone=0; elif [ "$seen" = 1 ]; then gone=$((gone + 1)); fi
        grace=$AGENT_GRACE_S why="(the rendezvous store's node lost?)"
        if [ "$status" -nt "$said.started" ] && [ "$ENDED_GRACE_S" -lt "$grace" ]; then
            grace=$ENDED_GRACE_S why="(the run's end is recorded in $status; its exit barrier waits for the other nodes' agents)"
        fi
        if [ "$seen" = 1 ] && [ "$gone" -ge "$grace" ]; then
            echo "plait: entrypoint: torchrun outlived this node's ranks by ${grace} s $why; ending it" >&2
            : >"$outlived"
            kill -s TERM "$trainer" 2>/dev/null
            for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$trainer" 2>/dev/null && sleep 1 </dev/null >/dev/null 2>&1; done
            kill -s KILL "$trainer" 2>/dev/null
            return
        fi
        sleep 1 </dev/null >/dev/null 2>&1  # (a sleep left behind when this watch is ended holds no output open)
    done
}
outlive_watch &
watcher=$!
wait_for_job "$trainer"  # sets $code
kill "$watcher" 2>/dev/null
exec 3>&-
for _ in $(seq 50); do kill -0 "$teed" 2>/dev/null || break; sleep 0.1; done  # the file holds torchrun's last lines
trainer_end "$status" "$said" 1  # rank 0's pod: the trainer's own code (exit_status.json, or its last words)
if [ -n "$end_code" ]; then code=$end_code; elif [ -f "$status" ] || [ -e "$outlived" ]; then code=1; fi
if [ -n "$end_note" ]; then echo "plait: entrypoint: $end_note" >&2; fi
# A run stopped by a signal is not done: exit 0 would mark this index of the Job as succeeded.
case $end_reason in
    signal) code=143 ;;
    "" | error | stalled) if [ "$signalled" = 1 ]; then code=143; fi ;;
esac
exit "$code"
