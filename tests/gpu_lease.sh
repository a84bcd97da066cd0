#!/usr/bin/env bash
# One device lease (docs/maintainers.md#gpu-tests): the machine, the one-GPU part of the
# `cuda` tests in 4 pytest processes sharing the GPU, and one full-MNIST run. From the
# repository's root on the GPU machine, whose python3 has torch, pytest, pytest-xdist and
# pytest-timeout:
#   MNIST=DIR (holding MNIST/raw) APEX_SRC=apex-25.05.tar.gz OUT=DIR bash tests/gpu_lease.sh
# Each log is written as it runs, so that a run stopped at its limit leaves what it did.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/machine.log"
start=$(date +%s)
python3 -m pytest -m cuda -n 4 -p no:cacheprovider -v -rfE --timeout 200 -o addopts="" tests \
    2>&1 | tee "$OUT/cuda.log"
echo "cuda tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/cuda.log"
if [ -n "${MNIST:-}" ]; then
  timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node=1 torchrun_ddp.py \
      --data-dir "$MNIST" 2>&1 | tee "$OUT/speed.log"
fi
