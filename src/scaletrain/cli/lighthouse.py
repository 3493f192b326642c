"""`scaletrain lighthouse`: torchft's Lighthouse, which forms each step's quorum of replica groups."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from scaletrain.errors import LaunchError


def add_parser(sub) -> None:
    p = sub.add_parser("lighthouse", help="the Lighthouse of a fault-tolerant job (torchft): forms each step's "
                                          "quorum of replica groups",
                       description="Start torchft's Lighthouse, print its address (give it to every group as "
                                   "--fault_tolerance.lighthouse) and serve until SIGINT or SIGTERM.")
    add_options(p)
    p.add_argument("--bind", default="[::]:29510", help="address:port to listen on (default [::]:29510; port 0: "
                                                         "any free port)")
    p.set_defaults(func=run, takes_overrides=False, parser=p)


def add_options(p) -> None:
    p.add_argument("--min-replicas", type=int, default=1,
                   help="replica groups a quorum needs (default 1); with fewer alive, the others wait")
    p.add_argument("--join-timeout-ms", type=int, default=1000,
                   help="how long a quorum waits for groups that have not asked yet (default 1000)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                   help="a group silent this long is dead to the quorum (default 5000)")


def start_lighthouse(bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int):
    """torchft's LighthouseServer (in this process, on its own threads); one line if torchft is missing."""
    if min_replicas < 1:
        raise LaunchError(f"--min-replicas must be at least 1, got {min_replicas}")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info (the groups inherit it)
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise LaunchError("the Lighthouse needs torchft, which is not installed: pip install 'scaletrain[ft]' "
                          "(torchft==0.2.0)") from None
    try:
        return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                heartbeat_timeout_ms=heartbeat_timeout_ms)
    except Exception as e:  # noqa: BLE001 - torchft raises a plain RuntimeError for a port in use
        raise LaunchError(f"the Lighthouse cannot listen on {bind} ({str(e).splitlines()[0][:200]}); give a free "
                          "port with --bind") from None


def run(args: argparse.Namespace, extra: list[str]) -> int:
    server = start_lighthouse(args.bind, args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms)
    # the handlers before the address line: whoever reads it may send SIGTERM at once. They only append to a
    # list: a handler runs in the main thread between two bytecodes, maybe while it holds a threading.Event's
    # lock inside its wait, where Event.set() would block on that lock forever
    stop: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    print(f"lighthouse {server.address()} (min_replicas {args.min_replicas}); give each group "
          f"--fault_tolerance.enabled=true --fault_tolerance.lighthouse={server.address()}", flush=True)
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        server.shutdown()
    try:
        print("lighthouse stopped", flush=True)
    except BrokenPipeError:  # whoever read our output is gone (ft-local killed): nobody to tell, nor at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
