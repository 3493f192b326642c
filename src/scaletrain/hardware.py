"""Accelerator facts: memory, dense peak FLOP/s per dtype, memory and link bandwidths.

Figures are the vendors' datasheet numbers for dense (not 2:4-sparse) math; link bandwidths
are per GPU and per direction. `inter_node_GBps` is the typical NIC of machines built around
that GPU (one NIC per GPU); a cluster TOML can override any field.

For a CPU there is no datasheet we can trust, so its peak is measured with a matmul probe (the
best of several sizes, runs and the layouts a linear layer's forward and backward multiply in) on
all the cores this process may run on — the cores the local ranks share — once per CPU, core
count, torch version and dtype, and cached in the user's cache folder. The same probe gives the
same kind of figure every time: nothing a run does changes it, so an MFU does not depend on past
runs (`cpu_peak_flops`, `describe_cpu_peak`); a run that still outruns it is given no MFU
(`train.metrics.mfu`), never one above 100%.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from scaletrain import atomic
from scaletrain.errors import ConfigError

try:
    import fcntl  # file locks, for the CPU peak cache that ranks on one host share
except ImportError:  # Windows
    fcntl = None

TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_GB: float  # usable device memory, in 10^9 bytes as on datasheets
    peak_tflops: dict[str, float] = field(default_factory=dict)  # by dtype: fp32, tf32, bf16, fp16, fp8
    memory_GBps: float = 0.0  # device memory bandwidth
    intra_node_GBps: float = 0.0  # per GPU, one direction (NVLink, or PCIe without it)
    inter_node_GBps: float = 0.0  # per GPU, one direction (its NIC)
    bus_GBps: float = 0.0  # measured bus bandwidth inside a node (scaletrain bench comms); 0 = from intra_node_GBps
    efficiency: float = 0.0  # fraction of dense peak large matmuls reach in training; 0 = 0.6
    host_memory_GB: float = 0.0  # RAM of one node (what offloading fills), 10^9 bytes; 0 = unknown, not checked

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_GB * 1e9)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_GB * 1e9)

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise ConfigError(f"hardware {self.name} has no {dtype} peak in the catalog "
                              f"(it has {', '.join(self.peak_tflops)}); pick another precision")
        return self.peak_tflops[dtype] * TFLOPS


def _gpu(name, memory_GB, fp32, tf32, bf16, fp16, fp8, hbm, intra, inter, eff, host) -> Hardware:
    peaks = {k: v for k, v in dict(fp32=fp32, tf32=tf32, bf16=bf16, fp16=fp16, fp8=fp8).items() if v}
    return Hardware(name, memory_GB, peaks, hbm, intra, inter, efficiency=eff, host_memory_GB=host)


# `eff`: the fraction of dense peak a large training matmul reaches. Fitted, not evidence:
#   A100: torchtitan docs/performance.md, Llama 3 8B, FSDP on 64 A100-80GB, 1 × 8192, selective
#         AC: 2,973 tokens/s/GPU.
#   H100: llm-foundry scripts/train/benchmarking/README.md, "H100 80GB BF16" table, MPT-7B on
#         8 H100-SXM at full power (700 W), FULL_SHARD, seq 2048, micro-batch 6, no AC:
#         10,643 tokens/s/GPU (46.4% MFU). torchtitan's H100 rows ran at 500 W on 96 GB HBM2e
#         parts, so they are held out, not fitted (plan/published.py).
# H200 and B200 take the H100's figure, the others are stated guesses, not fits (docs/planner.md,
# "Calibration").
# `host`: the RAM of a typical node of 8 (DGX-1 512 GB, DGX A100 1 or 2 TB, DGX H100/H200/B200
# 2 TB; 256 GB for a server of consumer cards), what offloading can fill: stated, not measured.
# name                 mem    fp32  tf32   bf16    fp16    fp8     HBM GB/s  NVLink/PCIe  NIC   eff   host GB
CATALOG: dict[str, Hardware] = {h.name: h for h in [
    _gpu("V100-32GB",       32,  15.7, None,  None,   125.0,  None,    900,  150,  12.5, 0.55,   512),
    _gpu("A100-40GB",       40,  19.5, 156.0, 312.0,  312.0,  None,   1555,  300,  25.0, 0.70,  1024),
    _gpu("A100-80GB",       80,  19.5, 156.0, 312.0,  312.0,  None,   2039,  300,  25.0, 0.70,  2048),
    _gpu("H100-SXM",        80,  67.0, 494.5, 989.4,  989.4,  1978.9, 3350,  450,  50.0, 0.535, 2048),
    _gpu("H100-PCIe",       80,  51.2, 378.0, 756.0,  756.0,  1513.0, 2000,   64,  50.0, 0.535, 1024),
    _gpu("H200",           141,  67.0, 494.5, 989.4,  989.4,  1978.9, 4800,  450,  50.0, 0.535, 2048),
    _gpu("B200",           180,  75.0, 1125., 2250.0, 2250.0, 4500.0, 8000,  900,  50.0, 0.535, 2048),
    _gpu("RTX-3090",        24,  35.6, 35.6,  71.0,   71.0,   None,    936,   32,  12.5, 0.65,   256),
    _gpu("RTX-4090",        24,  82.6, 82.6,  165.2,  165.2,  None,   1008,   32,  12.5, 0.65,   256),
]}

# substrings of torch.cuda.get_device_name() -> catalog entry
_CUDA_NAMES = [("H200", "H200"), ("H100 PCIe", "H100-PCIe"), ("H100", "H100-SXM"), ("B200", "B200"),
               ("A100-SXM4-40GB", "A100-40GB"), ("A100-PCIE-40GB", "A100-40GB"), ("A100", "A100-80GB"),
               ("V100", "V100-32GB"), ("3090", "RTX-3090"), ("4090", "RTX-4090")]


def lookup(name: str, extra_file: str | Path | None = None) -> Hardware:
    """A catalog entry by name (case-insensitive), or from a user TOML of [[hardware]] tables."""
    catalog = dict(CATALOG)
    if extra_file:
        catalog.update(load_catalog_file(extra_file))
    for key, hw in catalog.items():
        if key.lower() == name.lower():
            return hw
    from scaletrain.vocab import did_you_mean

    raise ConfigError(f"unknown hardware {name!r}{did_you_mean(name, catalog)}; known: {', '.join(catalog)} "
                      "(add your own with a TOML file of [[hardware]] tables)")


def load_catalog_file(path: str | Path) -> dict[str, Hardware]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"hardware file {p} not found")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    known = {f.name for f in fields(Hardware)}
    out = {}
    for i, entry in enumerate(raw.get("hardware", [])):
        unknown = set(entry) - known
        if unknown or "name" not in entry or "memory_GB" not in entry:
            raise ConfigError(f"{p}: [[hardware]] entry {i} needs name and memory_GB and may have "
                              f"{', '.join(sorted(known))}; unknown keys: {', '.join(sorted(unknown)) or 'none'}")
        out[entry["name"]] = Hardware(**entry)
    return out


def cuda_hardware(index: int = 0) -> Hardware | None:
    name = torch.cuda.get_device_name(index)
    for needle, key in _CUDA_NAMES:
        if needle in name:
            return CATALOG[key]
    return None


def dtype_key(dtype: torch.dtype, tf32: bool = False) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if tf32 else "fp32"


def device_peak_flops(device: torch.device, dtype: torch.dtype, tf32: bool = False) -> tuple[float, str]:
    """Dense peak FLOP/s of `device` for matmuls in `dtype` (a CPU: the whole CPU, which its local
    ranks share), and where the figure came from, in words."""
    key = dtype_key(dtype, tf32)
    if device.type == "cuda":
        hw = cuda_hardware(device.index or 0)
        if hw is not None and key in hw.peak_tflops:
            return hw.peak_tflops[key] * TFLOPS, f"{hw.name}'s dense {key} peak (catalog)"
        return (measure_matmul_peak(device, dtype),
                f"{torch.cuda.get_device_name(device)}'s {key} matmul peak (measured)")
    return cpu_peak_flops(dtype), describe_cpu_peak(dtype)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] | None = None,
                        runs: int = 5, seconds: float = 1.2) -> float:
    """Best observed FLOP/s of square matmuls on `device`: `runs` timed runs at each size, the
    sizes in increasing order, within about `seconds` (a size whose runs would not fit is left
    out, but the smallest is always measured). On a CPU with several threads, also on one
    thread, in half the time each: more threads only add FLOP/s, so a threaded measurement that
    other processes slowed (one stalled thread stalls the whole matmul) never sets the peak
    below what one core reaches."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        return _probe(device, dtype, sizes, runs, seconds)
    best = _probe(device, dtype, sizes, runs, seconds / 2)
    torch.set_num_threads(1)
    try:
        return max(best, _probe(device, dtype, sizes, runs, seconds / 2))
    finally:
        torch.set_num_threads(threads)


def _probe(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] | None, runs: int,
           seconds: float) -> float:
    sizes = sizes or ((256, 512, 1024) if device.type == "cpu" else (1024, 2048, 4096))
    deadline = time.perf_counter() + seconds
    best, last_run_s, last_n = 0.0, 0.0, 0
    for n in sizes:
        # a matmul's time grows as n^3: skip this size if its warm-up and runs cannot end in time
        if last_n and time.perf_counter() + last_run_s * (n / last_n) ** 3 * (runs + 1) > deadline:
            break
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        _matmul_flops(a, b)  # warm-up: the first call pays for allocation and kernel choice
        for _ in range(runs):
            t0 = time.perf_counter()
            best = max(best, _matmul_flops(a, b))
            last_run_s = time.perf_counter() - t0
        last_n = n
    return best


def _matmul_flops(a: torch.Tensor, b: torch.Tensor) -> float:
    """FLOP/s of the fastest of the three layouts a linear layer's training step multiplies in
    (square matrices), each timed once: the forward `x @ w.T`, the input's gradient `g @ w` and
    the weight's `g.T @ x` (attention's `q @ k.T` and `p @ v` are two of them). Kernels differ by
    layout: on CPUs without native fp16/bf16 math, `a @ b` in half precision runs several times
    slower than `a @ b.T`, so a peak probed on one layout alone falls below what a run reaches."""
    return max(_timed_flops(a, b.t()), _timed_flops(a, b), _timed_flops(a.t(), b))


def _timed_flops(a: torch.Tensor, b: torch.Tensor) -> float:
    """FLOP/s of one timed `a @ b` (square matrices, either of them maybe a transposed view)."""
    cuda = a.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(a.device)
    t0 = time.perf_counter()
    a @ b
    if cuda:  # the matmul was only queued: wait for it
        torch.cuda.synchronize(a.device)
    return 2 * a.shape[0] ** 3 / (time.perf_counter() - t0)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "scaletrain"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """The cores this process may run on (its affinity; all of them if the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_key(dtype: torch.dtype) -> str:
    # probe=3: the probe on every core (with one core's as its floor), the best of the three layouts a
    # linear layer multiplies in; older entries (one layout, below what half-precision runs reach) are not read
    return f"{_cpu_name()}|cores={cpu_cores()}|torch={torch.__version__}|{dtype}|probe=3"


def cpu_peak_file() -> Path:
    return _cache_dir() / "cpu_peak.json"


@contextlib.contextmanager
def json_cache(path: Path):
    """A JSON cache file as a dict, under a file lock (ranks on one host share the file);
    what the block leaves in the dict is written back atomically (temporary file + rename)."""
    lock = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError:
        pass  # no lock (read-only home): the worst case is one lost update
    try:
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
        if not isinstance(cache, dict):
            cache = {}
        before = dict(cache)
        yield cache
        if cache != before:
            try:
                atomic.write_json(path, cache)
            except OSError:
                pass  # a read-only home only costs a re-probe next time
    finally:
        if lock is not None:
            lock.close()  # releases the lock


def cpu_peak_flops(dtype: torch.dtype) -> float:
    """The whole CPU's matmul FLOP/s in `dtype`: the probe run on every core this process may use
    (one thread per core, whatever this process's own thread count), once, then read from the
    cache. Ranks on one host wait for the first one's probe (the cache's lock) and share its figure."""
    key = _cpu_key(dtype)
    with json_cache(cpu_peak_file()) as cache:
        if isinstance(cache.get(key), (int, float)) and cache[key] > 0:
            return float(cache[key])
        threads = torch.get_num_threads()
        torch.set_num_threads(cpu_cores())
        try:
            cache[key] = measure_matmul_peak(torch.device("cpu"), dtype)
        finally:
            torch.set_num_threads(threads)
        return cache[key]


def describe_cpu_peak(dtype: torch.dtype) -> str:
    """Where a CPU peak comes from, in words (for the line that says what MFU is measured against)."""
    return (f"the CPU's {dtype_key(dtype)} matmul peak on its {cpu_cores()} core(s) (a probe, run once and cached "
            f"in {cpu_peak_file()})")


def local_hardware(device: torch.device) -> Hardware:
    """The device at hand as a catalog entry: a known GPU from the catalog (its memory as the
    driver reports it), an unknown GPU or the CPU measured here. For a CPU the link and memory
    bandwidths are rough stated figures (loopback TCP between local ranks)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        known = cuda_hardware(device.index or 0)
        if known is not None:
            return Hardware(known.name, props.total_memory / 1e9, known.peak_tflops, known.memory_GBps,
                            known.intra_node_GBps, known.inter_node_GBps, efficiency=known.efficiency,
                            host_memory_GB=ram)
        peaks = {k: measure_matmul_peak(device, dt) / TFLOPS
                 for k, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
        return Hardware(torch.cuda.get_device_name(device), props.total_memory / 1e9, peaks, 500.0, 25.0, 12.5,
                        host_memory_GB=ram)
    peaks = {"fp32": cpu_peak_flops(torch.float32) / TFLOPS, "bf16": cpu_peak_flops(torch.bfloat16) / TFLOPS}
    peaks["tf32"] = peaks["fp32"]
    peaks["fp16"] = peaks["bf16"]
    # a CPU's peak is itself measured by a matmul probe, so most of it is reachable
    return Hardware("CPU", ram, peaks, memory_GBps=20.0, intra_node_GBps=5.0, inter_node_GBps=1.0, efficiency=0.8)
