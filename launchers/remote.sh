#!/usr/bin/env bash
# plait on one rented cloud node: verify, resume, restart, budget-aware.
#
#   CONFIG=train_configs/50m_a100.toml CKPT_EVERY=500 launchers/remote.sh [--section.key=value ...]
#
# Environment (each maps to a config override; unset means "as the config says"):
#   CONFIG         run TOML (default train_configs/debug_cpu.toml)
#   PRECISION      --precision.name            SEQ_LEN     --data.seq_len
#   MICRO_BATCH    --train.micro_batch         GRAD_ACCUM  sets train.global_batch_tokens =
#                                                          MICRO_BATCH x SEQ_LEN x NPROC x GRAD_ACCUM
#   TARGET_TOKENS  --train.target_tokens       N_LOOPS     --model.n_loops (recurrent models)
#   LR             --optimizer.lr              CKPT_EVERY  --checkpoint.every
#   CKPT_DIR       --checkpoint.dir            RESUME      --checkpoint.resume of the first attempt
#                                                          (default auto; restarts use it again until an attempt
#                                                          has committed a checkpoint, then auto)
#   OUTPUT_DIR     --train.output_dir (default runs/remote)
#   NPROC          processes (default: visible GPUs, else 2 on CPU)
#   MAX_RESTARTS   restarts in a row after a crash, stall or pre-emption of an attempt that committed no
#                  checkpoint (default 3); an attempt that did starts the count again, so
#                  a long run survives any number of pre-emptions that each left progress behind
#   BACKOFF_S      first wait before a restart (default 10; doubles with each restart in a row without progress)
#   LOG            log file (default $OUTPUT_DIR/remote.log)
# Numeric variables must be plain decimal integers (MICRO_BATCH may also be "auto"); anything else
# is refused before it reaches shell arithmetic.
# A crash (no exit_status.json, or one with reason "error") is restarted, and so is a stall (reason "stalled": the
# trainer's watchdog found no progress for train.stall_timeout_s and ended it); any other exit_status.json is final.
# SIGINT (Ctrl-C), SIGTERM or SIGHUP to this script stops the run: the trainer hears SIGTERM (SIGINT for
# Ctrl-C) once, from here, stops at the next step boundary with a checkpoint, and nothing is restarted.
# Exit codes: 0 done, or stopped by a signal with a checkpoint; 2 bad input (never retried, also when the
# trainer finds it, when another launcher holds OUTPUT_DIR or another job a folder of the run);
# 3 non-finite loss; 4 a monitor failed; 74 a checkpoint, a run file or the LOG could not be written (disk full, I/O error:
# never retried, restarting would only fill the disk again); 75/76 budget guard stops; 1 when the
# restarts in a row without progress ran out; 128 + the signal's number (130, 143, 129) when a signal
# stopped it before the trainer could save.
set -uo pipefail
cd "$(dirname "$0")/.."
source launchers/wait_for_job.sh || exit 2
source launchers/trainer_end.sh || exit 2

PY=${PYTHON:-python}
CONFIG=${CONFIG:-train_configs/debug_cpu.toml}
OUTPUT_DIR=${OUTPUT_DIR:-runs/remote}
MAX_RESTARTS=${MAX_RESTARTS:-3}
BACKOFF_S=${BACKOFF_S:-10}
mkdir -p "$OUTPUT_DIR"
# One launcher per run folder, for its whole life: between two attempts (the back-off) no trainer holds
# the run folder's lock, and a second launcher would take the folder over, or delete its exit_status.json.
# The lock is flock(2) on remote.lock, taken through fd 9, which this script (and what it starts) holds.
if ! exec 9>>"$OUTPUT_DIR/remote.lock"; then
    echo "plait: error: remote.sh: cannot create or write $OUTPUT_DIR/remote.lock (OUTPUT_DIR)" >&2
    exit 2
fi
"$PY" -c 'import fcntl, sys
try:
    fcntl.flock(9, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)' 2>/dev/null
if [ $? -eq 3 ]; then  # (any other failure: the installation check below says what is wrong)
    echo "plait: error: remote.sh: $OUTPUT_DIR is in use by another launcher ($(head -c 300 "$OUTPUT_DIR/remote.lock" 2>/dev/null)); one run folder has one launcher" >&2
    exit 2
fi
echo "pid $$ on $(hostname) since $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$OUTPUT_DIR/remote.lock"
LOG=${LOG:-$OUTPUT_DIR/remote.log}
if ! { : >>"$LOG"; } 2>/dev/null; then  # before anything is written to it: not mistaken for a bad configuration below
    echo "plait: error: remote.sh: cannot write the log file LOG=$LOG (its folder is missing or read-only, or the file is not writable); set LOG to a writable file" >&2
    exit 2
fi
# A log that opens but takes no bytes (a full disk; /dev/full) is a failed write, 74 as everywhere else, never retried.
log_full() {
    echo "plait: error: remote.sh: cannot write to the log file LOG=$LOG (${1:-write failed}; disk full?): free space or set LOG elsewhere, then start again" >&2
    exit 74
}
if ! log_err=$( { echo "[remote.sh $(date -u +%H:%M:%S)] launcher pid $$ on $(hostname)" >>"$LOG"; } 2>&1 ); then
    log_full "$(echo "$log_err" | sed -n 's/.*write error: //p' | head -n 1)"
fi
# Since when this launcher has held the machine, on the boot clock every process shares: the budget
# guard bills from then on, the back-offs and each attempt's start included.
if [ -r /proc/sys/kernel/random/boot_id ] && [ -r /proc/uptime ]; then
    export PLAIT_LAUNCHER_SINCE="$(cat /proc/sys/kernel/random/boot_id) $(cut -d' ' -f1 /proc/uptime)"
fi
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

log() { echo "[remote.sh $(date -u +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }

# A signal stops the run and is never followed by a restart. torchrun runs in a process group of its
# own (below), so a terminal's Ctrl-C reaches it once, forwarded from here; SIGHUP (the terminal
# closed) is forwarded as SIGTERM, the usual stop (the trainer takes SIGHUP as one too). A deliberate second
# Ctrl-C goes to the ranks themselves (torchrun would only wait on), as it does without this script.
stop_code=0
trainer=""
on_signal() {
    if [ "$stop_code" -eq 0 ]; then
        log "$1: stopping the run; it is not restarted"
        stop_code=$2
        if [ -n "$trainer" ]; then kill -s "$3" "$trainer" 2>/dev/null; fi
    elif [ "$1" = SIGINT ] && [ -n "$trainer" ]; then  # Ctrl-C again: to the ranks, which stop at once after 3 s
        pkill -INT -P "$trainer" 2>/dev/null
    fi
}
trap 'on_signal SIGINT 130 INT' INT
trap 'on_signal SIGTERM 143 TERM' TERM
trap 'on_signal SIGHUP 129 TERM' HUP
stopped() {  # a signal came: leave now, with 128 + its number
    if [ "$stop_code" -ne 0 ]; then log "stopped by a signal"; exit "$stop_code"; fi
}
# The trainer's output goes to the log through a tee that the signals stopping the run do not kill
# (its last lines are the stop and the checkpoint) and that a closed terminal does not end (-p).
TEE_P=()
if tee -p /dev/null </dev/null >/dev/null 2>&1; then TEE_P=(-p); fi
keep_log() { immune tee ${TEE_P[@]+"${TEE_P[@]}"} -a "$LOG"; }
# torchrun, in a group of its own, does not die with the launcher's group: it asks the kernel (Linux
# PR_SET_PDEATHSIG, kept across exec) for SIGTERM when this script dies, however it dies (SIGKILL too),
# so the ranks stop with a checkpoint instead of training on unsupervised.
WITH_LAUNCHER='import ctypes, os, signal, sys
parent = os.getppid()
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit(143)
os.execvp(sys.argv[1], sys.argv[1:])'

# 0. Numbers from the environment, checked before any shell arithmetic sees them: bash
#    evaluates an arithmetic operand such as 'x[$(cmd)]', running cmd.
bad_env() { log "plait: error: remote.sh: $1 = '$2': expected $3"; exit 2; }
INT_RE='^(0|[1-9][0-9]{0,17})$'
for name in SEQ_LEN GRAD_ACCUM TARGET_TOKENS N_LOOPS CKPT_EVERY NPROC MAX_RESTARTS BACKOFF_S; do
    value=${!name:-}
    if [ -n "$value" ] && ! [[ $value =~ $INT_RE ]]; then bad_env "$name" "$value" "a non-negative decimal integer"; fi
done
if [ -n "${MICRO_BATCH:-}" ] && ! [[ $MICRO_BATCH =~ $INT_RE || $MICRO_BATCH == auto ]]; then
    bad_env MICRO_BATCH "$MICRO_BATCH" "a non-negative decimal integer or auto"
fi

# 1. The installation, and what this node has. Its error (no torch, no plait, a plugin that fails to
# import) goes to the log whole and, its last line, into the one line that says what to do.
check_err=$(mktemp)
if ! info=$("$PY" - 2>"$check_err" <<'PY'
import importlib.metadata as md, torch
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda if cuda else 'none'}")
for i in range(torch.cuda.device_count()):
    cc = torch.cuda.get_device_capability(i)
    print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cc[0]}.{cc[1]}")
for dist in ("plait", "torchao"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} not installed")
import core.config.registry
core.config.registry.load()
print(f"gpus {torch.cuda.device_count()}")
PY
); then
    stopped
    cat "$check_err" >>"$LOG"
    why=$(grep -v '^[[:space:]]*$' "$check_err" | tail -n 1 | cut -c 1-300)
    rm -f "$check_err"
    log "plait: error: remote.sh: installation check with PYTHON=$PY failed (${why:-no output}): install plait for that interpreter (pip install -e .), or set PYTHON to the one it is installed for, e.g. PYTHON=.venv/bin/python"
    exit 2
fi
rm -f "$check_err"
echo "$info" | tee -a "$LOG"
GPUS=$(echo "$info" | awk '/^gpus /{print $2}')
[[ ${GPUS:-} =~ $INT_RE ]] || GPUS=0
if [ -z "${NPROC:-}" ]; then
    if [ "$GPUS" -gt 0 ]; then NPROC=$GPUS; else NPROC=2; fi
fi

# 2. Environment -> overrides.
args=("--config" "$CONFIG" "--train.output_dir=$OUTPUT_DIR")
[ -n "${PRECISION:-}" ] && args+=("--precision.name=$PRECISION")
[ -n "${SEQ_LEN:-}" ] && args+=("--data.seq_len=$SEQ_LEN")
[ -n "${MICRO_BATCH:-}" ] && args+=("--train.micro_batch=$MICRO_BATCH")
if [ -n "${GRAD_ACCUM:-}" ]; then
    if [ -z "${MICRO_BATCH:-}" ] || [ -z "${SEQ_LEN:-}" ] || [ "$MICRO_BATCH" = auto ]; then
        log "plait: error: remote.sh: GRAD_ACCUM needs a numeric MICRO_BATCH and SEQ_LEN too"; exit 2
    fi
    args+=("--train.global_batch_tokens=$((MICRO_BATCH * SEQ_LEN * NPROC * GRAD_ACCUM))")
fi
[ -n "${TARGET_TOKENS:-}" ] && args+=("--train.target_tokens=$TARGET_TOKENS" "--train.steps=0")
[ -n "${N_LOOPS:-}" ] && args+=("--model.n_loops=$N_LOOPS")
[ -n "${LR:-}" ] && args+=("--optimizer.lr=$LR")
[ -n "${CKPT_EVERY:-}" ] && args+=("--checkpoint.every=$CKPT_EVERY")
[ -n "${CKPT_DIR:-}" ] && args+=("--checkpoint.dir=$CKPT_DIR")
for arg in "$@"; do  # a --checkpoint.resume=... flag is RESUME: first attempt only
    case $arg in
        --checkpoint.resume=*) RESUME=${arg#--checkpoint.resume=} ;;
        *) args+=("$arg") ;;
    esac
done

# An explicit RESUME is for the first attempt; a restart resumes from the run's own latest checkpoint,
# all of it: checkpoint.exclude_from_loading shaped the first start (a fresh optimizer, a step count
# started over) and must not be applied to the run's own checkpoints again.
first_resume="--checkpoint.resume=${RESUME:-auto}"

# 3. Bad input is final: check it once, without a process group (core.plan runs every check that
#    core.train runs before building: options, data, the checkpoint to resume from, output folders).
"$PY" -m core.plan "${args[@]}" "$first_resume" --nproc "$NPROC" 2>&1 | tee -a "$LOG"
plan_codes=("${PIPESTATUS[@]}")
if [ "${plan_codes[1]}" -ne 0 ]; then stopped; log_full "tee could not append the plan"; fi
if [ "${plan_codes[0]}" -ne 0 ]; then
    stopped
    log "the run's configuration is invalid; not starting"
    exit 2
fi

# 4. Train; after a crash or a kill, resume from the last complete checkpoint.
attempt=0
stuck=0  # attempts in a row that ended without committing a checkpoint
saved=0  # an attempt has committed a checkpoint: restarts resume the run's own, with "auto"
while true; do
    rm -f "$OUTPUT_DIR/exit_status.json"
    before=$(committed_checkpoints "$OUTPUT_DIR/run_info.json")  # progress: a checkpoint committed that was not there
    # Until an attempt has committed a checkpoint, a restart starts as the first attempt did (RESUME and the exclusions
    # again): with "auto" a run started from another folder's checkpoint that crashed before its first save started over
    # at step 0. From then on the run's own newest checkpoint, whole.
    if [ "$saved" -eq 0 ]; then resume=("$first_resume"); else resume=("--checkpoint.resume=auto" "--checkpoint.exclude_from_loading=[]"); fi
    log "starting (attempt $((attempt + 1)), $NPROC processes, ${resume[0]#--})"
    log_lines=$(wc -l < "$LOG" 2>/dev/null || echo 0)
    stopped
    set -m  # the job (torchrun and its tee) in a process group of its own; $trainer leads it
    "$PY" -c "$WITH_LAUNCHER" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
        -m core.train "${args[@]}" "${resume[@]}" 2>&1 | keep_log &
    trainer=$(jobs -p %+)
    set +m
    if [ "$stop_code" -ne 0 ]; then kill -s TERM "$trainer" 2>/dev/null; fi  # a signal while it was starting
    wait_for_job "$trainer"  # sets $code
    trainer=""
    # A crash (exit_status.json reason "error", or none) or a stall ("stalled") is restarted; any other reason is final,
    # and so is a run folder another job holds or a checkpoint that could not be written, said in the log (trainer_end.sh).
    trainer_end "$OUTPUT_DIR/exit_status.json" "$LOG" "$((log_lines + 1))"
    if [ -n "$end_code" ] && [ -z "$end_note" ]; then
        if [ "$end_code" = 2 ]; then log "bad input found by the trainer; not retrying"; fi
        log "trainer finished with exit code $end_code"
        exit "$end_code"
    fi
    stopped  # the trainer died of the stop (a signal before it could save): no restart
    if [ -n "$end_code" ]; then
        log "$end_note"
        exit "$end_code"
    fi
    reached=$(newest_checkpoint "$OUTPUT_DIR/run_info.json")
    if [ -n "$(LC_ALL=C comm -13 <(printf '%s\n' "$before") <(committed_checkpoints "$OUTPUT_DIR/run_info.json"))" ]; then
        stuck=0 saved=1
    else
        stuck=$((stuck + 1))
    fi
    if [ "$stuck" -gt "$MAX_RESTARTS" ]; then
        log "trainer failed (code $code): $stuck attempts in a row committed no new checkpoint, and MAX_RESTARTS=$MAX_RESTARTS restarts are used up"
        exit 1
    fi
    wait_s=$BACKOFF_S  # doubled once per earlier restart in a row without progress, capped at 300 s before it can overflow
    for ((i = 1; i < stuck && wait_s < 300; i++)); do wait_s=$((wait_s * 2)); done
    [ "$wait_s" -gt 300 ] && wait_s=300
    if [ "$stuck" -eq 0 ]; then progress="it committed step $reached"; else progress="no new checkpoint, $stuck in a row"; fi
    log "trainer died (code $code; $progress); restarting in ${wait_s}s"
    sleep "$wait_s" &
    wait $!  # a signal cuts the back-off short
    kill $! 2>/dev/null
    stopped
    attempt=$((attempt + 1))
done
