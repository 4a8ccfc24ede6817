#!/usr/bin/env bash
# Transformer (big), WMT en-de: 8 GPUs per node, tensor parallelism inside the node
# (parallel.tp=4 in the config), ZeRO data parallelism across nodes.
#   sbatch slurm/train_big.sh --set data.path=/data/wmt14_en_de
#SBATCH --job-name=megaformer-big
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

CONFIG=${CONFIG:-configs/transformer_big.yaml}
# SLURM runs a copy of this script: the checkout is where it was submitted from.
[ -f "${SLURM_SUBMIT_DIR:-$PWD}/slurm/common.sh" ] || {
    echo "megaformer: ${SLURM_SUBMIT_DIR:-$PWD} is not a megaformer checkout: cd to it, then sbatch slurm/train_big.sh" >&2
    exit 2
}
# shellcheck source=slurm/common.sh
source "${SLURM_SUBMIT_DIR:-$PWD}/slurm/common.sh"
