#!/usr/bin/env bash
# One device lease of at most 10 minutes (docs/maintainers.md#gpu-tests), what matters first:
# the machine and its torch; the one-GPU part of the `cuda` tests (4 pytest processes sharing
# the GPU) on each NCCL engine this torch has (torch 2.15 builds ProcessGroupNCCL2 unless
# TORCH_DIST_USE_NCCL2=0; older torch has one engine); then one full-MNIST run. From the
# repository's root on the GPU machine, whose python3 has torch and pytest (pytest-xdist and
# pytest-timeout are used where it has them):
#   MNIST=DIR (holding MNIST/raw) APEX_SRC=apex-25.05.tar.gz OUT=DIR bash tests/gpu_lease.sh
# Each log is written as it runs, so that a run stopped at its limit leaves what it did.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ python3 -c "import torch; print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nproc
} 2>&1 | tee "$OUT/machine.log"
engines="default"  # TORCH_DIST_USE_NCCL2 unset
if python3 -c "import torch.distributed as d; assert hasattr(d, 'ProcessGroupNCCL2')" 2>/dev/null; then
  engines="default legacy"  # and TORCH_DIST_USE_NCCL2=0: the engine torch 2.14 had
fi
opts=()  # the plugins this python3 has: 4 test processes sharing the GPU, a limit per test
python3 -c "import xdist" 2>/dev/null && opts+=(-n 4)
python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout 200)
for engine in $engines; do
  start=$(date +%s)
  # the legacy engine: the tests that run NCCL collectives, to keep the lease within 10 minutes
  ( subset=(); [ "$engine" = legacy ] && export TORCH_DIST_USE_NCCL2=0 \
        && subset=(-k "nccl or stalled or fsdp or stop or late or raises")
    python3 -m pytest -m cuda "${opts[@]}" -p no:cacheprovider -v -rfEP -o addopts="" \
        "${subset[@]}" tests ) 2>&1 | tee "$OUT/cuda-$engine.log"
  echo "cuda tests ($engine NCCL engine): $(( $(date +%s) - start )) s" | tee -a "$OUT/cuda-$engine.log"
done
if [ -n "${MNIST:-}" ]; then
  timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node=1 torchrun_ddp.py \
      --data-dir "$MNIST" 2>&1 | tee "$OUT/speed.log"
fi
