"""Replica groups on one machine (`scaletrain ft-local`): a Lighthouse and R groups, each an
ordinary `scaletrain train --nproc N` with fault_tolerance.enabled under its own elastic agent,
which restarts the group alone when it fails (max_restarts); run folders RUN_DIR/group<r>.

Every process of the job gets SIGTERM when the one that started it dies, even by SIGKILL, so
nothing outlives it; a group still running fault_tolerance.quorum_timeout_s after another finished the run is
stopped (`_wait`), since it waits for a quorum that cannot form.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scaletrain.console import PREFIX_ENV
from scaletrain.errors import LaunchError, TrainingStopped, UserError

# a group that ends so ends the job: a restart would repeat it (a refusal, a diverged run), and the other
# groups would wait for a quorum without it until their restarts ran out
FINAL_CODES = {UserError.exit_code: "a refusal of its input", TrainingStopped.exit_code: "training cannot go on"}


def run_replica_groups(config: str | None, extra: list[str], *, groups: int, nproc: int, max_restarts: int,
                       min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int,
                       rank_hook: str | None = None) -> int:
    """Run the groups to their end; the exit code: 0 when every group finished, else the first failure's.
    `extra`: config options as --section.key=value, given to every group."""
    from scaletrain.launch.job import train_config

    if groups < 1 or nproc < 1:
        raise LaunchError(f"--groups and --nproc must be at least 1, got {groups} and {nproc}")
    if min_replicas > groups:
        raise LaunchError(f"--min-replicas {min_replicas} is above --groups {groups}: no step could ever commit")
    from scaletrain.train.run_folder import default_run_dir

    base = [*(["--config", config] if config else []), *extra, *([f"--rank-hook={rank_hook}"] if rank_hook else [])]
    # the Lighthouse in its own process, as on a cluster: it can die alone (then every group stops, exit code 3)
    if min_replicas < 1:
        raise LaunchError(f"--min-replicas must be at least 1, got {min_replicas}")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info (the groups inherit it)
    server = _child([sys.executable, "-m", "scaletrain", "lighthouse", "--bind", "[::]:0",
                     f"--min-replicas={min_replicas}", f"--join-timeout-ms={join_timeout_ms}",
                     f"--heartbeat-timeout-ms={heartbeat_timeout_ms}"], stdout=subprocess.PIPE, text=True)
    first, launched = server.stdout.readline().split(), []
    if not first or first[0] != "lighthouse":
        server.wait()
        raise LaunchError(f"the Lighthouse did not start (exit code {server.returncode}); see the line above")
    address = first[1]
    try:
        ft = ["--fault_tolerance.enabled=true", f"--fault_tolerance.groups={groups}",
              f"--fault_tolerance.lighthouse={address}", f"--fault_tolerance.min_replicas={min_replicas}"]
        cfg, _ = train_config(config, [*extra, *ft])  # the config's problems before any group starts
        run_dir = Path(cfg.log.run_dir or default_run_dir())
        print(f"scaletrain: lighthouse {address}; {groups} group(s) of {nproc} rank(s) in {run_dir}/group*",
              file=sys.stderr, flush=True)
        for r in range(groups):
            command = [sys.executable, "-m", "scaletrain", "train", *base, "--nproc", str(nproc),
                       "--max-restarts", str(max_restarts), *ft, f"--fault_tolerance.replica_id={r}",
                       f"--log.run_dir={run_dir / f'group{r}'}"]
            launched.append(_child(command, start_new_session=True,  # a signal here reaches it from us
                                   env={**os.environ, PREFIX_ENV: f"[group {r}] "}))  # its lines name it
        return _wait(launched, cfg.fault_tolerance.quorum_timeout_s)
    finally:
        for g in launched:
            if g.poll() is None:
                g.kill()
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


def _child(command: list[str], **popen) -> subprocess.Popen:
    """A process of the job (the Lighthouse, a group's launcher) that gets SIGTERM when ft-local
    dies, even by SIGKILL (Linux's parent-death signal, set in the child before exec): nothing of the
    job outlives it. SIGTERM: a group saves a checkpoint and stops, the Lighthouse stops."""
    from scaletrain.interrupt import die_with_parent

    return subprocess.Popen(command, preexec_fn=functools.partial(die_with_parent, os.getpid()), **popen)


def _wait(groups: list[subprocess.Popen], grace_s: float) -> int:
    """Every group's exit; SIGINT/SIGTERM here is passed on to each (they save and stop). Once a group
    has finished the run, the others get `grace_s` (the quorum timeout) to finish too, then SIGTERM: a
    group that came back after its peers finished waits for a quorum that, with min_replicas > 1, can
    never form (and with 1, trains its last steps again alone). The run is the finished group's."""
    def forward(signum, frame):
        for g in groups:
            if g.poll() is None:
                g.send_signal(signum)

    handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    finished, stopped, final = None, set(), None
    try:
        while any(g.poll() is None for g in groups):
            time.sleep(0.2)
            if final is None and (final := _final_failure(groups)) is not None:
                r, code = final
                running = [s for s, g in enumerate(groups) if g.poll() is None]
                print(f"scaletrain: error: replica group {r} ended with exit code {code} ({FINAL_CODES[code]}: a "
                      f"restart would repeat it); the job ends with it, and group(s) "
                      f"{', '.join(map(str, running))} are stopped (each saves a checkpoint first)",
                      file=sys.stderr, flush=True)
                for s in running:
                    groups[s].terminate()
                    stopped.add(s)
            if finished is None:
                done = [r for r, g in enumerate(groups) if g.poll() == 0]
                finished = (done[0], time.monotonic()) if done else None
            elif time.monotonic() - finished[1] > grace_s:
                for r, g in enumerate(groups):
                    if g.poll() is None and r not in stopped:
                        print(f"scaletrain: replica group {r} is stopped: group {finished[0]} finished the run "
                              f"{grace_s:g} s ago (fault_tolerance.quorum_timeout_s) and group {r} has not; it "
                              "came back too late to share a quorum with it", file=sys.stderr, flush=True)
                        g.terminate()
                        stopped.add(r)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    codes = [g.returncode for g in groups]
    if final is None and (final := _final_failure(groups)) is not None:  # (the last group to end)
        print(f"scaletrain: error: replica group {final[0]} ended with exit code {final[1]} "
              f"({FINAL_CODES[final[1]]})", file=sys.stderr, flush=True)
        return final[1]
    if final is not None:
        return final[1]
    for r, code in enumerate(codes):
        if code and r not in stopped:
            print(f"scaletrain: error: replica group {r} ended with exit code {code}", file=sys.stderr, flush=True)
    return next((c for r, c in enumerate(codes) if c and r not in stopped), 0)


def _final_failure(groups: list[subprocess.Popen]) -> tuple[int, int] | None:
    """(group, its exit code) of the first group that ended with a code a restart would repeat."""
    return next(((r, g.returncode) for r, g in enumerate(groups) if g.returncode in FINAL_CODES), None)
