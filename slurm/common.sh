# shellcheck shell=bash
# Shared by train_big.sh, train_base.sh and train_tiny.sh; sourced, not run.
#
# One run directory per job: runs/<job name>-<job id>. A requeued job keeps its id, so
# `--resume auto` finds the checkpoint the previous attempt saved. `--signal=B:USR1@180`
# reaches only this batch shell: the trap passes it to srun, which passes it to every
# task; the trainer saves and requeues the job once. SIGTERM (scancel, or the time limit
# without a warning) is passed on the same way; the trainer saves and does not requeue.
#
# Variables (all optional): CONFIG, RUN_DIR, PYTHON (default .venv/bin/python),
# LAUNCHER (srun: one task per rank, the default; torchrun: srun starts one
# torchrun per node, which starts the node's ranks); arguments after the script name go to
# `megaformer train`, e.g. `sbatch slurm/train_big.sh --set data.path=/data/wmt14_en_de`.
#
# Threads: each task gets --cpus-per-task cores from srun (Slurm 22.05+ does not pass the job's
# value on to srun by itself) and OMP_NUM_THREADS is the same number, so no task oversubscribes.
#
# Under LAUNCHER=torchrun, torchrun sits between srun and the ranks. By default it does not handle
# USR1 and dies of it (its ranks then see their launcher gone, save and exit without requeueing):
# `--signals-to-handle ...SIGUSR1` makes it pass USR1 on, so the ranks save and requeue as under
# srun, and TORCH_ELASTIC_SHUTDOWN_TIMEOUT gives them time to save before it kills them.
# launcher/torchrun.py is torch's torchrun, ending on such a signal with a status instead of a traceback.

set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$PWD}"
: "${CONFIG:?set CONFIG to a megaformer config}"
: "${SLURM_JOB_ID:?run this script with sbatch}"
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-megaformer}-${SLURM_JOB_ID}}
PYTHON=${PYTHON:-.venv/bin/python}
command -v "$PYTHON" >/dev/null || {
    echo "megaformer: PYTHON=$PYTHON is not there: run \`make install\` in $PWD, or set PYTHON to megaformer's python" >&2
    exit 2
}
CPUS=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=$CPUS
LAUNCHER=${LAUNCHER:-srun}
NODES=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | paste -sd, || true)
echo "megaformer: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES:-1} node(s) [${NODES}], launcher ${LAUNCHER}, run dir ${RUN_DIR}"

TRAIN=(-m megaformer.cli train --config "$CONFIG" --run-dir "$RUN_DIR" --resume auto "$@")
case "$LAUNCHER" in
srun) WORLD=${SLURM_NTASKS:-${SLURM_JOB_NUM_NODES:-1}} ;; # without --ntasks: one task per node, given to srun
torchrun) WORLD=$((${SLURM_JOB_NUM_NODES:-1} * ${SLURM_NTASKS_PER_NODE:-1})) ;;
*)
    echo "megaformer: LAUNCHER=$LAUNCHER: use srun or torchrun" >&2
    exit 2
    ;;
esac
# Checked once, here, before any task starts (a fraction of a second: no torch): a bad config,
# layout or data path, or a run directory another job trains into, is one line and exit 2, instead
# of a message from every rank and a job status that depends on which rank srun stopped first.
"$PYTHON" "${TRAIN[@]}" --check --nproc "$WORLD" || exit $?

case "$LAUNCHER" in
srun)
    # Each task ignores USR1 until the trainer handles it (an early warning must not kill a rank
    # that is still starting); the trap below repeats the warning until srun is done.
    # shellcheck disable=SC2016  # expanded by the task's shell
    srun --kill-on-bad-exit=1 --ntasks="$WORLD" --cpus-per-task="$CPUS" bash -c 'trap "" USR1; exec "$0" "$@"' "$PYTHON" "${TRAIN[@]}" &
    ;;
torchrun)
    PER_NODE=${SLURM_NTASKS_PER_NODE:-1}
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}
    NNODES=${SLURM_JOB_NUM_NODES:-1}
    srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
        --cpus-per-task="$((CPUS * PER_NODE))" \
        "$PYTHON" -m launcher.torchrun --nnodes "$NNODES" --nproc-per-node "$PER_NODE" \
        --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
        --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" --rdzv-endpoint "${NODES%%,*}:$((20000 + SLURM_JOB_ID % 20000))" \
        "${TRAIN[@]}" &
    ;;
esac
SRUN_PID=$!

# shellcheck disable=SC2329  # called from the traps below
forward() { kill -s "$1" "$SRUN_PID" 2>/dev/null || true; }
REPEATING=0
# shellcheck disable=SC2329
warn() {
    forward USR1
    # SLURM may send the warning up to a minute early, while ranks are still starting (and
    # ignoring it): repeat it every 5 s until srun is done. torchrun passes each on (and would
    # treat a second one during its shutdown as another signal), so it gets one.
    if [ "$LAUNCHER" = srun ] && [ "$REPEATING" = 0 ]; then
        REPEATING=1
        (while sleep 5 && kill -0 "$SRUN_PID" 2>/dev/null; do forward USR1; done) &
    fi
}
trap warn USR1
TERMED=0
trap 'TERMED=1; forward TERM' TERM

# `wait` returns early when a trapped signal arrives: keep waiting until srun is gone.
status=0
while true; do
    wait "$SRUN_PID" && status=0 || status=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break
done

# shellcheck disable=SC2329
requeued() {
    local restarts
    restarts=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2)
    [ "${restarts:-0}" -gt "${SLURM_RESTART_COUNT:-0}" ]
}
# A requeued job (by the trainer on USR1, or by an operator) is ended by SLURM itself. Exiting first, with the status of the tasks
# the requeue terminated, races with the requeue: SLURM may record that exit as the job's end
# (FAILED) instead of starting it again. So wait, a bounded time, for SLURM to stop this attempt.
# SLURM ends the attempt with TERM, and with KILL KillWait seconds later (30 by default) if the
# batch shell is still there: leave at the TERM (it may have come while srun was ending), so that
# the requeued job's nodes are free, and it can start again, KillWait sooner.
if requeued; then
    echo "megaformer: job ${SLURM_JOB_ID} requeued; waiting for SLURM to end this attempt"
    trap 'exit "$status"' TERM
    [ "$TERMED" = 0 ] || exit "$status"
    for _ in $(seq 300); do sleep 1; done
fi
exit "$status"
