"""Fault tolerance across replica groups, on torchft: the groups that are alive go on when one dies.

A fault-tolerant job is `fault_tolerance.groups` = R replica groups, each an ordinary run of its own
ranks (`scaletrain train`, one process or `--nproc N` with any layout inside: DDP, ZeRO-1/2/3, HSDP,
tp, pp, cp, ep; every group the same), started with its `fault_tolerance.replica_id`, and a Lighthouse
(`scaletrain lighthouse`) that forms a quorum of the groups alive at every step. Each rank of a
group has a torchft Manager, and torchft pairs rank i of every group with rank i of the others
(their all-reduce; a healing rank fetches from its counterpart): in groups of one layout the two
hold the same shard, stage or copy, so everything below works on each rank's LOCAL tensors (a
DTensor's local shard). The group's step goes through this module's `ReplicaGroups` step hook:

    begin_step        join the step's quorum (synchronous: a group behind the quorum's newest step
                      heals here, from a live peer, before its forward)
    reduce_gradients  after the group's own reductions (the data-parallel engine's in backward or
                      finish_gradients, then the other hooks': cp, tp K/V copies, a tied embedding;
                      this hook comes last): each rank's local gradients averaged over the groups in
                      the quorum (torchft's fault-tolerant all-reduce, on a gloo group it reconfigures
                      when the membership changes), before the norm and the clipping; a mixture's
                      expert load counts summed over them (its routing biases then move as for the
                      joint batch, in MoEBalance after the step)
    agree_to_skip     the commit vote, agreed by every rank of a group (torchft's should_commit):
                      a step whose all-reduce failed (a group died in it) is not committed, and the
                      optimizer does not step in any group that saw the failure

With parallel.sync.mode = local_sgd | diloco (dp_replicate = 1; DDP or ZeRO-1/2 inside each group,
scaletrain.ft_checks) the groups are the workers of local SGD / DiLoCo instead: `ReplicaGroupsOuter`
joins a quorum per window of sync.every steps, averages the pseudo-gradient over it at the window's
end and discards a window the vote does not commit.

Batch and learning rate: each group reads its own share of every step's windows (group r of R
reads what data-parallel rank r of a run with dp_replicate=R reads), so train.global_batch is one
group's batch, and the job's batch is (groups alive) × train.global_batch: it shrinks while a group
is down. Each group's gradient is the mean over its own tokens and the groups' gradients are
averaged, so the learning rate stays as configured (not scaled with the groups alive). With every
group alive the step equals a DDP step of R × train.global_batch over dp_replicate=R ranks.

Healing: a group that comes back (its supervisor restarts it, from its newest checkpoint or from
nothing) joins the quorum before its first step; torchft sees it behind the newest step and each
rank fetches, over HTTP from its counterpart in a live peer, the state this hook hands out: its
local weights the optimizer steps, its local optimizer state (copied into this group's own state
tensors, which keep their mesh), the run's step (the data position and the learning rate follow
from it), the fp16 loss scale and a mixture's routing biases; then `refresh` rebuilds what the
model computes with (bf16 weights from fp32 masters, ZeRO-1/2's gathered replicas, fp8 scales).
The step counted by torchft is the committed steps; a step nobody committed is a skipped step of
the run (weights untouched, the data moves on) in every group alike.

Checkpoints: written by the lowest replica id in the step's quorum only (`writes_checkpoint`:
every rank of a group has the same answer, so the group's ranks save together); after a restart
of everything, the groups resume their newest checkpoint and heal from whichever
holds the newest step.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlsplit

import torch
from torch import nn
from torch.distributed import ReduceOp

from scaletrain.errors import ConfigError, QuorumNotFormed, TrainingStopped
from scaletrain.hooks import Named, OuterLoop
from scaletrain.interrupt import StopWaiting
from scaletrain.optim import init_optimizer_state
from scaletrain.parallel.moe_balance import MoEBalance

WAIT_NOTE_S = 2.0  # a quorum slower than this is a wait for groups (a split, or a group restarting): said once
VOTE_MARGIN_S = 10.0  # the commit vote's wait beyond two step timeouts (ranks of a group reach it apart)


def replica_name(replica_id: int, fingerprint: str = "") -> str:
    """The group's name at the Lighthouse: the fingerprint of its settings (`settings_fingerprint`), then
    its id zero-padded (torchft orders the quorum by the name's trailing digits: the ids' order)."""
    return f"{fingerprint}-group{replica_id:04d}" if fingerprint else f"group{replica_id:04d}"


# What every replica group of a job must run alike, by kind: a group that differs would be averaged with the
# others (another learning rate, another head count of the same shapes) or crash the groups' collectives
# (another model shape). Each kind is 4 hex digits of the group's name at the Lighthouse.
FINGERPRINTED = (
    ("model", "model (model.*)"),
    ("optim", "optimizer and learning-rate schedule (optim.*)"),
    ("precision", "precision (precision.*; the fp16 loss scale's start aside: a healed group takes its peer's)"),
    ("train", "steps, global batch, seed or batch ramp (train.steps, global_batch, seed, batch_rampup)"),
    ("data", "windows (data.seq_len, loss_mask, document_mask)"),
    ("layout", "layout inside each group (parallel.*, the batch triad, memory.*)"),
)
_PATHS = ("init_from", "from_hf", "preset")  # where the model came from: the same model from another folder


def settings_fingerprint(cfg, layout) -> str:
    """4 hex digits of each FINGERPRINTED kind of `cfg`'s (a JobConfig) settings and its `layout`."""
    import hashlib
    import json

    d = cfg.to_dict()
    parts = {"model": {k: v for k, v in d["model"].items() if k not in _PATHS}, "optim": d["optim"],
             "precision": {k: v for k, v in d["precision"].items() if k != "init_scale"},
             "train": {k: d["train"][k] for k in ("steps", "global_batch", "seed", "batch_rampup")},
             "data": {k: d["data"][k] for k in ("seq_len", "loss_mask", "document_mask")},
             "layout": layout.to_dict()}
    return "".join(hashlib.sha256(json.dumps(parts[kind], sort_keys=True, default=str).encode()).hexdigest()[:4]
                   for kind, _ in FINGERPRINTED)


def disagreement(replica_id: int, replica_ids: list[str]) -> str | None:
    """Why group `replica_id` must not train in a quorum of `replica_ids` (torchft's "NAME:uuid", NAME
    from `replica_name`): the kinds of settings where its fingerprint differs from the quorum's majority
    (a tie: the lowest id's among the most common), in one line; None when it agrees."""
    prints = {}
    for rid in replica_ids:
        fingerprint, _, gid = rid.split(":")[0].rpartition("-group")
        if gid.isdigit():
            prints[int(gid)] = fingerprint
    if replica_id not in prints or len(set(prints.values())) <= 1:
        return None
    differs, others = [], set()
    for i, (_, what) in enumerate(FINGERPRINTED):
        part = {g: fp[4 * i:4 * i + 4] for g, fp in prints.items()}
        count = {v: sum(1 for w in part.values() if w == v) for v in part.values()}
        most = max(count.values())
        reference = part[min(g for g, v in part.items() if count[v] == most)]
        if part[replica_id] != reference:
            differs.append(what)
            others |= {g for g, v in part.items() if v == reference}
    if not differs:
        return None
    return (f"replica group {replica_id} runs another {' and another '.join(differs)} than group(s) "
            f"{', '.join(map(str, sorted(others)))} of its quorum, so it would be averaged with them (or break their "
            "collectives): every replica group of a job must run the same settings; start it with theirs")


class _CheckedQuorum:
    """torchft's client of the group's Manager, each quorum checked (`check(replica_ids)`) as soon as it
    is known, before a peer's state heals this group: the group refuses once the quorum is formed (its
    process groups configured with the others'), before any collective between the groups, so that the
    others lose one uncommitted step, as to any group that fails, not their collectives' configuration."""

    def __init__(self, client, check: Callable[[list[str]], None]):
        self._client, self._check = client, check

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        self._check(list(quorum.replica_ids))
        return quorum

    def __getattr__(self, name):
        return getattr(self._client, name)


def lighthouse_problem(address: str, timeout_s: float) -> str | None:
    """None once the Lighthouse at `address` (http://HOST:PORT) accepts a connection, else one line
    saying why, after trying for `timeout_s` seconds."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        return f"fault_tolerance.lighthouse={address!r} is not http://HOST:PORT; give the address `scaletrain " \
               "lighthouse` prints"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return None
        except OSError as e:
            if time.monotonic() >= deadline:
                return (f"the Lighthouse at {address} is unreachable after fault_tolerance.quorum_timeout_s="
                        f"{timeout_s:g} s ({e.strerror or e}); start it with `scaletrain lighthouse`, or fix "
                        "fault_tolerance.lighthouse")
            time.sleep(0.2)


def _timed_out(e: BaseException) -> bool:
    """Whether torchft's quorum request failed by running out of time (not another failure)."""
    return isinstance(e, TimeoutError) or "timeout expired" in str(e).lower() or "timed out" in str(e).lower()


def quorum_status(address: str) -> tuple[int, int] | None:
    """(groups in the Lighthouse's next quorum, groups it needs), read from its status page (torchft's
    dashboard: "only have N participants, need min_replicas M"); None when it cannot be read."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=2) as r:
            text = r.read(65536).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    m = re.search(r"have (\d+) participants, need min_replicas (\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


class ReplicaGroups(OuterLoop):
    """One rank's part in the replica groups' step (see the module's docstring)."""

    phase = "the replica groups' gradient all-reduce (torchft)"
    key = "fault_tolerance"

    def __init__(self, manager, named: Named, optimizer: torch.optim.Optimizer, state, refresh: Callable[[], None],
                 *, replica_id: int, groups: int, min_replicas: int, quorum_timeout_s: float, rank: int,
                 lighthouse: str, step_timeout_s: float, scaler=None):  # every one from for_run: no defaults
        self.manager = manager
        # the commit vote waits for every rank of the group, and a rank may reach it a whole step timeout
        # late (stuck in the groups' all-reduce with a rank killed inside it, until the collective times
        # out): the vote waits longer than that, or a group nobody killed fails its vote and restarts
        self.vote_timeout = timedelta(seconds=2 * step_timeout_s + VOTE_MARGIN_S)
        self.scaler = scaler  # fp16's loss scaler: a healed group takes the peer's scale with its weights
        self.lighthouse = lighthouse
        self.min_replicas, self.quorum_timeout_s, self.rank = min_replicas, quorum_timeout_s, rank
        self.named, self.optimizer, self.state, self.refresh = list(named), optimizer, state, refresh
        self.replica_id, self.groups = replica_id, groups
        self.data_outer = (replica_id, groups)  # this group's share of every step's windows
        self.joined = False  # the first step's quorum was joined before the loop (start)
        self.committed = True
        self.participants = 0
        self.writer = True  # whether this group writes the checkpoints (the lowest id in its last quorum)
        self.uncommitted = 0  # steps of this run not committed (a group died in them)
        self.healed = 0  # times this group took its state from a peer
        self.moe: dict[str, nn.Module] = {}  # the MoE layers whose routing biases the groups move together
        # why this group's settings differ from its quorum's (settings_fingerprint), or None: it is refused
        self.disagreement: Callable[[], str | None] = lambda: None
        self.fingerprint = ""  # this group's settings_fingerprint: a peer's state is taken only when they agree
        manager.register_state_dict_fn("scaletrain", self._load_peer_state, self._peer_state)

    @classmethod
    def for_run(cls, cfg, rt, named: Named, optimizer, state, refresh: Callable[[], None],
                scaler=None, hooks=()) -> ReplicaGroups | None:
        """The hook of a run (`cfg`, its JobConfig) with fault_tolerance.enabled (else None): checks that
        torchft is there and the Lighthouse answers, then starts this rank's Manager (rank 0's serves
        the group)."""
        ft = cfg.fault_tolerance
        if not ft.enabled:
            return None
        import logging

        # its per-step lines, and the tracebacks of the failures it recovers from (a group gone in a collective):
        # those are ours to report, in one line (the step's skip reason), as the vote's verdict
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        _quiet_healing_transfers()
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise ConfigError("fault_tolerance.enabled needs torchft, which is not installed: "
                              "pip install 'scaletrain[ft]' (torchft==0.2.0)") from None
        from torch.distributed import TCPStore

        problem = lighthouse_problem(ft.lighthouse, ft.quorum_timeout_s) if rt.rank == 0 else None
        if problem := rt.shared(problem):
            raise ConfigError(problem)
        # the group's own store for torchft's process groups: rank 0 serves it, the others learn its port.
        # Other groups reach it (and this group's Manager) by this host's name, or by loopback when the
        # Lighthouse is on loopback (every group on this machine)
        host = "127.0.0.1" if _loopback(ft.lighthouse) else socket.gethostname()
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False) if rt.rank == 0 else None
        port = rt.shared(store.port if store is not None else None)
        step_timeout = timedelta(seconds=ft.step_timeout_s)
        fingerprint = settings_fingerprint(cfg, rt.layout)
        manager = Manager(pg=ProcessGroupGloo(timeout=step_timeout), load_state_dict=None, state_dict=None,
                          min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=step_timeout,
                          quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                          connect_timeout=timedelta(seconds=ft.quorum_timeout_s), rank=rt.rank,
                          world_size=rt.world_size, store_addr=host, store_port=port,
                          lighthouse_addr=ft.lighthouse,
                          replica_id=replica_name(ft.replica_id, fingerprint),
                          hostname=host, init_sync=False)  # weights start equal: seeded by name

        said: list[str | None] = [None]  # the quorum's disagreement, raised once the quorum is formed

        def check(replica_ids: list[str]) -> None:  # groups that disagree are refused, not averaged
            said[0] = disagreement(ft.replica_id, replica_ids)

        manager._client = _CheckedQuorum(manager._client, check)
        # local SGD / DiLoCo: the groups are the workers
        kind = cls if cfg.parallel.sync.mode == "step" else ReplicaGroupsOuter
        hook = kind(manager, named, optimizer, state, refresh, replica_id=ft.replica_id, groups=ft.groups,
                    min_replicas=ft.min_replicas, quorum_timeout_s=ft.quorum_timeout_s, rank=rt.rank,
                    lighthouse=ft.lighthouse, scaler=scaler, step_timeout_s=ft.step_timeout_s)
        if kind is not cls:
            hook.set_outer(cfg.parallel.sync)
        elif balance := next((h for h in hooks if isinstance(h, MoEBalance)), None):
            hook.moe = balance.layers  # their load counts summed over the groups, their biases healed
        hook.store = store  # kept alive with the hook
        hook.disagreement, hook.fingerprint = (lambda: said[0]), fingerprint
        return hook

    # ---- what a healing peer receives ---------------------------------------------------------

    def _peer_state(self) -> dict:
        # this rank's local tensors only (a DTensor's shard: its mesh means nothing in another group);
        # the healing rank is the same rank of a group of the same layout, so it holds the same shards
        return {"params": {n: _local(p) for n, p in self.named}, "optim": _local_optimizer_state(self.optimizer),
                "step": self.state.step, "skipped_steps": self.state.skipped_steps,
                "early_loss": self.state.early_loss, "scaler": self.scaler.state_dict() if self.scaler else None,
                "moe_bias": {n: m.expert_bias for n, m in self.moe.items()}, "fingerprint": self.fingerprint}

    def _load_peer_state(self, peer: dict) -> None:
        if self.disagreement() is not None:  # another model's state: not taken (the group is refused next)
            return
        if peer.get("fingerprint") != self.fingerprint:  # the peer is the odd one (refused at this quorum)
            raise RuntimeError(f"replica group {self.replica_id} was to take the run's state from a peer whose "
                               "settings differ from its own (that group is refused at this quorum); it takes "
                               "nothing from it and restarts, to heal from a group that agrees")
        with torch.no_grad():
            for n, p in self.named:
                _local(p).copy_(peer["params"][n])
            for n, m in self.moe.items():
                m.expert_bias.copy_(peer["moe_bias"][n])
        _load_local_optimizer_state(self.optimizer, peer["optim"])
        self.state.step, self.state.skipped_steps = int(peer["step"]), int(peer["skipped_steps"])
        self.state.early_loss = peer["early_loss"]
        if self.scaler is not None:
            self.scaler.load_state_dict(peer["scaler"])
        self.refresh()  # what the model computes with (ZeRO-1/2: the shards gathered)
        self.healed += 1
        if self.rank == 0:
            print(f"scaletrain: replica group {self.replica_id} took the run's state at step {self.state.step} from a "
                  "live peer (it was behind its quorum: a restart, or a late start)", file=sys.stderr, flush=True)

    # ---- the step -----------------------------------------------------------------------------

    def start(self) -> None:
        """Before the loop: join the quorum of the first step (healing from a peer if behind)."""
        self._join_quorum()
        self.joined = True

    def _join_quorum(self) -> None:
        """torchft's quorum, with one line (rank 0's) when it waits for groups: fewer than min_replicas
        are alive at the Lighthouse, so nobody steps until enough join or fault_tolerance.quorum_timeout_s passes."""
        step = self.state.step
        def say() -> None:
            if self.lighthouse and lighthouse_problem(self.lighthouse, 0.0) is not None:
                why = f"the Lighthouse at {self.lighthouse} does not answer; it stops"
            elif self.min_replicas > 1:
                why = (f"fewer than fault_tolerance.min_replicas={self.min_replicas} groups are in its quorum yet; it "
                       "goes on when enough join")
            else:  # one group is enough: the Lighthouse is still gathering the groups that join this quorum
                why = "the Lighthouse has not formed its quorum yet (groups still joining); it goes on when it does"
            print(f"scaletrain: replica group {self.replica_id} waits at step {step + 1}: {why} (up to "
                  f"fault_tolerance.quorum_timeout_s={self.quorum_timeout_s:g} s)", file=sys.stderr, flush=True)

        note = threading.Timer(WAIT_NOTE_S, say)
        note.daemon = True
        if self.rank == 0:
            note.start()
        started = time.monotonic()
        try:
            with self.interruptible():  # a stop signal here stops the run before this step, saved (not after it)
                self.manager.start_quorum()
        except StopWaiting:
            raise
        except Exception as e:
            # the Lighthouse gone (it is the job's single point of failure) is a stop, not a restart: raised
            # outside this block so that the launcher sees no communication error behind it (no restart)
            if not self.lighthouse or lighthouse_problem(self.lighthouse, 2.0) is None:
                if _timed_out(e):  # the Lighthouse answers, but too few groups joined: said, and restartable
                    raise QuorumNotFormed(self._gave_up(step, time.monotonic() - started)) from None
                raise
        else:
            if (why := self.disagreement()) is not None:  # formed: the group leaves before any collective
                raise ConfigError(why)
            self.writer = self.manager.participating_rank() == 0  # the lowest replica id of the quorum
            return
        finally:
            note.cancel()
        raise TrainingStopped(f"replica group {self.replica_id} stops at step {step}: the Lighthouse at "
                              f"{self.lighthouse} no longer answers; the last "
                              "checkpoint is kept: restart the Lighthouse and the groups, and they resume from it")

    def _gave_up(self, step: int, waited_s: float) -> str:
        """What a group that gave up waiting for its quorum says: how many groups joined of how many."""
        status = quorum_status(self.lighthouse) if self.lighthouse else None
        joined = (f"{status[0]} of the {status[1]} groups it needs (fault_tolerance.min_replicas)" if status else
                  f"fewer than the {self.min_replicas} groups it needs (fault_tolerance.min_replicas)")
        return (f"replica group {self.replica_id} gave up at step {step + 1}: {joined} joined its quorum in "
                f"{waited_s:.0f} s (fault_tolerance.quorum_timeout_s={self.quorum_timeout_s:g}); it stops with exit "
                "code 3, and its launcher restarts it while --max-restarts allows: it joins when enough groups are up")

    def begin_step(self, loss_factor: float) -> None:
        if not self.joined:
            step = self.state.step
            self._join_quorum()
            if self.state.step != step:  # healed to another step mid-loop: the data already read is not its
                raise RuntimeError(f"replica group {self.replica_id} was behind the quorum at step {step} and "
                                   f"healed to step {self.state.step} mid-run; it restarts to read that step's data")
        self.joined = False
        self.participants = self.manager.num_participants()

    def reduce_gradients(self, named: Named) -> None:
        # one all-reduce over the groups in the quorum (an error: not committed): the local gradients, then
        # divided into their mean, and a mixture's step load counts, left summed so that the routing biases
        # move as for the joint batch (MoEBalance, after the step)
        grads = [_local(p.grad) for _, p in named if p.grad is not None]
        tensors = grads + [m.stats for m in self.moe.values()]
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        flat[:sum(g.numel() for g in grads)] /= self.manager.num_participants()
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def agree_to_skip(self, skip: bool) -> bool:
        self.committed = self.manager.should_commit(timeout=self.vote_timeout)
        if not self.committed:
            self.uncommitted += 1
        return skip or not self.committed

    def skip_reason(self) -> str | None:
        if self.committed:
            return None
        seen = f": {failure}" if (failure := failure_text(self.manager.errored())) else ""
        return f"not committed by the replica groups (a group failed in it{seen}; {self.participants} in its quorum)"

    def writes_checkpoint(self) -> bool:
        # as of the last quorum formed: a stop that cut the wait for the next one (StopWaiting) leaves torchft's
        # quorum pending, which asking torchft again would wait for
        return self.writer

    def metrics(self) -> dict[str, float]:
        return {"ft_groups": float(self.participants), "ft_uncommitted": float(self.uncommitted),
                "ft_healed": float(self.healed)}

    def state_dict(self) -> dict:
        return {"committed_steps": self.manager.current_step(), "batches_committed": self.manager.batches_committed()}

    def load_state_dict(self, state: dict | None) -> None:
        if state:  # a resumed group starts torchft's count where its checkpoint left it
            self.manager.load_state_dict({"step": int(state["committed_steps"]),
                                          "batches_committed": int(state["batches_committed"])})

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class ReplicaGroupsOuter(ReplicaGroups):
    """Local SGD / DiLoCo across the replica groups (parallel.sync.mode = local_sgd | diloco with
    dp_replicate = 1): each group is a worker that takes its inner steps alone for sync_every steps,
    its gradients its own. A window of sync_every steps begins with the quorum of the groups alive
    (a group behind it heals from a live peer there: weights, inner optimizer state, outer weights
    and momentum, step) and ends with the pseudo-gradient averaged over that quorum by the Manager's
    all-reduce and the commit vote. A committed sync takes the outer step (scaletrain's OuterSync,
    as between dp_replicate workers); a sync not committed (a group died in its window, or in the
    all-reduce) is discarded: the weights go back to the last synced ones, the outer optimizer does
    not step, and training goes on with the next window."""

    phase = "the replica groups' outer sync (torchft)"

    def set_outer(self, sync) -> None:
        from scaletrain.parallel.local_sgd import OuterSync

        # one fragment, no delay, fp32 (Layout.errors refuses the rest): the whole model in one vote per window
        self.outer = OuterSync(self.named, mode=sync.mode, sync_every=sync.every, fragments=1, delay=0,
                               n_blocks=1, comm=_GroupsAverage(self), outer_optimizer=sync.outer_optimizer,
                               outer_lr=sync.outer_lr, outer_momentum=sync.outer_momentum, on_cpu=sync.outer_on_cpu)
        self.discarded = 0  # sync windows not committed

    # ---- what a healing peer receives: the outer state besides ---------------------------------

    def _peer_state(self) -> dict:
        outer = self.outer
        return {**super()._peer_state(), "outer": {p.name: p.outer for p in outer.params}, "outer_steps": outer.steps,
                "momentum": {p.name: p.momentum for p in outer.params if p.momentum is not None}}

    def _load_peer_state(self, peer: dict) -> None:
        if self.disagreement() is not None:  # (as the base class: refused next)
            return
        with torch.no_grad():
            for p in self.outer.params:
                p.outer.copy_(peer["outer"][p.name])
                if p.momentum is not None:
                    p.momentum.copy_(peer["momentum"][p.name])
        self.outer.steps = int(peer["outer_steps"])
        super()._load_peer_state(peer)

    # ---- the step: a quorum per window, the inner steps alone ----------------------------------

    def begin_step(self, loss_factor: float) -> None:
        # a window begins (or, resumed mid-window, the rest of one begins with the quorum `start` joined)
        if self.state.step % self.outer.every == 0 or self.joined:
            super().begin_step(loss_factor)

    def reduce_gradients(self, named: Named) -> None:
        pass  # a group's gradients are its own; the groups meet at the window's sync

    def agree_to_skip(self, skip: bool) -> bool:
        return skip  # a step skipped by one group alone changes nothing of the others'

    def skip_reason(self) -> str | None:
        return None

    def after_optimizer_step(self, applied: bool) -> bool:
        return self.outer.after_step()

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "ft_uncommitted": float(self.discarded)}

    # ---- checkpoints: the outer weights are the model, as in LocalSGD --------------------------

    def checkpoint_tensors(self, tensors: dict) -> dict:
        shared, _ = self.outer.tensors()
        return {**tensors, "model": self.outer.outer_weights(), "outer": shared}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "outer": self.outer.state()}

    def load_state_dict(self, state: dict | None) -> None:
        super().load_state_dict(state)
        if state:  # the checkpoint's model was loaded into the outer weights: the group goes on from them
            self.outer.load_state(state["outer"])
            with torch.no_grad():
                for p in self.outer.params:
                    p.local.copy_(p.outer.to(p.local.device))


class _GroupsAverage:
    """The OuterSync's averager across replica groups: this group's pseudo-gradient all-reduced
    (mean) over the window's quorum by the Manager; its result waits for the commit vote."""

    def __init__(self, hook: ReplicaGroupsOuter):
        self.hook = hook

    def start(self, flat: torch.Tensor) -> _Vote:
        return _Vote(self.hook, flat, self.hook.manager.allreduce(flat))  # in place: flat becomes the mean


class _Vote:
    """A window's all-reduce, then its commit vote: the average, or None when the sync is not
    committed (the window is discarded)."""

    def __init__(self, hook: ReplicaGroupsOuter, flat: torch.Tensor, work):
        self.hook, self.flat, self.work = hook, flat, work

    def wait(self) -> torch.Tensor | None:
        self.work.wait()  # an error (a group gone) is not raised: the Manager records it and the vote fails
        hook = self.hook
        if hook.manager.should_commit(timeout=hook.vote_timeout):
            return self.flat
        hook.discarded += 1
        if hook.rank == 0:
            last = hook.outer.steps
            print(f"scaletrain: replica group {hook.replica_id} discards the sync window of steps "
                  f"{last - hook.outer.every + 1}-{last}: not committed by the replica groups (a group failed in "
                  f"it; {hook.participants} in its quorum); the weights go back to the last sync",
                  file=sys.stderr, flush=True)
        return None


def _quiet_healing_transfers() -> None:
    """A healing group fetches its peer's state over HTTP (torchft's checkpoint server, on Python's
    http.server): its access lines and the not-writable-buffer warning of loading what came are not
    ours to show (the heal is said in one line); its errors still are."""
    import warnings
    from http.server import BaseHTTPRequestHandler

    BaseHTTPRequestHandler.log_request = lambda self, code="-", size="-": None
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def failure_text(error) -> str | None:
    """What torchft recorded going wrong in a step (an ExceptionWithTraceback, or None), in a few words:
    the error's first line without gloo's source location and advice."""
    if error is None:
        return None
    e = getattr(error, "original_exception", error)
    if not str(e).strip():
        return type(e).__name__
    text = str(e).strip().splitlines()[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    text = re.split(r"(^|\s)This is typically", text)[0].rstrip(" .")  # gloo's advice, after a message or alone
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _loopback(address: str) -> bool:
    host = urlsplit(address if "://" in address else f"http://{address}").hostname or ""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """The optimizer's state by the parameters' order, each tensor as this rank's local part."""
    return {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
            for i, p in enumerate(_optimizer_params(optimizer)) if optimizer.state.get(p)}


@torch.no_grad()
def _load_local_optimizer_state(optimizer: torch.optim.Optimizer, peer: dict[int, dict]) -> None:
    """A peer's `_local_optimizer_state` copied into this optimizer's own state tensors (created
    first where it has none: a group that never stepped), so that each keeps its kind (a DTensor
    shard's mesh and placement are this group's)."""
    params = _optimizer_params(optimizer)
    if any(i in peer and not optimizer.state.get(p) for i, p in enumerate(params)):
        init_optimizer_state(optimizer)
    for i, p in enumerate(params):
        if i not in peer:  # the peer has not stepped it (no gradient yet): neither has this group now
            optimizer.state.pop(p, None)
            continue
        mine = optimizer.state[p]
        for k, v in peer[i].items():
            if isinstance(v, torch.Tensor) and isinstance(mine.get(k), torch.Tensor):
                _local(mine[k]).copy_(v)
            else:
                mine[k] = v


def _local(t: torch.Tensor | nn.Parameter) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t.data if isinstance(t, nn.Parameter) else t
