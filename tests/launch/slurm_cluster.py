"""A Slurm cluster of two "nodes" on this machine, for the tests of the Slurm lines in the docs.

Each node is a network namespace (its own address, 10.78.0.1 and .2, behind a bridge at .254 in
the machine's namespace) and a UTS namespace (its own hostname, node1 and node2), running its own
slurmd; the controller (slurmctld, hostname slurmctl) runs in the machine's network namespace, at
the bridge's address, so that sbatch, squeue and scancel from here reach it. Each node also has its
own mount namespace with the cluster's /etc/hosts bound over the machine's, so node1 and node2
resolve inside the nodes as on a real cluster. Processes started in a node (slurmstepd, the job's script, srun's
tasks, scaletrain's ranks) live in its namespaces: a node is killed by SIGKILLing every process in
its network namespace, and started again with `start_node`.

Needs root, munge, slurmctld, slurmd and the Slurm clients (Debian: apt-get install slurmctld slurmd
munge). Configured without cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none) and
with 8 CPUs and 8 placeholder GPUs (character devices like /dev/null) per node, so that a job script
written for GPU nodes is accepted as written; the ranks run on the CPU. A node that stops answering is
down after SlurmdTimeout (15 s), and a requeued job may start again cred_expire (10 s, not 120) after.

    python tests/launch/slurm_cluster.py start [STATE_DIR]    # prints the SLURM_CONF to export
    python tests/launch/slurm_cluster.py stop [STATE_DIR]
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

STATE = Path("/tmp/scaletrain-slurm")
NODES = {"node1": "10.78.0.1", "node2": "10.78.0.2"}
CONTROLLER, CONTROLLER_ADDR = "slurmctl", "10.78.0.254"
BRIDGE = "stslurm0"
PORTS = (16817, 16818)  # slurmctld, slurmd: not Slurm's defaults, so a system Slurm here is left alone
# the daemons, Slurm's clients the tests call, and the tools that make the nodes
NEEDED = ("slurmctld", "slurmd", "munged", "munge", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "ip", "unshare",
          "nsenter", "runuser")


def missing() -> str | None:
    """Why a cluster cannot start here (None when it can)."""
    if os.geteuid() != 0:
        return "starting slurmd and network namespaces needs root"
    absent = [d for d in NEEDED if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    return f"not installed: {', '.join(absent)}" if absent else None


def netns(node: str) -> str:
    return f"stslurm-{node}"


def conf_text(state: Path) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=8 Gres=gpu:8 State=UNKNOWN" for n, a in NODES.items())
    return f"""\
ClusterName=scaletrain-test
SlurmctldHost={CONTROLLER}({CONTROLLER_ADDR})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={PORTS[0]}
SlurmdPort={PORTS[1]}
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/%n/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/%n/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
GresTypes=gpu
ReturnToService=2
SlurmdTimeout=15
InactiveLimit=0
KillWait=60
MinJobAge=600
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")
    return r


def env(state: Path = STATE) -> dict:
    """This process's environment with SLURM_CONF pointing at the cluster (for sbatch, squeue, ...)."""
    return {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}


def _munge() -> None:
    if _sh("munge", "-n", check=False).returncode == 0:
        return  # a munged already answers
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    _sh("runuser", "-u", "munge", "--", "munged")
    _wait(lambda: _sh("munge", "-n", check=False).returncode == 0, 30, lambda: "munged did not answer")


def _network(state: Path) -> None:
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{CONTROLLER_ADDR}/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in {**NODES, CONTROLLER: CONTROLLER_ADDR}.items())
    (state / "hosts").write_text(hosts)
    for i, (node, addr) in enumerate(NODES.items()):
        ns, veth = netns(node), f"stsl{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", f"{veth}h", "type", "veth", "peer", "name", f"{veth}n")
        _sh("ip", "link", "set", f"{veth}h", "master", BRIDGE)
        _sh("ip", "link", "set", f"{veth}h", "up")
        _sh("ip", "link", "set", f"{veth}n", "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", f"{veth}n")
        _sh("ip", "-n", ns, "link", "set", f"{veth}n", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")


def start_node(node: str, state: Path = STATE) -> None:
    """slurmd of `node` in its namespaces (again, after kill_node: a node that comes back)."""
    (state / node / "spool").mkdir(parents=True, exist_ok=True)
    with open(state / node / "slurmd.out", "ab") as log:  # the child holds its own copy
        subprocess.Popen(on_node(node, "slurmd", "-D", "-N", node, "-f", str(state / "slurm.conf"), state=state),
                         stdout=log, stderr=log, start_new_session=True, env=env(state))
    log_file = state / node / "slurmd.log"
    _wait(lambda: node_state(node, state) in ("idle", "mixed", "allocated"), 120,
          lambda: f"{node} did not come up; the end of {log_file}:\n{_tail(log_file)}")


def on_node(node: str, *argv: str, state: Path = STATE) -> list[str]:
    """ARGV run on `node`: in its network namespace, under its hostname (torchft and the launcher tell
    their peers their host by name), with the cluster's /etc/hosts. nsenter, not `ip netns exec`:
    that one mounts a fresh /sys, without the cgroup tree slurmd reads."""
    script = f'hostname {node} && mount --bind "{state / "hosts"}" /etc/hosts && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{netns(node)}", "unshare", "--uts", "--mount", "sh", "-c", script, "sh",
            *argv]


def kill_node(node: str) -> list[int]:
    """SIGKILL every process in `node`'s network namespace (its slurmd, the jobs' steps and ranks):
    the node dies as a machine that loses power. Returns the pids killed."""
    pids = [int(p) for p in _sh("ip", "netns", "pids", netns(node), check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def node_state(node: str, state: Path = STATE) -> str:
    r = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True,
                       env=env(state))
    return r.stdout.strip().rstrip("*~#!%$@^-").lower() if r.returncode == 0 else ""


def start(state: Path = STATE) -> Path:
    """Write the config, start munge, the controller and both nodes; returns the slurm.conf path."""
    stop(state)  # what an earlier, interrupted run left
    (state / "ctld").mkdir(parents=True)
    (state / "slurm.conf").write_text(conf_text(state))
    # 8 placeholder GPUs a node: Slurm counts a GPU per device file, so each is a character device like /dev/null
    for i in range(8):
        os.mknod(state / f"gpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (state / "gres.conf").write_text(f"Name=gpu File={state}/gpu[0-7]\n")
    try:
        _start_daemons(state)
    except BaseException:
        stop(state, keep_logs=True)
        raise
    return state / "slurm.conf"


def _start_daemons(state: Path) -> None:
    _munge()
    _network(state)
    with open(state / "slurmctld.out", "ab") as log:
        subprocess.Popen(["unshare", "--uts", "sh", "-c", f'hostname {CONTROLLER} && exec slurmctld -D -i -f "$0"',
                          str(state / "slurm.conf")], stdout=log, stderr=log, start_new_session=True, env=env(state))
    _wait(lambda: subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=env(state)).stdout
          .count("UP") > 0, 60, lambda: f"slurmctld did not answer; the end of {state / 'slurmctld.log'}:\n"
          + _tail(state / "slurmctld.log"))
    for node in NODES:
        start_node(node, state)


def stop(state: Path = STATE, keep_logs: bool = False) -> None:
    """Stop every job, node and the controller, remove the namespaces, the bridge and the state
    (but the logs, with keep_logs)."""
    conf = state / "slurm.conf"
    if conf.exists():
        subprocess.run(["scancel", "--full", "--partition=debug"], capture_output=True, env=env(state))
    for node in NODES:
        kill_node(node)
        _sh("ip", "netns", "del", netns(node), check=False)
    pid = state / "slurmctld.pid"
    if pid.exists():
        try:
            os.kill(int(pid.read_text().split()[0]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _sh("ip", "link", "del", BRIDGE, check=False)
    if not keep_logs:
        shutil.rmtree(state, ignore_errors=True)


def _wait(ready, timeout: float, what) -> None:
    """Poll READY until it holds; past TIMEOUT seconds, raise with WHAT()."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(what())
        time.sleep(0.2)


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


if __name__ == "__main__":
    verb, where = sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else STATE
    if verb == "start":
        print(f"export SLURM_CONF={start(where)}")
    elif verb == "stop":
        stop(where)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} start|stop [STATE_DIR]")
