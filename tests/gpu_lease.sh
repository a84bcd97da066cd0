#!/usr/bin/env bash
# One device lease of at most 10 minutes on one GPU (docs/maintainers.md#gpu-tests), what
# matters first: the machine and its torch (the machine's own python3, not the project's pin);
# the `cuda` tests (4 pytest processes sharing the GPU; those needing two GPUs skip) on each
# NCCL engine this torch has (torch 2.15 builds ProcessGroupNCCL2 unless TORCH_DIST_USE_NCCL2=0;
# older torch has one engine), and tests/nccl_probe.py (about a minute an engine) after the
# default engine's. With FULL=1, for a lease that has time: real apex (APEX_SRC, a build of
# about a minute) and one full-MNIST run (MNIST). From the repository's root on the GPU
# machine, whose python3 has torch and pytest (pytest-xdist and pytest-timeout are used where
# it has them):
#   OUT=DIR bash tests/gpu_lease.sh
#   FULL=1 MNIST=DIR (holding MNIST/raw) APEX_SRC=apex-25.05.tar.gz OUT=DIR bash tests/gpu_lease.sh
# On a machine without a GPU it is a dry run: it lists what it would run, and exits 0.
# Each log is written as it runs, so that a run stopped at its limit leaves what it did.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -n "${FULL:-}" ] || unset APEX_SRC MNIST  # (test_real_apex builds apex where APEX_SRC is set)
if ! python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "no GPU here: a dry run. On a GPU: the machine, then these cuda tests on each engine:"
  python3 -m pytest -m cuda --collect-only -q -p no:cacheprovider -o addopts="" tests | grep ::
  echo "then tests/nccl_probe.py:"
  python3 tests/nccl_probe.py --dry-run
  echo "then, with FULL=1: real apex (APEX_SRC) in the cuda tests, and one full-MNIST run (MNIST)"
  exit 0
fi
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
  if [ "$engine" = default ]; then  # before the other engine's tests: the probe tries both
    python3 tests/nccl_probe.py 2>&1 | tee "$OUT/nccl-probe.log"
  fi
done
if [ -n "${MNIST:-}" ]; then
  timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node=1 torchrun_ddp.py \
      --data-dir "$MNIST" 2>&1 | tee "$OUT/speed.log"
fi
