"""Two ranks on gloo sharing one device: `python tests/two_ranks_one_device.py DEVICE OUT`
(DEVICE: cpu, or cuda for one GPU, where NCCL refuses two ranks but gloo takes CUDA tensors).
Each rank trains common.Net under DDP for 3 steps on its own inputs, with a GradScaler and an
infinite gradient in rank 1 alone at step 2 (DDP_TEST_INF_GRAD_STEP and _RANK of the test
instrumentation, set by conftest.two_ranks_one_device), then runs the stop check (a SIGTERM
seen by rank 1 only) and reduce_tensor, and writes what it saw to OUT/rank{R}.json. On cuda the model's
BatchNorm is SyncBatchNorm (its gloo path) and the steps run under fp16 autocast; DDP does not
broadcast buffers, so equal statistics on both ranks come from SyncBatchNorm alone.
tests/test_cuda.py runs it on a GPU, tests/test_cluster_safety.py on the CPU."""
import inspect
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: E402
from ddpkit import sigterm  # noqa: E402


def rank_main(rank, device, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = common.Net()
    if cuda:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    quiet = {"forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
             else "broadcast_buffers": False}  # its name from torch 2.15 on
    ddp = DDP(model, device_ids=[device.index] if cuda else None, **quiet)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type)
    inputs = torch.randn(3, 16, 1, 28, 28, generator=torch.Generator().manual_seed(rank + 1))
    target = torch.randint(0, 10, (3, 16), generator=torch.Generator().manual_seed(rank + 1))
    scales = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
            loss = nn.functional.cross_entropy(ddp(inputs[step].to(device)),
                                               target[step].to(device))
        scaler.scale(loss).backward()  # DDP all-reduces over gloo: rank 1's inf reaches rank 0
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    stop = sigterm.StopSignal("unused.pt", device, steps=10)
    stop.received = rank == 1  # a SIGTERM that reached rank 1 alone
    stopped = stop(1)
    stop.close()
    mean = common.reduce_tensor(torch.tensor([float(rank)], device=device)).item()
    bn = next(m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "bn": type(bn).__name__, "scales": scales,
                   "weights": sum(p.double().sum().item() for p in model.parameters()),
                   "running_mean": bn.running_mean.tolist(), "stopped": stopped, "mean": mean}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    device, out = torch.device(sys.argv[1] if sys.argv[1] == "cpu" else "cuda:0"), sys.argv[2]
    mp.spawn(rank_main, (device, os.path.join(out, "store"), out), nprocs=2)
