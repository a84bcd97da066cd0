"""tests/instrument/sitecustomize.py's instrumentation that needs torch, imported once torch is
(sitecustomize.py's docstring says what each variable does)."""
import atexit
import io
import json
import os
import sys
import time

from sitecustomize import _global_rank

if os.environ.get("DDP_TEST_STEP_DELAY"):
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _delay = float(os.environ["DDP_TEST_STEP_DELAY"])
    register_optimizer_step_pre_hook(lambda *_: time.sleep(_delay))

if os.environ.get("DDP_TEST_THREAD_POOL"):  # a pool's idle worker, as a task's reader leaves one
    from concurrent.futures import ThreadPoolExecutor
    _pool = ThreadPoolExecutor(1, thread_name_prefix="task-pool")
    _pool.submit(int).result()

if os.environ.get("DDP_TEST_FAIL_SAVE"):
    import errno
    import torch
    _saves, _ok_save = [0], torch.save

    def _failing_save(obj, f, *args, **kwargs):
        _saves[0] += 1
        if _saves[0] == int(os.environ["DDP_TEST_FAIL_SAVE"]):
            raise OSError(errno.ENOSPC, "No space left on device")
        return _ok_save(obj, f, *args, **kwargs)
    torch.save = _failing_save

if os.environ.get("DDP_TEST_SLOW_SAVE"):
    import torch
    _slow, _fast_save = float(os.environ["DDP_TEST_SLOW_SAVE"]), torch.save

    def _slow_save(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        _fast_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        out = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f  # a path or a file
        out.write(data[:len(data) // 2])
        out.flush()
        time.sleep(_slow)
        out.write(data[len(data) // 2:])
        if out is not f:
            out.close()
    torch.save = _slow_save

if "DDP_TEST_CPU_FEATURES" in os.environ:
    import torch
    _real_capabilities = getattr(torch.cpu, "get_capabilities", dict)  # torch 2.4 has none

    def _capabilities():
        features = os.environ.get("DDP_TEST_CPU_FEATURES", "")
        if os.environ.get("DDP_TEST_CPU_FEATURES_OF"):
            rank, other = os.environ["DDP_TEST_CPU_FEATURES_OF"].split(":", 1)
            if _global_rank() == int(rank):
                features = other
        if features == "unknown":
            return {}  # what the scripts see where torch cannot tell (2.4: no such function)
        caps = dict(_real_capabilities())
        for item in filter(None, features.split(",")):
            name, value = item.split("=")
            caps[name.strip()] = bool(int(value))
        return caps
    torch.cpu.get_capabilities = _capabilities

if os.environ.get("DDP_TEST_ALLREDUCE_LOG"):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def _log_event(event):
        path = os.path.join(os.environ["DDP_TEST_ALLREDUCE_LOG"], f"allreduce-{os.getpid()}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"rank": dist.get_rank(), "event": event}) + "\n")

    def _counting_hook(state, bucket):
        _log_event("allreduce")
        return allreduce_hook(None, bucket)  # DDP's default: average over the default group

    _plain_ddp_init = DistributedDataParallel.__init__

    def _counting_ddp_init(self, *args, **kwargs):
        _plain_ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, _counting_hook)
    DistributedDataParallel.__init__ = _counting_ddp_init
    register_optimizer_step_pre_hook(lambda *_: _log_event("step") if dist.is_initialized() else None)

    # FSDP's gradient reduction: reduce_scatter_single on torch 2.15, reduce_scatter_tensor before
    _name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else \
        "reduce_scatter_tensor"
    _reduce_scatter = getattr(dist, _name)

    def _counting_reduce_scatter(*args, **kwargs):
        _log_event("reduce_scatter")
        return _reduce_scatter(*args, **kwargs)
    setattr(dist, _name, _counting_reduce_scatter)

    import torch
    import torch.nn.functional
    _plain_cross_entropy = torch.nn.functional.cross_entropy

    def _logged_cross_entropy(*args, **kwargs):  # a training loss: a micro-batch's forward
        loss = _plain_cross_entropy(*args, **kwargs)
        if torch.is_grad_enabled() and dist.is_initialized():
            _log_event("loss")
        return loss
    torch.nn.functional.cross_entropy = _logged_cross_entropy


if os.environ.get("DDP_TEST_STALL"):
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _stall_rank, _stall_step, _stall_s = os.environ["DDP_TEST_STALL"].split(":")
    _steps = [0]

    def _stall(*_):
        _steps[0] += 1
        if _steps[0] == int(_stall_step) and _global_rank() == int(_stall_rank):
            print(f"test instrumentation: rank {_stall_rank} sleeps {_stall_s} s before step "
                  f"{_stall_step} (pid {os.getpid()})", file=sys.stderr, flush=True)
            time.sleep(float(_stall_s))
    register_optimizer_step_pre_hook(_stall)

if os.environ.get("DDP_TEST_LATE"):
    import torch.distributed as dist
    _late_rank, _late_s = os.environ["DDP_TEST_LATE"].split(":")
    _punctual_init = dist.init_process_group

    def _late_init(*args, **kwargs):
        if int(kwargs.get("rank", os.environ.get("RANK", 0))) == int(_late_rank):
            print(f"test instrumentation: rank {_late_rank} sleeps {_late_s} s before "
                  f"init_process_group (pid {os.getpid()})", file=sys.stderr, flush=True)
            time.sleep(float(_late_s))
        return _punctual_init(*args, **kwargs)
    dist.init_process_group = _late_init

RECORD = os.environ.get("DDP_TEST_RECORD")
if RECORD:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    def _append(name, obj):
        with open(os.path.join(RECORD, f"{name}-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(obj) + "\n")

    _sampler_iter = DistributedSampler.__iter__

    def _recording_iter(self):
        indices = list(_sampler_iter(self))
        if self.shuffle:  # the training sampler
            _append("sampler", {"rank": self.rank, "epoch": self.epoch, "indices": indices})
        return iter(indices)
    DistributedSampler.__iter__ = _recording_iter
    from torch.utils.data import RandomSampler
    _random_iter = RandomSampler.__iter__

    def _recording_random_iter(self):  # dp_baseline.py's training sampler, in its one process
        indices = list(_random_iter(self))
        _append("sampler", {"rank": 0, "epoch": None, "indices": indices})
        return iter(indices)
    RandomSampler.__iter__ = _recording_random_iter

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def _record_lr(optimizer, args, kwargs):
        _append("lr", {"rank": dist.get_rank() if dist.is_initialized() else 0,
                       "lr": optimizer.param_groups[0]["lr"],
                       "deterministic": [torch.are_deterministic_algorithms_enabled(),
                                         torch.backends.cudnn.deterministic,
                                         torch.backends.cudnn.benchmark,
                                         os.environ.get("CUBLAS_WORKSPACE_CONFIG")]})
    register_optimizer_step_pre_hook(_record_lr)

    _save = torch.save

    def _recording_save(obj, f, *args, **kwargs):
        _append("save", {"pid": os.getpid(), "path": str(getattr(f, "name", f))})
        return _save(obj, f, *args, **kwargs)
    torch.save = _recording_save

    _load = torch.load

    def _recording_load(f, *args, **kwargs):
        _append("load", {"pid": os.getpid(), "path": str(getattr(f, "name", f)),
                         "map_location": str(kwargs.get("map_location")),
                         "mmap": bool(kwargs.get("mmap"))})
        return _load(f, *args, **kwargs)
    torch.load = _recording_load

    def _threads():
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended meanwhile
                pass
        return sorted(names)

    os.register_at_fork(before=lambda: _append("fork", {
        "pid": os.getpid(), "group": dist.is_initialized(), "threads": _threads()}))

    _new_group = dist.new_group

    def _recording_new_group(*args, **kwargs):
        _append("group", {"pid": os.getpid(), "backend": str(kwargs.get("backend"))})
        return _new_group(*args, **kwargs)
    dist.new_group = _recording_new_group

    _broadcast = dist.broadcast

    def _recording_broadcast(tensor, *args, **kwargs):
        _append("broadcast", {"rank": dist.get_rank(),
                              "bytes": tensor.numel() * tensor.element_size()})
        return _broadcast(tensor, *args, **kwargs)
    dist.broadcast = _recording_broadcast

    _all_reduce = dist.all_reduce

    def _recording_all_reduce(tensor, *args, **kwargs):
        _append("all_reduce", {"rank": dist.get_rank(), "shape": list(tensor.shape),
                               "dtype": str(tensor.dtype).replace("torch.", "")})
        return _all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = _recording_all_reduce

    _wrapped = []
    _ddp_init = DistributedDataParallel.__init__

    def _recording_init(self, module, *args, **kwargs):
        _wrapped.append(module)
        _ddp_init(self, module, *args, **kwargs)
    DistributedDataParallel.__init__ = _recording_init

    _destroy = dist.destroy_process_group

    def _recording_destroy(*args, **kwargs):
        if _wrapped and dist.is_initialized():
            _save(_wrapped[-1].state_dict(),
                  os.path.join(RECORD, f"final-rank{dist.get_rank()}.pt"))
        if dist.is_initialized():
            with open("/proc/self/maps") as f:
                fields = [line.split(maxsplit=5) for line in f]
            _append("maps", {"rank": dist.get_rank(), "files": sorted(
                {row[5].rstrip() for row in fields if len(row) == 6 and row[5].startswith("/")})})
        return _destroy(*args, **kwargs)
    dist.destroy_process_group = _recording_destroy

    import torch.nn.functional
    _ce = torch.nn.functional.cross_entropy

    def _recording_cross_entropy(output, target, *args, **kwargs):
        loss = _ce(output, target, *args, **kwargs)
        if torch.is_grad_enabled() and loss.numel() == 1:  # a training loss, not evaluation
            _append("loss", {"rank": dist.get_rank() if dist.is_initialized() else 0,
                             "loss": loss.item(), "n": len(target)})
        return loss
    torch.nn.functional.cross_entropy = _recording_cross_entropy

    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.module import register_module_forward_pre_hook

    def _record_evaluating_bn(module, _inputs):  # its statistics as a process evaluates with them
        if isinstance(module, _BatchNorm) and not module.training and dist.is_initialized():
            _append("bn", {"rank": dist.get_rank(), "features": module.num_features, "sums": [
                module.running_mean.sum().item(), module.running_var.sum().item()]})
    register_module_forward_pre_hook(_record_evaluating_bn)

    _init_pg = dist.init_process_group
    _ranks = []

    def _recording_init_pg(*args, **kwargs):
        _init_pg(*args, **kwargs)
        _ranks.append(dist.get_rank())
        store = kwargs.get("store")
        _append("init", {"rank": dist.get_rank(), "store_timeout":
                         store.timeout.total_seconds() if store is not None else None})
    dist.init_process_group = _recording_init_pg

    def _record_threads_at_exit(then="finalization", code=None):
        # atexit runs after the script has returned and before the interpreter tears down, where
        # a gloo thread still running can abort the process; os._exit ends it without that.
        # gloo's threads (named gloo_* / pt_gloo_*) are C++ threads, invisible to `threading`.
        if _ranks:
            _append("exit", {"rank": _ranks[-1], "threads": _threads(), "then": then,
                             "code": code})
    atexit.register(_record_threads_at_exit)
    _os_exit = os._exit

    def _recording_os_exit(code):
        _record_threads_at_exit("os._exit", code)
        _os_exit(code)
    os._exit = _recording_os_exit

    import signal
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _steps, _signal = [0], signal.signal  # optimizer steps begun in this process
    register_optimizer_step_pre_hook(lambda *_: _steps.__setitem__(0, _steps[0] + 1))

    def _recording_signal(signum, handler):  # sigterm.StopSignal's records when SIGTERM came
        if signum == signal.SIGTERM and type(getattr(handler, "__self__", None)).__name__ == \
                "StopSignal":
            def recording(*args, _handler=handler):
                _append("sigterm", {"rank": _global_rank(), "steps": _steps[0]})
                return _handler(*args)
            return _signal(signum, recording)
        return _signal(signum, handler)
    signal.signal = _recording_signal



# ---------------------------------------------------------------------------------------------
# GPU instrumentation (tests/test_cuda.py, tests/test_real_apex.py; the infinite gradient also
# serves tests/two_ranks_one_device.py on the CPU). Like the above, each part is off unless its
# variable is set, and changes nothing but what its line says:
#
#   DDP_TEST_INF_GRAD_STEP=N  the N-th training loss that F.cross_entropy computes in a process
#                             (counting only losses that build a graph) keeps its value but gets
#                             an infinite gradient: an fp16 overflow on a chosen step, which the
#                             GradScaler (or apex amp) must skip. One line on stderr says when.
#   DDP_TEST_INF_GRAD_RANK=R  ... only in the process of global rank R (default: in every one)
#   DDP_TEST_GPU_CAPABILITY_OF=RANK:MAJOR.MINOR
#                             in the process of global rank RANK (once the process group
#                             exists), torch.cuda.get_device_capability reports this compute
#                             capability: a job whose GPUs are of two generations
#   DDP_TEST_GPU_STALL=STEP:S before its STEP-th optimizer step, a process makes its GPU sleep
#                             about S seconds (torch.cuda._sleep on the current stream): every
#                             collective after it completes late, as behind a hung kernel. One
#                             line on stderr says when.
#   DDP_TEST_GPU_RECORD=DIR   at exit, each process appends to DIR/gpu-PID.jsonl: its rank and
#                             the CUDA device current at init_process_group (both None without a
#                             process group), torch's thread count; for every visible GPU whether this process holds a
#                             CUDA context there, and its peak allocated and reserved memory
#                             there; the classes of the modules whose forward ran, and each class
#                             with the dtype of its outputs ("torch.nn.modules.conv.Conv2d
#                             float16")

if os.environ.get("DDP_TEST_INF_GRAD_STEP"):
    import torch
    import torch.distributed as dist
    import torch.nn.functional

    _inf_step, _losses = int(os.environ["DDP_TEST_INF_GRAD_STEP"]), [0]
    _inf_rank = os.environ.get("DDP_TEST_INF_GRAD_RANK")
    _cross_entropy = torch.nn.functional.cross_entropy

    class _InfiniteGradient(torch.autograd.Function):
        """The identity forward; backward sends +inf to everything that produced the loss."""

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return torch.full_like(grad, float("inf"))

    def _overflowing_cross_entropy(*args, **kwargs):
        loss = _cross_entropy(*args, **kwargs)
        if not loss.requires_grad:  # evaluation, or under no_grad
            return loss
        _losses[0] += 1
        if _losses[0] != _inf_step:
            return loss
        if _inf_rank is not None and (not dist.is_initialized() or
                                      dist.get_rank() != int(_inf_rank)):
            return loss
        print(f"test instrumentation: infinite gradient for training loss {_inf_step} "
              f"(pid {os.getpid()})", file=sys.stderr, flush=True)
        return _InfiniteGradient.apply(loss)
    torch.nn.functional.cross_entropy = _overflowing_cross_entropy

if os.environ.get("DDP_TEST_GPU_STALL"):
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _gpu_stall_step, _gpu_stall_s = os.environ["DDP_TEST_GPU_STALL"].split(":")
    _gpu_steps = [0]

    def _gpu_stall(*_):
        _gpu_steps[0] += 1
        if _gpu_steps[0] == int(_gpu_stall_step):
            print(f"test instrumentation: the GPU sleeps {_gpu_stall_s} s before step "
                  f"{_gpu_stall_step} (pid {os.getpid()})", file=sys.stderr, flush=True)
            torch.cuda._sleep(int(float(_gpu_stall_s) * 2e9))  # cycles, at about 2 GHz
    register_optimizer_step_pre_hook(_gpu_stall)

if os.environ.get("DDP_TEST_GPU_CAPABILITY_OF"):
    import torch
    _cap_rank, _cap = os.environ["DDP_TEST_GPU_CAPABILITY_OF"].split(":")
    _real_capability = torch.cuda.get_device_capability

    def _capability(*args, **kwargs):
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_rank() == int(_cap_rank):
            return tuple(int(v) for v in _cap.split("."))
        return _real_capability(*args, **kwargs)
    torch.cuda.get_device_capability = _capability

GPU_RECORD = os.environ.get("DDP_TEST_GPU_RECORD")
if GPU_RECORD:
    import threading

    import torch
    import torch.distributed as dist
    from torch.nn.modules.module import register_module_forward_hook

    _gpu = {"rank": None, "device": None}
    _ran, _ran_lock = set(), threading.Lock()  # DataParallel runs its replicas in threads

    def _record_module(module, _inputs, output):
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        dtype = str(output.dtype).replace("torch.", "") if torch.is_tensor(output) else None
        with _ran_lock:
            _ran.add((name, dtype))
    register_module_forward_hook(_record_module)

    _gpu_init_pg = dist.init_process_group

    def _gpu_recording_init_pg(*args, **kwargs):
        _gpu_init_pg(*args, **kwargs)
        _gpu["rank"] = dist.get_rank()
        _gpu["device_id"] = str(kwargs.get("device_id"))  # what the group was bound to
        if torch.cuda.is_initialized():  # the scripts call set_device before this
            _gpu["device"] = torch.cuda.current_device()
    dist.init_process_group = _gpu_recording_init_pg

    def _record_gpus_at_exit():
        row = {"pid": os.getpid(), **_gpu, "threads": torch.get_num_threads(),
               "modules": sorted({n for n, _ in _ran}),
               "outputs": sorted(f"{n} {d}" for n, d in _ran if d),
               "cuda_initialized": False, "contexts": [], "max_allocated": [], "reserved": []}
        try:
            n = torch.cuda.device_count()
            # Asks the driver whether this process's primary context on each GPU is active (it
            # creates none). Contexts first, so that nothing below can add one unseen.
            row["contexts"] = [bool(torch._C._cuda_hasPrimaryContext(i)) for i in range(n)]
            if torch.cuda.is_initialized():  # otherwise nothing was allocated anywhere
                row["cuda_initialized"] = True
                row["max_allocated"] = [torch.cuda.max_memory_allocated(i) for i in range(n)]
                row["reserved"] = [torch.cuda.memory_reserved(i) for i in range(n)]
        except Exception as e:  # recorded, so that the test fails with the reason
            row["error"] = f"{type(e).__name__}: {e}"
        with open(os.path.join(GPU_RECORD, f"gpu-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    atexit.register(_record_gpus_at_exit)
