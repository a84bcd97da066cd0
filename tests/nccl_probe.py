"""What only a GPU shows about NCCL's timeouts (issue 61), each case in a process of its own
(a timeout may end its process), on each NCCL engine this torch has; about a minute an engine:

    python3 tests/nccl_probe.py             (tests/gpu_lease.sh runs it; OUT=DIR for its files)
    python3 tests/nccl_probe.py --dry-run   (what it would run; any machine)

Each case is a one-process NCCL group on GPU 0 (default timeout 60 s) whose all-reduce waits
behind a GPU sleep (torch.cuda._sleep), and prints "probe:" lines with its figures; the
driver adds how the process ended and the lines it printed about a timeout. Written without a
GPU: not run yet.
"""
import os
import subprocess
import sys
import time
from datetime import timedelta

CASES = {
    "before": "an all-reduce queued behind an 8 s GPU sleep, then set_timeout(2 s): does the "
              "collective already queued keep its 60 s and complete?",
    "after": "set_timeout(2 s), then an all-reduce behind an 8 s GPU sleep: is it aborted, how "
             "many seconds after it was queued, and in what words?",
    "cost": "what one set_timeout call costs (10,000 calls)",
    "leave": "an all-reduce behind a 30 s GPU sleep, then launch.leave_group() and exit, as a "
             "failing rank does: does the process end within 5 s?",
    "recorder": "'after' with NCCL's flight recorder on (TORCH_FR_* and the older TORCH_NCCL_* "
                "names): does a timeout write its file?",
}
ENGINES = {"default": {}, "legacy": {"TORCH_DIST_USE_NCCL2": "0"}}  # torch 2.15: NCCL2 or not


def set_timeout(dist, seconds):  # as ddpkit.launch.set_timeout
    (getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout)(
        timedelta(seconds=seconds))


def case(name):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0))
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)  # the communicator made, outside the figures
    t = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    rate = 10**8 / (time.perf_counter() - t)  # sleep cycles a second

    def queued_behind(seconds):
        torch.cuda._sleep(int(rate * seconds))
        dist.all_reduce(x)
        print(f"probe: queued at {time.time():.3f}", flush=True)

    if name == "cost":
        t = time.perf_counter()
        for _ in range(10_000):
            set_timeout(dist, 60)
        print(f"probe: set_timeout {(time.perf_counter() - t) / 10_000 * 1e6:.1f} us a call")
    elif name == "before":
        queued_behind(8)
        set_timeout(dist, 2)
        torch.cuda.synchronize()
        x.item()
        print(f"probe: completed at {time.time():.3f}: the queued collective kept its timeout")
    elif name in ("after", "recorder"):
        set_timeout(dist, 2)
        queued_behind(8)
        torch.cuda.synchronize()
        x.item()
        print(f"probe: completed at {time.time():.3f}: the 2 s timeout did not end it")
    elif name == "leave":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from ddpkit import launch
        queued_behind(30)
        print(f"probe: leaving at {time.time():.3f}", flush=True)
        launch.leave_group()
        sys.exit(1)
    dist.destroy_process_group()


def drive(out):
    import torch.distributed as dist
    engines = ["default"] + ["legacy"] * hasattr(dist, "ProcessGroupNCCL2")
    for engine in engines:
        for name in CASES:
            env = {**os.environ, **ENGINES[engine], "PYTHONUNBUFFERED": "1"}
            prefix = os.path.join(out, f"fr-{engine}-")
            if name == "recorder":
                env.update(TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
                           TORCH_FR_DUMP_TEMP_FILE=prefix, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix,
                           TORCH_NCCL_DUMP_ON_TIMEOUT="1")
            start = time.time()
            try:
                p = subprocess.run([sys.executable, __file__, name], env=env, text=True,
                                   capture_output=True, timeout=45)
                code, text = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:  # (killed: its children too, if any)
                code, text = "killed at 45 s", (e.stdout or "") + (e.stderr or "")
                text = text if isinstance(text, str) else text.decode(errors="replace")
            end = time.time()
            lines = text.splitlines()
            marks = {ln.split()[1]: float(ln.split()[3].rstrip(":")) for ln in lines
                     if ln.startswith("probe: ") and ln.split()[2:3] == ["at"]}
            since = {k: f"{end - v:.1f} s after {k}" for k, v in marks.items()}
            print(f"[{engine}] {name}: exit {code}, {end - start:.1f} s in all; ended "
                  f"{', '.join(since.values()) or '-'}")
            for ln in lines:
                if ln.startswith("probe: ") and " at " not in ln or \
                        any(w in ln.lower() for w in ("timed out", "timeout", "watchdog", "abort")):
                    print(f"    {ln[:300]}")
            if code != 0 and lines:
                print(f"    last line: {lines[-1][:300]}")
            if name == "recorder":
                files = [f for f in os.listdir(out) if f.startswith(f"fr-{engine}-")]
                print(f"    flight recorder files: {files or 'none'}")
            sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--dry-run"]:
        for engine in ENGINES:
            for name, what in CASES.items():
                print(f"[{engine}] {name}: {what}")
    elif sys.argv[1:2] and sys.argv[1] in CASES:
        case(sys.argv[1])
    else:
        out = os.environ.get("OUT", "/tmp/gpu-lease")
        os.makedirs(out, exist_ok=True)
        drive(out)
