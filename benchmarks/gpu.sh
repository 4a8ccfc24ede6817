#!/usr/bin/env bash
# The GPU check, in one short call (under 5 minutes):
#   1. tensor-parallel parity with nccl when the machine has several GPUs
#      (TP = 2, or 4 with 4+ GPUs; transformer-big shape, dropout on);
#   2. transformer-big training throughput in bf16 on one GPU, with MFU against the
#      GPU's dense bf16 peak.
# Needs torch with CUDA, pyyaml and numpy (DeepSpeed is not needed here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "torch $("$PY" -c 'import torch; print(torch.__version__)'), ${ngpu} GPU(s)"

if [ "$ngpu" -ge 2 ]; then
    tp=2
    [ "$ngpu" -ge 4 ] && tp=4
    timeout 150 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$tp" -m megaformer.cli parity \
        --config configs/transformer_big.yaml --tp "$tp" --set data.vocab_size=37000 --batch 8 --src-len 32 --tgt-len 32
    timeout 150 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$tp" -m megaformer.cli parity \
        --config configs/transformer_big.yaml --tp "$tp" --sequence-parallel --set data.vocab_size=37000 \
        --batch 8 --src-len 32 --tgt-len 32
else
    echo "parity: skipped, nccl parity needs at least 2 GPUs (this machine has ${ngpu})"
fi

if [ "$ngpu" -ge 1 ]; then
    timeout 200 "$PY" benchmarks/gpu_throughput.py --config configs/transformer_big.yaml --dtype bf16 "$@"
else
    echo "throughput: skipped, no GPU"
fi
