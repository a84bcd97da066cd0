"""A real SLURM cluster on this machine, for tests that submit the shipped batch files.

Debian's slurmctld/slurmd 22.05 and munge, started by hand (no systemd):

    namespace "ctl"    the controller: slurmctld; also where sbatch/scontrol run (the login
                       node); holds the bridge, address 10.214.0.1
    namespace "node0"  slurmd, 10.214.0.11 \\  each in its own network, UTS (hostname) and
    namespace "node1"  slurmd, 10.214.0.12 /   mount namespace, joined to the bridge by a veth
    munged             one daemon with a key of its own; every daemon reaches it through its
                       socket file (unix sockets are not per network namespace)

Every link (bridge, veths) lives inside the namespaces made here, so nothing is added to the
host's own network and no traffic can leave the machine. Nodes resolve each other's names
through a hosts file bind-mounted over /etc/hosts in their mount namespace. Each node also
gets a "local disk": a directory of its own bind-mounted at the same path (`local_disk`) on
every node, to test `--save-on-each-node` the way nodes without a shared filesystem use it.
The rest of the filesystem is shared by all nodes, like a cluster's shared home.

The test cluster declares 16 CPUs and 4 GPUs per node (a count only, no devices:
`SlurmdParameters=config_overrides`), so that the batch files' requests are accepted
unchanged; the jobs' processes see the machine's real CPUs and no GPU.

Time limits and preemption: a requeued job may start again only after the credential
lifetime (BeginTime = the end of the run + cred_expire + 1 s; 120 s by default), and
pending jobs are looked at every sched_interval (60 s by default): the test cluster sets 5 s
and 1 s, so that a requeued job starts about 6 s after it stopped. Jobs run in the partition
"debug"; a job in "urgent" (higher PriorityTier) preempts them: SLURM sends SIGTERM to their
steps and gives them GraceTime (60 s) before it requeues them itself (PreemptMode=REQUEUE).

Facts this relies on, found on Debian 12 with slurm-wlm 22.05.8 and munge 0.5.15:
  - slurmd is started with `nsenter --net` + `unshare --uts --mount`, not `ip netns exec`:
    that one remounts /sys and slurmd then fails to initialise its cgroup plugin, even with
    proctrack/linuxproc and task/none;
  - slurmctld refuses to start unless its hostname is SlurmctldHost's, hence its own UTS
    namespace;
  - slurmd does not create its spool directory (SlurmdSpoolDir=.../%n);
  - munged wants its socket directory mode 755;
  - sinfo reports a dead slurmd as idle until SlurmdTimeout: liveness is checked by PID.
"""
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

SUBNET = "10.214.0"
CTL, NODES = "ctl", ("node0", "node1")
ADDR = {CTL: f"{SUBNET}.1", "node0": f"{SUBNET}.11", "node1": f"{SUBNET}.12"}
CPUS, GPUS = 16, 4  # what each test node declares (see the module docstring)
PARTITIONS = ("debug", "urgent")  # jobs run in debug; a job in urgent preempts them
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "munged", "ip",
            "nsenter", "unshare")

SLURM_CONF = """\
ClusterName=ddptest
SlurmctldHost={ctl_name}({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket.2,cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=5
SlurmdTimeout=30
SchedulerParameters=sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=node0 NodeAddr={node0} CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN
NodeName=node1 NodeAddr={node1} CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def why_not():
    """The reason this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "needs root (network, UTS and mount namespaces; daemons that run jobs)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (f"not installed: {', '.join(missing)} (Debian: apt-get install slurmctld slurmd "
                "slurm-client munge)")
    return None


def _run(*cmd, timeout=15, **kw):
    return subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=timeout,
                          **kw)


def _netns_inode(name):
    return os.stat(f"/run/netns/{name}").st_ino


class Cluster:
    def __init__(self, root):
        self.dir = Path(root)
        self.tag = uuid.uuid4().hex[:6]
        self.netns = {h: f"slurm{self.tag}{h}" for h in (CTL, *NODES)}
        self.conf = self.dir / "slurm.conf"
        self.local_disk = self.dir / "local"  # the same path on each node, a different disk
        self.disks = {n: self.dir / "disks" / n for n in NODES}  # ... seen from here
        self.daemons = {}  # name -> Popen
        self.made_netns = []

    # -- what tests use ---------------------------------------------------------------------

    def env(self, base=None):
        """An environment for slurm's client commands (sbatch exports it to the job)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client(self, *cmd, env=None, cwd=None, timeout=20):
        """A slurm command run on the login node (the controller's network namespace)."""
        return _run("nsenter", f"--net=/run/netns/{self.netns[CTL]}", *cmd,
                    env=self.env(env), cwd=cwd, timeout=timeout)

    def sbatch(self, script, *args, env=None, cwd=None):
        r = self.client("sbatch", "--parsable", script, *args, env=env, cwd=cwd)
        assert r.returncode == 0, f"sbatch failed: {r.stderr}{self.logs()}"
        return r.stdout.strip().split(";")[0]

    def job(self, job_id):
        """`scontrol show job` as a dict (KEY=VALUE fields)."""
        r = self.client("scontrol", "show", "job", "--oneliner", job_id)
        assert r.returncode == 0, r.stderr
        return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)

    def wait(self, job_id, timeout):
        """Wait for a job to end; the scontrol record of it. A job still running after
        `timeout` seconds is cancelled and the test fails."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in TERMINAL:
                return info
            self.check_alive()
            if time.monotonic() > deadline:
                self.client("scancel", job_id)
                pytest.fail(f"job {job_id} still {info['JobState']} after {timeout}s"
                            f"{self.logs()}")
            time.sleep(0.2)

    def check_alive(self):
        dead = {n: p.returncode for n, p in self.daemons.items() if p.poll() is not None}
        assert not dead, f"daemons exited: {dead}{self.logs()}"

    def logs(self, lines=15):
        """The tail of every daemon's log, for failure messages."""
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"\n--- {f.name}\n" + "\n".join(text))
        return "".join(out)

    # -- start -------------------------------------------------------------------------------

    def start(self):
        d = self.dir
        for sub in ("state", "run", "log", "munge", *(f"spool/{n}" for n in NODES)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for disk in (self.local_disk, *self.disks.values()):
            disk.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        os.chmod(d / "munge", 0o755)  # munged refuses a socket directory others cannot read
        self._network()
        self._munge()
        (d / "hosts").write_text("127.0.0.1 localhost\n" +
                                 "".join(f"{a} {h}\n" for h, a in ADDR.items()))
        (d / "dev").mkdir(exist_ok=True)  # stand-ins for /dev/nvidia*: slurmd wants
        for i in range(GPUS):                # character devices; these are /dev/null's (1, 3)
            os.mknod(d / "dev" / f"gpu{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (d / "gres.conf").write_text(f"Name=gpu File={d}/dev/gpu[0-{GPUS - 1}]\n")
        self.conf.write_text(SLURM_CONF.format(d=d, ctl_name=CTL, ctl_addr=ADDR[CTL], cpus=CPUS,
                                               gpus=GPUS, node0=ADDR["node0"],
                                               node1=ADDR["node1"]))
        self._daemon("slurmctld", CTL, f"exec slurmctld -D -f {self.conf}")
        for n in NODES:
            self._daemon(f"slurmd-{n}", n,
                         f"mount --bind {self.disks[n]} {self.local_disk} && "
                         f"exec slurmd -D -N {n} -f {self.conf}")
        self._wait_idle(timeout=30)

    def _network(self):
        def ip(*args):
            r = _run("ip", *args)
            if r.returncode != 0:
                raise _CannotRun(f"ip {' '.join(args)}: {r.stderr.strip()}")
        for ns in self.netns.values():
            ip("netns", "add", ns)
            self.made_netns.append(ns)
        ctl = self.netns[CTL]
        ip("-n", ctl, "link", "add", "br0", "type", "bridge")
        ip("-n", ctl, "addr", "add", f"{ADDR[CTL]}/24", "dev", "br0")
        ip("-n", ctl, "link", "set", "br0", "up")
        ip("-n", ctl, "link", "set", "lo", "up")
        for n in NODES:
            ip("-n", ctl, "link", "add", f"v{n}", "type", "veth", "peer", "name", "eth0",
               "netns", self.netns[n])
            ip("-n", ctl, "link", "set", f"v{n}", "master", "br0", "up")
            ip("-n", self.netns[n], "addr", "add", f"{ADDR[n]}/24", "dev", "eth0")
            ip("-n", self.netns[n], "link", "set", "eth0", "up")
            ip("-n", self.netns[n], "link", "set", "lo", "up")
        # own UTS + mount namespaces work here? (the daemons need both)
        r = _run("unshare", "--uts", "--mount", "true")
        if r.returncode != 0:
            raise _CannotRun(f"unshare --uts --mount: {r.stderr.strip()}")

    def _munge(self):
        m = self.dir / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        log = open(self.dir / "log" / "munged.stderr", "w")
        self.daemons["munged"] = subprocess.Popen(
            ["munged", "--foreground", f"--socket={m}/munge.socket.2", f"--key-file={key}",
             f"--pid-file={m}/munged.pid", f"--log-file={self.dir}/log/munged.log",
             f"--seed-file={m}/munged.seed"], stdout=log, stderr=log, start_new_session=True)
        self._until(lambda: (m / "munge.socket.2").exists(), 10, "munged's socket")

    def _daemon(self, name, host, command):
        """`command` in `host`'s network namespace and in new UTS + mount namespaces with
        the host's name and the cluster's /etc/hosts. nsenter (network only) and unshare
        (without --fork) exec, and so does sh: the PID we hold is the daemon's."""
        log = open(self.dir / "log" / f"{name}.stderr", "w")
        self.daemons[name] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns[host]}", "unshare", "--uts", "--mount",
             "sh", "-c", f"mount --bind {self.dir}/hosts /etc/hosts && hostname {host} && "
             f"{command}"], stdout=log, stderr=log, start_new_session=True)

    def _wait_idle(self, timeout):
        def idle():
            self.check_alive()  # a dead slurmd still shows as idle for SlurmdTimeout
            r = self.client("sinfo", "--noheader", "--Node", "--format=%N %T", timeout=10)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return r.returncode == 0 and all(states.get(n) == "idle" for n in NODES)
        self._until(idle, timeout, "two idle nodes")

    def _until(self, condition, timeout, what):
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}{self.logs()}")
            time.sleep(0.1)

    # -- stop --------------------------------------------------------------------------------

    def stop(self):
        """Cancel jobs, stop the daemons by PID, kill whatever still runs in our namespaces
        (job steps), delete the namespaces (and with them the bridge and veths)."""
        ctld = self.daemons.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            for partition in PARTITIONS:
                try:
                    self.client("scancel", "--full", f"--partition={partition}", timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    r = self.client("squeue", "--noheader", timeout=10)
                except subprocess.TimeoutExpired:
                    break
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.2)
        for name in [n for n in self.daemons if n != "munged"] + ["munged"]:
            p = self.daemons.get(name)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        self._kill_leftovers()
        for ns in self.made_netns:
            _run("ip", "netns", "del", ns)

    def _kill_leftovers(self):
        """SIGKILL every process still inside one of the network namespaces made here (job
        steps of a failed test): they can only have been started by this cluster."""
        inodes = set()
        for ns in self.made_netns:
            try:
                inodes.add(_netns_inode(ns))
            except OSError:
                pass
        for _ in range(50):
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                        found.append(int(pid))
                except OSError:
                    pass
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.1)


class _CannotRun(Exception):
    """This machine does not permit what the cluster needs: the tests skip."""


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = why_not()
    if reason:
        pytest.skip(f"SLURM test cluster: {reason}")
    cluster = Cluster(tempfile.mkdtemp(prefix="ddp-slurm-"))
    try:
        try:
            cluster.start()
        except _CannotRun as e:
            pytest.skip(f"SLURM test cluster: namespaces not permitted here: {e}")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.dir, ignore_errors=True)
