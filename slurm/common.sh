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
# launcher/torchrun.py is torch's torchrun, ending on such a signal, or a failed rank, with a status and
# one line instead of a traceback.

set -euo pipefail
# A warning before srun has started (SLURM may send it a minute early, or preempt at once) would
# kill this shell: remember it, and pass it on once the tasks exist (below).
WARNED=0
trap 'WARNED=1' USR1

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

NPROC=--nproc
for arg in "$@"; do
    name=${arg%%=*}
    case "$name" in --n*) ;; *) continue ;; esac
    [ "${NPROC#"$name"}" != "$NPROC" ] || continue # --nproc, or a prefix argparse takes for it (--np ...)
    echo "megaformer: $arg: a job's processes are its SLURM tasks (--ntasks, --ntasks-per-node): drop --nproc" >&2
    exit 2
done
TRAIN=(-m megaformer.cli train --config "$CONFIG" --run-dir "$RUN_DIR" --resume auto "$@")
NNODES=${SLURM_JOB_NUM_NODES:-1}
case "$LAUNCHER" in
srun)
    WORLD=${SLURM_NTASKS:-$NNODES} # without --ntasks: one task per node, given to srun
    PLACED="1(x$NNODES)"
    [ -z "${SLURM_NTASKS:-}" ] || PLACED=${SLURM_TASKS_PER_NODE:-}
    case "${SLURM_DISTRIBUTION:-block}" in block*) ;; *) PLACED="" ;; esac # ranks numbered node by node, or unknown
    ;;
torchrun)
    # torchrun starts the same number of ranks on every node: the job's tasks per node, K(xNNODES).
    PLACED=${SLURM_TASKS_PER_NODE:-1(x$NNODES)}
    case "$PLACED" in
    *"(x$NNODES)") PER_NODE=${PLACED%%(*} ;;
    *[!0-9]*) PER_NODE="" ;;
    *) [ "$NNODES" != 1 ] || PER_NODE=$PLACED ;;
    esac
    if [ -z "${PER_NODE:-}" ]; then
        echo "megaformer: LAUNCHER=torchrun starts as many ranks on every node, and this job's tasks per node are $PLACED: give --ntasks-per-node" >&2
        exit 2
    fi
    WORLD=$((NNODES * PER_NODE))
    ;;
*)
    echo "megaformer: LAUNCHER=$LAUNCHER: use srun or torchrun" >&2
    exit 2
    ;;
esac
# Checked once, here, before any task starts (a fraction of a second: no torch): a bad config,
# layout (a TP group across nodes too) or data path, or a run directory another job trains into, is one line and exit 2, instead
# of a message from every rank and a job status that depends on which rank srun stopped first.
"$PYTHON" "${TRAIN[@]}" --check --nproc "$WORLD" ${PLACED:+--tasks-per-node "$PLACED"} || exit $?

case "$LAUNCHER" in
srun)
    # Each task ignores USR1 until the trainer handles it (an early warning must not kill a rank
    # that is still starting); the trap below repeats the warning until srun is done.
    # shellcheck disable=SC2016  # expanded by the task's shell
    srun --kill-on-bad-exit=1 --ntasks="$WORLD" --cpus-per-task="$CPUS" bash -c 'trap "" USR1; exec "$0" "$@"' "$PYTHON" "${TRAIN[@]}" &
    ;;
torchrun)
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}
    # torchrun handles USR1 only once its ranks run (an earlier one killed it): ignored until then.
    # shellcheck disable=SC2016  # expanded by the task's shell
    srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
        --cpus-per-task="$((CPUS * PER_NODE))" bash -c 'trap "" USR1; exec "$0" "$@"' \
        "$PYTHON" -m launcher.torchrun --nnodes "$NNODES" --nproc-per-node "$PER_NODE" \
        --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
        --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" --rdzv-endpoint "${NODES%%,*}:$((20000 + SLURM_JOB_ID % 20000))" \
        "${TRAIN[@]}" &
    ;;
esac
SRUN_PID=$!
STARTED=$SECONDS

# shellcheck disable=SC2329  # called from the traps below
forward() { kill -s "$1" "$SRUN_PID" 2>/dev/null || true; }
REPEATING=0
# shellcheck disable=SC2329
warn() {
    [ "$REPEATING" = 0 ] || return 0
    REPEATING=1
    # torchrun passes each warning on (and would treat a second one during its shutdown as another
    # signal): it gets one, from 20 s after its start, when it handles USR1 and its ranks hold it.
    # One whose rendezvous takes longer misses it: its ranks save at the time limit's SIGTERM.
    if [ "$LAUNCHER" = torchrun ]; then
        (sleep "$((STARTED + 20 > SECONDS ? STARTED + 20 - SECONDS : 0))" && forward USR1) &
        return 0
    fi
    forward USR1
    # SLURM may send the warning up to a minute early, while ranks are still starting (and
    # ignoring it): repeat it every 5 s until srun is done.
    (while sleep 5 && kill -0 "$SRUN_PID" 2>/dev/null; do forward USR1; done) &
}
trap warn USR1
# A warning kept from before srun started reaches it once srun handles signals (before, it kills srun).
[ "$WARNED" = 0 ] || (sleep 5 && kill -s USR1 $$) &
TERMED=0
trap 'TERMED=1; forward TERM' TERM

# `wait` returns early, with 128 + the signal, when a trapped signal arrives: keep waiting until srun
# is gone. If it ended just then, its status is still there for one more wait (127: taken already).
status=0
while kill -0 "$SRUN_PID" 2>/dev/null; do
    wait "$SRUN_PID" && status=0 || status=$?
done
last=0
wait "$SRUN_PID" 2>/dev/null || last=$?
[ "$last" = 127 ] || status=$last

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
