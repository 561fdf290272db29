# Sourced by launchers/remote.sh and launchers/k8s/entrypoint.sh (the image copies launchers/ whole).
# wait_for_job PID: wait until the job PID (torchrun) has ended and set $code to its exit status. A trapped
# signal cuts `wait` short with 128 + its number while the job still runs (the trap forwarded the stop to it):
# wait again, so that the launcher reads the trainer's exit_status.json only once the trainer has written it.
wait_for_job() {
    wait "$1"
    code=$?
    while [ "$code" -gt 128 ] && kill -0 "$1" 2>/dev/null; do
        wait "$1"
        code=$?
    done
}
