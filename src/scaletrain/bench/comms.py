"""`scaletrain bench comms`: how fast the collectives run on this machine, nccl-tests style.

    scaletrain bench comms --nproc N [--sizes 1K 64K 1M | 1K:16M] [--iters 20] [--warmup 5] [--json]

N ranks start through scaletrain's launcher (NCCL on GPUs, gloo on CPU). For each collective
and message size every rank makes `warmup` untimed calls, then `iters` timed ones; each timed
call starts after a barrier and ends when its result is ready (a CUDA sync on GPU). A call
takes as long as its slowest rank; the figure reported is the median over the calls.

    algbw = size / time
    busbw = algbw × factor   (the nccl-tests factors, n ranks)
            all-reduce 2(n−1)/n;  all-gather, reduce-scatter, all-to-all (n−1)/n;  broadcast, reduce 1

The bus bandwidth undoes the algorithm's own traffic pattern, so it is comparable across
collectives, rank counts and with the link's speed. `size` is the whole buffer as nccl-tests
counts it: the all-reduce, broadcast and reduce buffer, the all-gather output (n parts), the
reduce-scatter input (n parts), the all-to-all buffer of each rank. Elements are float32; a
size is rounded down to a whole number of elements per rank.

`--json` output can feed the planner: `scaletrain plan ... --comms FILE` uses the all-reduce
bus bandwidth at the largest size measured for the collectives inside a node.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path

from scaletrain import fmt
from scaletrain.errors import ConfigError, LaunchError, UserError
from scaletrain.launch.ranks import read_spec, run_on_ranks, write_result
from scaletrain.plan.calibrate import bus_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")
ELEMENT_BYTES = 4  # float32
DEFAULT_SIZES = {"cpu": ["1K", "32K", "1M", "16M"], "cuda": ["1M", "16M", "256M", "1G"]}
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """Bytes: 4096, 4K, 4KiB, 4KB, 16M, 1G (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise UserError(f"--sizes: {text!r} is not a size; give bytes like 4096, 64K, 16M or 1G, "
                        "or a range MIN:MAX[:FACTOR] like 1K:16M")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(items: list[str]) -> list[int]:
    """Sizes from `64K 1M`, `64K,1M` or a range `MIN:MAX[:FACTOR]` (×4 by default)."""
    out: list[int] = []
    for item in (part for text in items for part in text.split(",") if part.strip()):
        if ":" in item:
            bounds = item.split(":")
            if len(bounds) not in (2, 3):
                raise UserError(f"--sizes: {item!r}: a range is MIN:MAX or MIN:MAX:FACTOR")
            low, high = parse_size(bounds[0]), parse_size(bounds[1])
            factor = 4 if len(bounds) == 2 else int(bounds[2]) if bounds[2].strip().isdigit() else 0
            if factor < 2 or low > high:
                raise UserError(f"--sizes: {item!r}: a range needs MIN <= MAX and a whole FACTOR >= 2")
            size = low
            while size <= high:
                out.append(size)
                size *= factor
        else:
            out.append(parse_size(item))
    if not out:
        raise UserError("--sizes: give at least one size")
    return sorted(set(out))


def message_sizes(sizes: list[int], n: int) -> list[int]:
    """Each size rounded down to whole float32 elements per rank (the splitting collectives need that)."""
    unit = ELEMENT_BYTES * n
    small = [s for s in sizes if s < unit]
    if small:
        raise UserError(f"--sizes: {', '.join(map(str, small))} byte(s) is less than one float32 per rank "
                        f"({unit} bytes on {n} ranks)")
    return sorted({s // unit * unit for s in sizes})


# ------------------------------------------------------------------------------------------
# on every rank


def _collective(op: str, size: int, n: int, device):
    """A closure making one call of `op` on buffers of `size` bytes (zeros: no denormal slow paths)."""
    import torch
    import torch.distributed as dist

    count = size // ELEMENT_BYTES
    full = torch.zeros(count, device=device)
    part = torch.zeros(count // n, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: gather(full, part)
    if op == "reduce_scatter":
        return lambda: scatter(part, full)
    if op == "broadcast":
        return lambda: dist.broadcast(full, src=0)
    if op == "reduce":
        return lambda: dist.reduce(full, dst=0)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    if op == "send_recv":  # a pipeline's exchange: each rank sends the buffer to the next, receives from the previous
        rank, got = dist.get_rank(), torch.empty_like(full)

        def exchange():
            ops = [dist.P2POp(dist.isend, full, (rank + 1) % n), dist.P2POp(dist.irecv, got, (rank - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return exchange
    raise ValueError(f"unknown collective {op!r}")


def measure(sizes: list[int], iters: int, warmup: int, device, ops: tuple[str, ...] = OPS) -> list[dict]:
    """Every rank calls this; returns the rows (the same on every rank) for each of `ops`
    (OPS, or any of them and send_recv: each rank sending its buffer to the next)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for op in ops:
        for size in sizes:
            call = _collective(op, size, n, device)
            times = []
            for i in range(warmup + iters):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                call()
                sync()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            slowest = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a call lasts until its slowest rank is done
            t = statistics.median(slowest.tolist())
            algbw = size / t / 1e9
            factor = bus_factor(op, n)
            rows.append({"op": op, "bytes": size, "time_s": t, "algbw_GBps": algbw, "bus_factor": factor,
                         "busbw_GBps": algbw * factor})
    return rows


def bench_rank(spec_path: str, out_path: str) -> int:
    """One rank of `run` (the `bench-comms` task of scaletrain.launch.worker)."""
    import torch
    import torch.distributed as dist

    from scaletrain.runtime import pick_device

    spec = read_spec(spec_path)
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = pick_device(spec["device"], local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    rows = measure(spec["sizes"], spec["iters"], spec["warmup"], device)
    if int(os.environ["RANK"]) == 0:
        write_result(out_path, {"backend": dist.get_backend(), "device": device.type, "rows": rows})
    return 0


# ------------------------------------------------------------------------------------------
# in the user's process


def run(nproc: int | None = None, sizes: list[str] | None = None, iters: int = 20, warmup: int = 5,
        device: str = "auto") -> dict:
    """Start the ranks, measure, and return the result (what `--json` prints)."""
    import torch

    from scaletrain.runtime import pick_device

    kind = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    if nproc is None:
        nproc = torch.cuda.device_count() if kind == "cuda" else 2
    if nproc < 2:
        raise LaunchError(f"--nproc {nproc}: a collective needs at least 2 ranks to move any data")
    if iters < 1 or warmup < 0:
        raise UserError(f"--iters must be at least 1 and --warmup at least 0, got {iters} and {warmup}")
    pick_device(kind, 0, nproc)  # enough GPUs for the ranks, or one line saying not
    nbytes = message_sizes(parse_sizes(sizes or DEFAULT_SIZES[kind]), nproc)
    got = run_on_ranks("bench-comms", {"device": kind, "sizes": nbytes, "iters": iters, "warmup": warmup}, nproc)
    largest = {r["op"]: r["busbw_GBps"] for r in got["rows"] if r["bytes"] == max(nbytes)}
    return {"what": "scaletrain bench comms", "backend": got["backend"], "device": got["device"],
            "world_size": nproc, "dtype": "float32", "iters": iters, "warmup": warmup, "sizes": nbytes,
            "rows": got["rows"], "busbw_at_largest_GBps": largest}


def table(result: dict) -> str:
    from scaletrain.bench.interleave import text_table

    n = result["world_size"]
    lines = [f"bench comms: {n} ranks, {result['backend']} on {result['device']}, {result['dtype']}; median of "
             f"{result['iters']} calls after {result['warmup']} warm-up, each as long as its slowest rank",
             f"bus factors for n={n}: " + ", ".join(f"{op} {bus_factor(op, n):g}" for op in OPS)]
    body, last = [], None
    for r in result["rows"]:
        body.append(["" if r["op"] == last else r["op"], fmt.size(r["bytes"], exact=True), fmt.seconds(r["time_s"]),
                     f"{r['algbw_GBps']:#.3g}", f"{r['busbw_GBps']:#.3g}"])
        last = r["op"]
    lines.append(text_table(["collective", "size", "median time", "algbw GB/s", "busbw GB/s"], body))
    return "\n".join(lines)


def read_bus_bandwidth(path: str | Path) -> tuple[float, str]:
    """The all-reduce bus bandwidth (GB/s) at the largest size in a `bench comms --json` file,
    and a line saying where it came from."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        rows = [r for r in data["rows"] if r["op"] == "all_reduce"]
        best = max(rows, key=lambda r: r["bytes"])
        bus = float(best["busbw_GBps"])
    except OSError as e:
        raise ConfigError(f"--comms {p}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ConfigError(f"--comms {p}: not the output of `scaletrain bench comms --json` "
                          "(it needs rows with op all_reduce, bytes and busbw_GBps)") from None
    if not bus > 0:
        raise ConfigError(f"--comms {p}: the all-reduce bus bandwidth is {bus}, not a positive figure")
    return bus, (f"measured all-reduce bus bandwidth {bus:.3g} GB/s ({fmt.size(best['bytes'], exact=True)}, "
                 f"{data.get('world_size', '?')} ranks, {data.get('backend', '?')}) from {p}")

