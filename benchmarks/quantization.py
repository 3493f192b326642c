"""What quantization costs and saves: validation perplexity, size on disk and CPU inference speed
of fp32, post-training quantization (PTQ) and quantization-aware training (QAT) at each scheme.

For each model (the demo, configs/tiny.toml, and with --larger a wider and deeper one), on the
same data and seed: an fp32 run as configured, then from its weights (its export as
model.init_from) --finetune-steps more steps at peak lr --finetune-lr (no warm-up, the
config's decay), once in fp32 (the control) and once with train.qat = each scheme that has
one (QAT as a fine-tune, torchao's recommended use; the same steps and tokens as the control).

* fp32: the control; PTQ: the control quantized by each scheme;
* QAT: each QAT fine-tune quantized by its scheme (`scaletrain quantize`, QAT's convert step).

Perplexity is `scaletrain eval`'s on the demo's held-out text (--eval-batches global batches);
size is the safetensors export (fp32) or the quantized folder; tokens/s is a forward pass over a
batch of --batch sequences, one process, the median of --repeats timings, after one warm-up.
"recovered" is the share of PTQ's perplexity increase that QAT wins back:
(ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_fp32).

    python benchmarks/quantization.py [--larger] [--steps N] [--out-dir DIR] [--train-only RUN] [--speed-only]
        [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from scaletrain.config import load_config  # noqa: E402
from scaletrain.launch.ranks import quiet  # noqa: E402
from scaletrain.quant.ptq import folder_bytes, load_quantized  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402
from scaletrain.trained.evaluate import evaluate_checkpoint  # noqa: E402
from scaletrain.trained.export import export_safetensors, load_model_from_checkpoint  # noqa: E402
from scaletrain.trained.quantize import quantize_source  # noqa: E402
from scaletrain.vocab import QAT_SCHEMES, QUANT_SCHEMES  # noqa: E402

# a wider, deeper model than the demo that still trains in a few minutes on 2 CPU cores
LARGER = {"model.dim": 384, "model.n_layers": 4, "model.n_heads": 6}
# the smallest PTQ perplexity increase, relative to fp32's, whose share QAT recovers is printed:
# the control and the QAT fine-tunes are separate runs from the same weights, and on models whose
# PTQ lost nothing their perplexities differed by up to ~0.02% (0.003 of 13.8), so a share of
# a smaller loss is that noise divided by a near-zero number
RESOLUTION = 1e-3
# a quiet run that keeps its final checkpoint (what is measured) and prints a line every 10 steps
RUN = {"checkpoint.save_final": True, "log.every": 10, "train.device": "cpu"}


def train(folder: Path, overrides: dict) -> Path:
    """The run's final checkpoint: trained here, or found from an earlier invocation (or a
    --train-only one running beside this) with the same --out-dir."""
    cfg = load_config(REPO / "configs" / "tiny.toml", {**overrides, **quiet(folder), **RUN})
    final = folder / "checkpoints" / f"step_{cfg.train.steps:08d}"
    if folder.exists() and not final.is_dir():  # a --train-only invocation is training it: wait
        print(f"waiting for {final} (trained beside this invocation)", file=sys.stderr, flush=True)
        while not final.is_dir():
            time.sleep(10)
    if not final.is_dir():
        stopped = Trainer(cfg).fit()["stopped_by"]
        if stopped is not None:  # its last checkpoint is not the run's: measuring it would mislabel it
            sys.exit(f"{folder.name}: stopped by signal {int(stopped)} before step {cfg.train.steps}; "
                     f"delete {folder} and run again")
    return final


@torch.no_grad()
def tokens_per_second(model, batch: int, seq_len: int, repeats: int) -> float:
    tokens = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    model(tokens)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(tokens)
        times.append(time.perf_counter() - start)
    return batch * seq_len / statistics.median(times)


def measure(name: str, variant: str, path: Path, quantized: bool, args, seq_len: int) -> dict:
    r = evaluate_checkpoint(path, batches=args.eval_batches, device="cpu")
    model = load_quantized(path)[0] if quantized else load_model_from_checkpoint(path).eval()
    if quantized:
        size = folder_bytes(path)
    else:
        export = path.parent.parent / "export.safetensors"
        if not export.exists():
            export_safetensors(path, export)
        size = folder_bytes(export)
    row = {"model": name, "variant": variant, "val_ppl": r["val_ppl"], "val_loss": r["val_loss"],
           "size_mib": size / 2**20, "tokens_s": tokens_per_second(model, args.batch, seq_len, args.repeats)}
    print(f"| {name} | {variant} | {row['val_ppl']:.3f} | {row['size_mib']:.2f} | {row['tokens_s']:,.0f} |",
          flush=True)
    return row


def run_model(name: str, overrides: dict, args, root: Path) -> list[dict]:
    """fp32 trained; then from its weights (model.init_from of its export) --finetune-steps more
    steps each of fp32 (the control) and QAT per scheme; PTQ of the control against QAT."""
    seq_len = load_config(REPO / "configs" / "tiny.toml", overrides).data.seq_len
    base = train(root / name / "fp32", overrides)
    export = root / name / "fp32.safetensors"
    if not export.exists():
        export_safetensors(base, export)
    tune = {**overrides, "model.init_from": str(export), "train.steps": args.finetune_steps,
            "optim.lr": args.finetune_lr, "optim.warmup_steps": 0}
    rows = []
    control = train(root / name / "fp32-tuned", tune)
    rows.append(measure(name, "fp32", control, False, args, seq_len))
    for scheme in QUANT_SCHEMES:
        out = root / name / f"ptq-{scheme}"
        quantize_source(control, scheme, out, overwrite=True, report=lambda line: None)
        rows.append(measure(name, f"PTQ {scheme}", out, True, args, seq_len))
    for scheme in QAT_SCHEMES[1:]:
        ckpt = train(root / name / f"qat-{scheme}", {**tune, "train.qat": scheme})
        out = root / name / f"qat-{scheme}-quantized"
        quantize_source(ckpt, scheme, out, overwrite=True, report=lambda line: None)
        rows.append(measure(name, f"QAT {scheme}", out, True, args, seq_len))
    return rows


def interleaved_speed(root: Path, name: str, args, seq_len: int) -> None:
    """CPU forward tokens/s of the fp32 control and every quantized folder under `root`, timed
    round-robin (one forward of each, --repeats rounds) so that load from other work on the
    machine falls on all of them alike; prints each one's median and its ratio to fp32."""
    folder = root / name
    models = {"fp32": load_model_from_checkpoint(sorted((folder / "fp32-tuned" / "checkpoints").glob("step_*"))[-1])
              .eval()}
    for q in sorted(folder.glob("*/quantization.json")):
        models[q.parent.name] = load_quantized(q.parent)[0]
    tokens = torch.randint(0, 256, (args.batch, seq_len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.no_grad():
        for m in models.values():
            m(tokens)  # warm-up
        for _ in range(args.repeats):
            for k, m in models.items():
                start = time.perf_counter()
                m(tokens)
                times[k].append(time.perf_counter() - start)
    base = statistics.median(times["fp32"])
    print(f"| {name}: forward of {args.batch}x{seq_len}, {args.repeats} rounds | tokens/s | x fp32 |\n|---|---|---|")
    for k, ts in times.items():
        t = statistics.median(ts)
        print(f"| {k} | {args.batch * seq_len / t:,.0f} | {base / t:.2f} |")


def recovered(rows: list[dict]) -> list[str]:
    lines = []
    by = {(r["model"], r["variant"]): r for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        base = by[(model, "fp32")]["val_ppl"]
        for scheme in QAT_SCHEMES[1:]:
            ptq, qat = by[(model, f"PTQ {scheme}")]["val_ppl"], by[(model, f"QAT {scheme}")]["val_ppl"]
            lost = ptq - base
            if lost > RESOLUTION * base:
                share = f"{(ptq - qat) / lost:.0%}"
            else:
                share = f"not measurable: PTQ lost {lost:+.3f}, under {RESOLUTION:.1%} of fp32's"
            lines.append(f"| {model} | {scheme} | {base:.3f} | {ptq:.3f} ({lost:+.3f}) | {qat:.3f} | {share} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--larger", action="store_true", help=f"also the larger model ({LARGER})")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: the config's)")
    p.add_argument("--eval-batches", type=int, default=0, help="validation global batches (default 0: every whole one)")
    p.add_argument("--batch", type=int, default=8, help="sequences per timed forward (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards (default 5)")
    p.add_argument("--out-dir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("--finetune-steps", type=int, default=20, help="steps of fp32 and QAT from the fp32 weights "
                                                                   "(default 20)")
    p.add_argument("--finetune-lr", type=float, default=3e-4,
                   help="their peak learning rate, no warm-up (default 3e-4)")
    p.add_argument("--speed-only", action="store_true",
                   help="only time the forwards of the runs already in "
                        "--out-dir, round-robin (the larger model's too with --larger)")
    p.add_argument("--train-only", metavar="RUN",
                   help="only train the fine-tune RUN (fp32-tuned, or qat-SCHEME) into --out-dir, e.g. "
                        "beside the main invocation, which then finds it trained")
    args, extra = p.parse_known_args()
    overrides = dict(a[2:].split("=", 1) for a in extra if a.startswith("--") and "=" in a)
    if args.steps:
        overrides["train.steps"] = args.steps
    torch.manual_seed(0)
    root = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="scaletrain-quant-"))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), threads {torch.get_num_threads()}; runs in {root}\n")
    larger = f"larger (dim {LARGER['model.dim']}, {LARGER['model.n_layers']} layers)"
    if args.speed_only:
        seq_len = load_config(REPO / "configs" / "tiny.toml", overrides).data.seq_len
        for name in ["demo (tiny)"] + ([larger] if args.larger else []):
            interleaved_speed(root, name, args, seq_len)
        return 0
    if args.train_only:  # a fine-tuning run (fp32-tuned or qat-SCHEME), once fp32 is trained
        folder, qat = root / "demo (tiny)", args.train_only.removeprefix("qat-")
        tune = {**overrides, "model.init_from": str(folder / "fp32.safetensors"), "train.steps": args.finetune_steps,
                "optim.lr": args.finetune_lr, "optim.warmup_steps": 0}
        train(folder / args.train_only, {**tune, **({"train.qat": qat} if qat in QAT_SCHEMES[1:] else {})})
        return 0
    print("| model | variant | val ppl | size (MiB) | CPU tokens/s (forward) |\n|---|---|---|---|---|", flush=True)
    rows = run_model("demo (tiny)", overrides, args, root)
    if args.larger:
        rows += run_model(larger, {**overrides, **LARGER}, args, root)
    print("\n| model | scheme | fp32 ppl | PTQ ppl | QAT ppl | recovered by QAT |\n|---|---|---|---|---|---|")
    print("\n".join(recovered(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
