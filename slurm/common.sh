# shellcheck shell=bash
# Shared by train_big.sh and train_base.sh; sourced, not run.
#
# One run directory per job: runs/<job name>-<job id>. A requeued job keeps its id, so
# `--resume auto` finds the checkpoint the previous attempt saved. `--signal=B:USR1@180`
# reaches only this batch shell: the trap passes it to srun, which passes it to every
# task; the trainer saves and requeues the job once. SIGTERM (scancel, or the time limit
# without a warning) is passed on the same way; the trainer saves and does not requeue.
#
# Variables (all optional): CONFIG, RUN_DIR, PYTHON (default .venv/bin/python),
# TORCH_EXTENSIONS_DIR; arguments after the script name go to `megaformer train`,
# e.g. `sbatch slurm/train_big.sh --set data.path=/data/wmt14_en_de`.

set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$PWD}"
: "${CONFIG:?set CONFIG to a megaformer config}"
: "${SLURM_JOB_ID:?run this script with sbatch}"
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-megaformer}-${SLURM_JOB_ID}}
PYTHON=${PYTHON:-.venv/bin/python}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
mkdir -p "$RUN_DIR"
echo "megaformer: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES:-1} node(s), run dir ${RUN_DIR}"

srun --kill-on-bad-exit=1 "$PYTHON" -m megaformer.cli train \
    --config "$CONFIG" --run-dir "$RUN_DIR" --resume auto "$@" &
SRUN_PID=$!

# shellcheck disable=SC2329  # called from the traps below
forward() { kill -s "$1" "$SRUN_PID" 2>/dev/null || true; }
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# `wait` returns early when a trapped signal arrives: keep waiting until srun is gone.
status=0
while true; do
    wait "$SRUN_PID" && status=0 || status=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break
done
exit "$status"
