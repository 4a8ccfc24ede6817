#!/usr/bin/env bash
# The tiny config on CPUs with gloo: the sibling of train_big.sh for slurm/testcluster.sh (no GPU
# requests), same arguments and variables, same slurm/common.sh. Two nodes of two tasks:
# tensor parallelism (TP=2) inside each node, data parallelism across the nodes.
#   slurm/testcluster.sh exec sbatch slurm/train_tiny.sh --set data.path=runs/corpus
#SBATCH --job-name=megaformer-tiny
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=30
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

CONFIG=${CONFIG:-configs/tiny.yaml}
set -- --set parallel.tp=2 --set parallel.backend=gloo "$@" # the CPU sibling: gloo even where CUDA is visible; later --set arguments win
# SLURM runs a copy of this script: the checkout is where it was submitted from.
[ -f "${SLURM_SUBMIT_DIR:-$PWD}/slurm/common.sh" ] || {
    echo "megaformer: ${SLURM_SUBMIT_DIR:-$PWD} is not a megaformer checkout: cd to it, then sbatch slurm/train_tiny.sh" >&2
    exit 2
}
# shellcheck source=slurm/common.sh
source "${SLURM_SUBMIT_DIR:-$PWD}/slurm/common.sh"
