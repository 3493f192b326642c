"""Adapters measured side by side: full fine-tuning, LoRA and QLoRA (nf4).

* memory: peak RSS of one process per row (full, lora, qlora-nf4) training the Llama-3.2-1B
  widths (`model.preset=llama-1b`: dim 2048, 32 / 8 kv heads, ffn 8192, vocab 128256, tied
  embeddings) with fewer blocks (`--layers`, default 2: the 16-block model's full fine-tune needs
  ~20 GB of weights, gradients and AdamW state alone, more than a shared 24 GiB machine holds);
  the same batch in every row, AdamW, fp32; the ratio of each to full.
* speed: scaletrain's LoRA step (Trainer on `model.init_from` of a saved transformers Llama)
  against PEFT's (`peft.get_peft_model` on the same transformers model, a plain loop), same
  batch, rank, alpha and targets (every block linear), AdamW, no clipping; A and B alternate
  in one run; the medians of wall and of this process's CPU time, their ratios and the spread of
  each repetition's ratio.
* quality: the demo model (configs/tiny.toml) pre-trained briefly on the demo corpus, then
  fine-tuned on a held-out text that ships with Python (the stdlib's json package source, its
  last 15% held out) by full fine-tuning, LoRA and QLoRA (nf4); each one's validation loss on
  the held-out windows and the share of full fine-tuning's gain (base - ft) it recovers.

    nice python benchmarks/adapters.py memory [--layers 2] [--seq 64] [--batch 1] [--steps 2]
    nice python benchmarks/adapters.py speed [--reps 8] [--steps 2]
    nice python benchmarks/adapters.py quality [--pretrain-steps 150] [--steps 60]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEMORY_ROWS = {
    "full": ("full fine-tuning", {}),
    "lora": ("LoRA r8 (all-linear)", {"adapter.kind": "lora"}),
    "qlora": ("QLoRA r8, nf4 base", {"adapter.kind": "lora", "adapter.base_dtype": "nf4"}),
}
QUIET_RUN = {"train.sample_tokens": 0, "train.eval_every": 0, "checkpoint.save_final": "false",
             "log.tensorboard": "false", "log.summary": "false"}


def trainer(overrides: dict, config: str | None = None, run_dir: str | None = None):
    from scaletrain.config import load_config
    from scaletrain.launch.ranks import flags, quiet
    from scaletrain.train.trainer import Trainer

    run_dir = run_dir or tempfile.mkdtemp(prefix="adapters-")
    cfg = load_config(config, [*flags(quiet(run_dir)), *flags({**QUIET_RUN, **overrides})])
    devnull = open(os.devnull, "w")  # noqa: SIM115 - the Trainer logs to it for as long as it lives
    with contextlib.redirect_stdout(devnull):
        return Trainer(cfg, stream=devnull)


def fit(t) -> None:
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # the summary
        t.fit()


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def rss_mib(key: str = "VmHWM") -> float:
    """This process's peak (VmHWM) or current (VmRSS) resident memory, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak() -> None:
    """Start the peak (VmHWM) again from the current RSS: building the model (fp32 weights
    initialised; QLoRA's bases quantized one weight at a time) has a peak of its own, which would
    hide the training's."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


# ------------------------------------------------------------------------------------------
# memory: one subprocess per row


def memory_row(spec: str) -> None:
    args = json.loads(spec)
    from scaletrain.measure import LiveMemory

    before = rss_mib()  # torch imported: its own RSS counted here
    live = LiveMemory()  # the tensors alone (no allocator caching, no Python heap), as scaletrain measures
    with live:
        t = trainer({"model.preset": "llama-1b", "model.n_layers": args["layers"], "data.seq_len": args["seq"],
                     "model.max_seq_len": args["seq"], "train.global_batch": args["batch"],
                     "train.micro_batch": args["batch"], "train.device": "cpu", **MEMORY_ROWS[args["row"]][1]})
        build_peak = rss_mib()
        reset_peak()
        live.reset_peak()
        built, built_live = rss_mib("VmRSS"), live.live / 2**20
        batches = t.batches()
        t0 = time.perf_counter()
        for _ in range(args["steps"]):
            t.train_step(batches)
        seconds = (time.perf_counter() - t0) / args["steps"]
    print(json.dumps({"before": before, "build_peak": build_peak, "built": built, "peak": rss_mib(),
                      "built_live": built_live, "live_peak": live.peak / 2**20,
                      "params": t.pm.num_params, "trainable": trainable(t.model), "step_s": seconds}))


def memory(args) -> None:
    print(f"llama-1b widths, {args.layers} blocks, batch {args.batch} x {args.seq} tokens, AdamW, fp32, "
          f"{args.steps} steps; peak RSS of one process per row")
    print("MiB: RSS after importing torch; the build's peak; RSS once built; the peak of the training steps, "
          "then less the import's RSS, and that as a share of full fine-tuning's; live tensors once built, "
          "their peak in the steps (scaletrain.measure.LiveMemory) and its share of full's")
    print(f"{'row':<22}{'params':>9}{'trainable':>11}{'import':>8}{'build peak':>11}{'built':>8}"
          f"{'step peak':>10}{'- import':>9}{'vs full':>8}{'tensors':>8}{'peak':>7}{'vs full':>8}{'step':>7}")
    full = full_live = None
    for name in args.rows.split(","):
        spec = json.dumps({"row": name, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                           "steps": args.steps})
        out = subprocess.run([sys.executable, __file__, "_memory_row", spec], capture_output=True, text=True)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        net = r["peak"] - r["before"]
        full = full or net
        full_live = full_live or r["live_peak"]
        print(f"{MEMORY_ROWS[name][0]:<22}{r['params'] / 1e6:>8.1f}M{r['trainable'] / 1e6:>10.2f}M"
              f"{r['before']:>8.0f}{r['build_peak']:>11.0f}{r['built']:>8.0f}{r['peak']:>10.0f}"
              f"{net:>9.0f}{net / full:>8.3f}"
              f"{r['built_live']:>8.0f}{r['live_peak']:>7.0f}{r['live_peak'] / full_live:>8.3f}{r['step_s']:>6.1f}s",
              flush=True)


# ------------------------------------------------------------------------------------------
# speed: scaletrain's LoRA step against PEFT's, interleaved


def speed(args) -> None:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=args.dim, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=args.seq, use_cache=False,
                                      tie_word_embeddings=True)
    folder = tempfile.mkdtemp(prefix="adapters-hf-")
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(folder)

    ours = trainer({"model.from_hf": folder, "model.init_from": folder, "adapter.kind": "lora",
                    "adapter.rank": args.rank, "adapter.alpha": 2 * args.rank, "adapter.targets": "all-linear",
                    "data.seq_len": args.seq, "train.global_batch": args.batch, "train.micro_batch": args.batch,
                    "train.grad_clip": 0, "train.device": "cpu", "optim.weight_decay": 0.0,
                    "train.steps": 10_000})
    batches = ours.batches()
    x, y = next(batches)

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                 target_modules="all-linear"))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=True)
    loss_fn = torch.nn.CrossEntropyLoss()

    def peft_step():
        logits = peft_model(input_ids=x).logits
        loss = loss_fn(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def ours_step():
        ours.train_step(batches)

    print(f"transformers Llama dim {args.dim}, ffn {args.ffn}, {args.layers} layers, 8 / 4 kv heads, vocab 256; "
          f"batch {args.batch} x {args.seq}; LoRA r {args.rank} alpha {2 * args.rank} on every block linear; "
          f"AdamW, no clipping, fp32, CPU, {torch.get_num_threads()} thread(s)")
    print(f"trainable: scaletrain {trainable(ours.model):,}, PEFT {sum(p.numel() for p in params):,}")
    for step in (ours_step, peft_step):  # warm-up
        step()
    # wall time, and this process's CPU time (on a shared machine the other sessions' load stretches
    # the wall time while this process waits for a core; its CPU time counts only its own running)
    times = {clock: {"scaletrain": [], "peft": []} for clock in ("wall", "cpu")}
    for rep in range(args.reps):
        order = [("scaletrain", ours_step), ("peft", peft_step)]
        for name, step in order if rep % 2 == 0 else order[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            times["wall"][name].append((time.perf_counter() - t0) / args.steps)
            times["cpu"][name].append((time.process_time() - c0) / args.steps)
    print(f"{'step':<18}{'median':>10}{'min':>10}{'max':>10}   ({args.reps} alternating reps of {args.steps} steps)")
    for clock, sides in times.items():
        for k, v in sides.items():
            print(f"{k + ' ' + clock:<18}{statistics.median(v) * 1e3:>8.1f}ms{min(v) * 1e3:>8.1f}ms"
                  f"{max(v) * 1e3:>8.1f}ms")
    for clock, sides in times.items():
        med = statistics.median(sides["scaletrain"]) / statistics.median(sides["peft"])
        # each repetition's pair ran back to back, under about the same load: their ratios show the spread
        paired = sorted(a / b for a, b in zip(sides["scaletrain"], sides["peft"], strict=True))
        quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        print(f"scaletrain / PEFT, {clock}: {med:.3f} (medians); each repetition's pair: median "
              f"{statistics.median(paired):.3f}, quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, range "
              f"{paired[0]:.3f}-{paired[-1]:.3f}, {sum(r < 1 for r in paired)} of {len(paired)} below 1")


# ------------------------------------------------------------------------------------------
# quality: pre-train the demo model briefly, fine-tune on a held-out text three ways


def held_out_text() -> tuple[str, str]:
    """The stdlib's json package source, each file's last 15% held out for validation."""
    import json as json_pkg

    train, val = [], []
    for path in sorted(Path(json_pkg.__file__).parent.glob("*.py")):
        text = path.read_text()
        cut = int(len(text) * 0.85)
        train.append(text[:cut])
        val.append(text[cut:])
    return "\n".join(train), "\n".join(val)


def val_loss(model, tokens, seq: int) -> float:
    import torch

    windows = tokens[: len(tokens) // (seq + 1) * (seq + 1)].view(-1, seq + 1)
    model.eval()
    with torch.no_grad():
        logits = model(windows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())
    model.train()
    return loss.item()


def quality(args) -> None:
    import torch
    from safetensors.torch import save_file

    work = Path(tempfile.mkdtemp(prefix="adapters-quality-"))
    train_text, val_text = held_out_text()
    (work / "text").mkdir()
    (work / "text" / "json_train.txt").write_text(train_text)
    subprocess.run([sys.executable, "-m", "scaletrain", "prepare", str(work / "text"), "--out", str(work / "data"),
                    "--tokenizer", "byte", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    val_tokens = torch.tensor(list(val_text.encode()), dtype=torch.long)
    common = {"train.device": "cpu", "train.global_batch": args.batch, "train.micro_batch": args.batch}

    t0 = time.perf_counter()
    pre = trainer({**common, "train.steps": args.pretrain_steps}, config=args.config)
    fit(pre)
    state = {k: v.detach().clone().contiguous() for k, v in pre.model.state_dict().items()}
    base_file = str(work / "base.safetensors")
    save_file({k: v for k, v in state.items() if k != "output.weight" or "tok_emb.weight" not in state}, base_file)
    base_val = val_loss(pre.model, val_tokens, args.seq)
    print(f"demo model ({args.config}), pre-trained {args.pretrain_steps} steps of {args.batch} x 128 on the demo "
          f"corpus ({time.perf_counter() - t0:.0f}s); fine-tuned {args.steps} steps of {args.batch} x {args.seq} "
          f"on the stdlib's json/*.py ({len(train_text):,} bytes), val = each file's last 15% "
          f"({len(val_tokens):,} bytes, {len(val_tokens) // (args.seq + 1)} windows)")
    print(f"{'row':<24}{'trainable':>11}{'lr':>8}{'val loss':>10}{'gain':>8}{'share of full':>15}{'time':>7}")
    print(f"{'base (no fine-tuning)':<24}{'-':>11}{'-':>8}{base_val:>10.4f}{'-':>8}{'-':>15}{'-':>7}")
    rows = [("full fine-tuning", {}, args.lr_full),
            ("LoRA r8 (all-linear)", {"adapter.kind": "lora"}, args.lr_lora),
            ("QLoRA r8, nf4 base", {"adapter.kind": "lora", "adapter.base_dtype": "nf4"}, args.lr_lora)]
    full_gain = None
    for label, extra, lr in rows:
        t0 = time.perf_counter()
        ft = trainer({**common, "model.init_from": base_file, "data.path": str(work / "data"),
                      "data.seq_len": args.seq, "train.steps": args.steps, "optim.lr": lr,
                      "optim.warmup_steps": max(args.steps // 10, 1), **extra}, config=args.config)
        fit(ft)
        v = val_loss(ft.model, val_tokens, args.seq)
        gain = base_val - v
        full_gain = full_gain if full_gain is not None else gain
        print(f"{label:<24}{trainable(ft.model) / 1e6:>10.3f}M{lr:>8.0e}{v:>10.4f}{gain:>8.4f}"
              f"{gain / full_gain:>15.2f}{time.perf_counter() - t0:>6.0f}s", flush=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_memory_row"]:
        return memory_row(argv[1])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--seq", type=int, default=64)
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--steps", type=int, default=2)
    m.add_argument("--rows", default="full,lora,qlora")
    s = sub.add_parser("speed")
    s.add_argument("--dim", type=int, default=256)
    s.add_argument("--ffn", type=int, default=704)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--seq", type=int, default=128)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--rank", type=int, default=8)
    s.add_argument("--reps", type=int, default=8)
    s.add_argument("--steps", type=int, default=2)
    q = sub.add_parser("quality")
    q.add_argument("--config", default="configs/tiny.toml")
    q.add_argument("--pretrain-steps", type=int, default=150)
    q.add_argument("--steps", type=int, default=60)
    q.add_argument("--batch", type=int, default=16)
    q.add_argument("--seq", type=int, default=128)
    q.add_argument("--lr-full", type=float, default=1e-3)
    q.add_argument("--lr-lora", type=float, default=3e-3)
    args = ap.parse_args(argv)
    {"memory": memory, "speed": speed, "quality": quality}[args.part](args)


if __name__ == "__main__":
    main()
