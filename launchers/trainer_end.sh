# Sourced by launchers/remote.sh, launchers/k8s/entrypoint.sh and launchers/slurm.sbatch (the image copies
# launchers/ whole): how an attempt of the trainer ended, the same way for every launcher. Needs $PY.

# immune CMD...: run CMD where the signals that stop a run cannot cut it short (TTOU: a terminal with tostop).
immune() { (trap '' INT TERM HUP TTOU; exec "$@"); }

# trainer_end STATUS_FILE LOG FIRST_LINE: sets
#   end_code    the exit code that ends the launcher, or "" when the attempt is to be restarted
#   end_reason  exit_status.json's reason ("" when it has none)
#   end_note    what the launcher says about a final end it found in LOG
# exit_status.json with the reason "error" (a crash) or "stalled" (the watchdog ended it) is restarted, as is a
# trainer that died without one (a pre-emption, SIGKILL, a lost node); any other reason is final, with its
# exit_code (0 done or stopped by a signal, 2 bad input, 3 diverged, 4 a monitor failed, 74 a save failed, 75/76
# budget). Without the file (or with a restarted one) the trainer's own lines in LOG (from line FIRST_LINE on) can still make the end final:
# a folder of the run held by another job (2: that folder's exit_status.json is the other job's), or a checkpoint, a
# run file or exit_status.json itself that could not be written (74: a restart would only fill the disk again).
trainer_end() {
    end_code="" end_reason="" end_note=""
    local status=""
    if [ -f "$1" ]; then  # "<exit code> <reason>"; unreadable: a crash
        status=$(immune "$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); print(int(s['exit_code']), s.get('reason', ''))" "$1" 2>/dev/null) ||
            status="1 error"
        end_reason=${status#* }
        case $end_reason in
            error | stalled) ;;
            *) end_code=${status%% *} && return 0 ;;
        esac
    fi
    local lines
    lines=$(tail -n +"$3" "$2" 2>/dev/null) || lines=""
    if grep -q "^plait: error: run folder .* is in use by" <<<"$lines"; then
        end_code=2 end_note="another job holds a run folder of this run; not restarting"
    elif grep -q -e "^plait: error: checkpoint save at step" -e "^plait: error: cannot write .* at start" \
        -e "^plait: error: cannot write .*exit_status.json at the end of the run" <<<"$lines"; then
        end_code=74 end_note="a checkpoint could not be written (disk full?); not restarting"
    fi
    return 0
}

# newest_checkpoint RUN_INFO: the newest committed checkpoint (a step_<9 digits> folder holding COMMITTED, as
# core/checkpoint/folders.py commits them) in the checkpoint folder that RUN_INFO (run_info.json, which rank 0 writes at
# each start) names; -1: none yet, or a folder that did not answer within 60 s (a hung mount).
newest_checkpoint() {
    immune timeout 60 "$PY" -c 'import json, os, re, sys
try:
    root = json.load(open(sys.argv[1]))["checkpoint_dir"]
    steps = [int(n[5:]) for n in os.listdir(root) if re.fullmatch(r"step_[0-9]{9}", n) and os.path.isfile(os.path.join(root, n, "COMMITTED"))]
except (OSError, ValueError, KeyError, TypeError):
    steps = []
print(max(steps, default=-1))' "$1" 2>/dev/null || echo -1
}

# committed_checkpoints RUN_INFO: each committed checkpoint in the checkpoint folder RUN_INFO names, one line each, sorted:
# its name and the inode and modification time of its COMMITTED file, so that a checkpoint committed anew under an old
# name (a save of a branch after a resume from an older checkpoint) differs from the one before; nothing for none yet,
# or a folder that did not answer within 60 s. An attempt committed a checkpoint when a line is new after it.
committed_checkpoints() {
    immune timeout 60 "$PY" -c 'import json, os, re, sys
try:
    root = json.load(open(sys.argv[1]))["checkpoint_dir"]
    names = [n for n in os.listdir(root) if re.fullmatch(r"step_[0-9]{9}", n)]
except (OSError, ValueError, KeyError, TypeError):
    names = []
for name in sorted(names):
    try:
        s = os.stat(os.path.join(root, name, "COMMITTED"))
    except OSError:
        continue
    print(name, s.st_ino, s.st_mtime_ns)' "$1" 2>/dev/null || true
}
