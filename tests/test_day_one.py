"""Day one (issue 23): what a new user trips over, each point tested as the user meets it —
through the CLI (in this process where no ranks start), on real files, with real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scaletrain import hardware
from scaletrain.train.metrics import MetricsLogger, StepMeter

from conftest import MICRO, REPO, read_metrics, run_cli, run_here

MICRO_ARGS = [f"--{key}={value}" for key, value in MICRO.items()]


# --------------------------------------------------------------------------------------------
# Wrong numbers: the planner


def test_zero2_under_accumulation_counts_sharded_gradients():
    """The README's planner example: ZeRO-2 at 4Ψ + 12Ψ/N, although 8 micro-steps accumulate."""
    r = run_here("plan", "llama-8b", "--hardware", "H100-SXM", "--nodes", "1", "--gpus-per-node", "8",
                 "--seq-len", "8192", "--global-batch", "64")
    assert r.returncode == 0, r.stderr
    psi = 8_030_261_248
    states = (4 * psi + 12 * psi / 8) / 2**30
    assert f"model states alone {states:.1f} GiB" in r.stdout, r.stdout  # 41.1 GiB, not 67.3
    # the README shows what it prints today
    readme = (REPO / "README.md").read_text()
    best = next(line for line in r.stdout.splitlines() if line.startswith("ZeRO-3 because"))
    assert best.split(";")[0] in readme
    first = next(line for line in r.stdout.splitlines() if line.startswith("  1  "))
    assert " ".join(first.split()) in " ".join(readme.split())
    # a fixed ZeRO-2 layout under accumulation: gradient shards, as without accumulation
    args = ["plan", "llama-8b", "--hardware", "H100-SXM", "--seq-len", "4096", "--zero", "2", "--json"]
    one = json.loads(run_here(*args, "--global-batch", "8", "--micro-batch", "1").stdout)["layouts"][0]
    eight = json.loads(run_here(*args, "--global-batch", "64", "--micro-batch", "1").stdout)["layouts"][0]
    assert eight["layout"]["grad_accum"] == 8 and one["layout"]["grad_accum"] == 1
    assert eight["memory"]["grads"] == one["memory"]["grads"] == pytest.approx(4 * psi / 8, rel=0.01)


def test_when_nothing_fits_the_leanest_leads_and_the_exit_code_is_1():
    r = run_here("plan", "llama-8b", "--hardware", "RTX-4090", "--gpus-per-node", "1")
    assert r.returncode == 1
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\s+\d+\s{2}", line)]
    totals = [float(row[row.index("NO") - 1]) for row in rows]
    assert totals == sorted(totals)  # leanest first
    assert "No layout fits: the leanest (mb 1x256, ac full) needs 129.8 GiB per rank" in r.stdout, r.stdout
    fixed = run_here("plan", "llama-8b", "--hardware", "RTX-4090", "--gpus-per-node", "1", "--micro-batch", "1",
                     "--ac", "full")
    assert fixed.returncode == 1 and "needs 129.8 GiB per rank" in fixed.stdout


def test_a_fixed_key_keeps_searching_the_others():
    """--zero 2 alone derives micro-batch 32 without checkpointing; the planner then searches the
    layouts that keep zero 2 and prints the options of the fastest that fits."""
    base = ["plan", "llama-8b", "--hardware", "RTX-4090"]
    r = run_here(*base, "--zero", "2")
    assert r.returncode == 1
    assert "dp 8 zero2, mb 32x1: needs 586.3 GiB" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("Keeping parallel.zero=2, "))
    options = line.split(" that keep them: ")[1].split()
    assert "--memory.activation_checkpointing=full" in options
    fits = run_here(*base, "--zero", "2", *options)
    assert fits.returncode == 0, fits.stdout
    assert "fits" in fits.stdout.splitlines()[-1]
    # nothing that keeps the keys fits: the leanest of them, said so
    r = run_here(*base, "--gpus-per-node", "2", "--zero", "2", "--micro-batch", "8")
    assert r.returncode == 1
    assert "No layout that keeps train.micro_batch=8, parallel.zero=2 fits: the leanest of" in r.stdout


def test_offloaded_states_are_checked_against_the_nodes_ram(tmp_path):
    r = run_here("plan", "llama-70b", "--hardware", "RTX-4090", "--top", "3")
    assert r.returncode == 1
    assert "in host memory (offload)" in r.stdout and "— DOES NOT FIT" in r.stdout
    assert "of host memory per GPU for the offloaded model states" in r.stdout
    hw = tmp_path / "hw.toml"
    hw.write_text('[[hardware]]\nname = "big-4090"\nmemory_GB = 24\nhost_memory_GB = 4096\n'
                  'peak_tflops = {fp32 = 82.6, bf16 = 165.2}\nmemory_GBps = 1008\nintra_node_GBps = 32\n'
                  'inter_node_GBps = 12.5\nefficiency = 0.65\n')
    r = run_here("plan", "llama-70b", "--hardware", "big-4090", "--hardware-file", str(hw), "--top", "3")
    assert r.returncode == 0, r.stdout
    assert "offload" in r.stdout.splitlines()[4]  # the best layout offloads, into RAM that holds it
    # the explanation no longer hides the host's share behind "model states 0.0 GiB"
    assert "offloaded to host memory" in r.stdout or "ZeRO-3 because" not in r.stdout


# --------------------------------------------------------------------------------------------
# Wrong numbers: MFU and memory in the progress line


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "_cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "cpu_peak.json"


def test_cpu_peak_is_probed_on_the_shared_cores_and_no_run_changes_it(peak_cache, monkeypatch, tmp_path):
    threads = []

    def probe(device, dtype):
        threads.append(torch.get_num_threads())
        return 1e6  # 1 MFLOP/s: every training step beats it

    monkeypatch.setattr(hardware, "measure_matmul_peak", probe)
    before = torch.get_num_threads()
    r = run_here("train", *MICRO_ARGS, "--train.steps=3", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert threads == [hardware.cpu_cores()] and torch.get_num_threads() == before
    assert list(json.loads(peak_cache.read_text()).values()) == [1e6]  # not raised by the run
    assert "MFU is measured against the CPU's fp32 matmul peak on its" in r.stderr
    assert "1.0 MFLOP/s" in r.stderr
    rows = read_metrics(tmp_path / "run")
    assert all(row["mfu"] > 1 for row in rows)  # honest against that peak: the same figure every run
    r2 = run_here("train", *MICRO_ARGS, "--train.steps=3", f"--log.run_dir={tmp_path / 'run2'}")
    assert r2.returncode == 0 and threads == [hardware.cpu_cores()]  # cached: probed once


def test_ranks_on_one_cpu_share_its_peak(peak_cache, monkeypatch):
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda device, dtype: 2e11)
    rt = SimpleNamespace(device=torch.device("cpu"), world_size=2, local_world_size=2, distributed=False)
    meter = StepMeter(rt, tokens_per_step=1000, flops_per_token=1e6, compute_dtype=torch.float32, tf32=False,
                      enter=lambda phase: None)
    assert meter.peak_flops == 1e11  # each rank's share of the CPU, not 2 × a one-thread peak
    assert "200.0 GFLOP/s, shared by the 2 ranks on it" in meter.peak_source


def test_progress_line_and_summary_say_what_memory_counts_in_mib(tmp_path):
    r = run_here("train", *MICRO_ARGS, "--train.steps=2", f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    step = next(line for line in r.stderr.splitlines() if line.startswith("step 2/2"))
    peak = read_metrics(tmp_path / "run")[-1]["peak_mem_bytes"]
    assert f"rss {peak / 2**20:.1f} MiB" in step, step
    assert "MB" not in step
    summary = next(line for line in r.stderr.splitlines() if line.startswith("peak memory"))
    assert summary.endswith(f"{peak / 2**20:.1f} MiB (the process's peak RSS: tensors, the Python and torch "
                            "runtime, buffers)")


# --------------------------------------------------------------------------------------------
# The summary after a signal, and what goes to stdout


@pytest.mark.slow
def test_summary_after_a_signal_reports_the_step_it_stopped_at_on_stdout_too(tmp_path):
    """Ctrl-C between logged rows: the summary says the step the run stopped (and saved) at, not
    the last logged row; `train ... > out.txt` keeps the summary (stderr stays the whole log)."""
    run_dir = tmp_path / "run"
    out_file = tmp_path / "out.txt"
    args = [sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--train.steps=100000", "--log.every=1000",
            f"--log.run_dir={run_dir}"]
    with out_file.open("w") as out:
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 120
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():  # step 1 logged
            time.sleep(0.1)
        time.sleep(1.0)  # some steps past it, none logged
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    stopped = int(re.search(r"stopped by SIGINT after step (\d+)", err).group(1))
    assert stopped > 1
    rows = read_metrics(run_dir)
    assert rows[-1]["step"] == stopped  # the step it stopped at is logged
    summary = out_file.read_text()
    assert re.search(rf"^steps\s+{stopped}$", summary, re.M), summary
    assert re.search(rf"^final loss\s+{rows[-1]['loss']:.4f}$", summary, re.M), summary
    assert f"step_{stopped:08d}" in summary
    assert "step 1/" not in summary and "steps" in err  # progress stays on stderr, the summary is in both


# --------------------------------------------------------------------------------------------
# Resume and schedule


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of the micro model that ended at step 4 with a checkpoint (and its validation loss)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = run_here("train", *MICRO_ARGS, "--train.steps=4", "--checkpoint.save_final=true", f"--log.run_dir={run}")
    assert r.returncode == 0, r.stderr
    return run


def copy_run(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    config = json.loads((to / "config.json").read_text())
    config["log"]["run_dir"] = str(to)  # the copy is its own run folder
    (to / "config.json").write_text(json.dumps(config))
    return to


def test_resume_from_the_run_folder_alone(finished_run, tmp_path):
    """No config typed again: the run's config.json is the base, the options given go on top and
    are checked against the checkpoint; the schedule's change is said in one line."""
    run = copy_run(finished_run, tmp_path / "run")
    r = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=6")
    assert r.returncode == 0, r.stderr
    assert f"config: the run's own ({run / 'config.json'}), with train.steps=6, checkpoint.resume=auto" in r.stderr
    assert "resumed from" in r.stderr and "at step 4" in r.stderr
    rows = read_metrics(run)
    assert rows[-1]["step"] == 6 and json.loads((run / "config.json").read_text())["model"]["dim"] == 64
    # the learning-rate schedule changed with train.steps: said, with the lr step 5 trains at
    line = next(x for x in r.stderr.splitlines() if "the learning-rate schedule changed" in x)
    assert "(train.steps 4 -> 6)" in line
    said = float(re.search(r"so step 5 trains at lr ([0-9.e+-]+)", line).group(1))
    step5 = next(row for row in read_metrics(run) if row["step"] == 5) if any(
        row["step"] == 5 for row in rows) else None
    assert step5 is not None and step5["lr"] == pytest.approx(said, rel=1e-2)
    # an explicit option that changes the model is checked against the checkpoint
    bad = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=8", "--model.dim=96")
    assert bad.returncode == 2 and "saved for another model shape: dim=64 (now 96)" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    # the same run continued unchanged says nothing about the schedule
    same = run_here("train", f"--log.run_dir={run}", "--checkpoint.resume=auto", "--train.steps=6")
    assert same.returncode == 0 and "schedule changed" not in same.stderr


def test_a_checkpoint_folder_alone_resumes_too_and_config_json_is_a_config(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    step = run / "checkpoints" / "step_00000004"
    r = run_here("train", f"--checkpoint.resume={step}", f"--log.run_dir={run}", "--train.steps=5")
    assert r.returncode == 0, r.stderr
    assert f"the run's own ({step / 'trainer.json'})" in r.stderr
    r = run_here("train", "--config", str(run / "config.json"), "--checkpoint.resume=auto", "--train.steps=6")
    assert r.returncode == 0, r.stderr
    assert read_metrics(run)[-1]["step"] == 6


def test_print_config_writes_toml_that_reads_back(finished_run, tmp_path):
    from scaletrain.config import load_config

    r = run_here("train", "--config", str(finished_run / "config.json"), "--print-config=toml",
                 '--train.sample_prompt=a "quoted"\\ prompt', "--optim.lr=1e-05")
    assert r.returncode == 0, r.stderr
    (tmp_path / "c.toml").write_text(r.stdout)
    again = load_config(tmp_path / "c.toml")
    assert again == load_config(finished_run / "config.json", {"train.sample_prompt": 'a "quoted"\\ prompt',
                                                               "optim.lr": 1e-5})
    json_out = run_here("train", "--config", str(tmp_path / "c.toml"), "--print-config")
    assert json.loads(json_out.stdout) == again.to_dict()


@pytest.mark.slow
def test_fine_tuning_weights_of_another_tokenizer_is_one_line(tmp_path):
    """A BPE export fine-tuned on byte-level data: refused before training, in one line."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(400)))
    assert run_here("prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "bpe"), "--tokenizer", "bpe",
                    "--vocab-size", "300").returncode == 0
    common = [*MICRO_ARGS, "--train.eval_every=0", "--train.steps=1", "--checkpoint.save_final=true"]
    r = run_here("train", *common, f"--data.path={tmp_path / 'bpe'}", "--model.vocab_size=0",
                 f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert run_here("export", str(step), "--format", "hf", "--out", str(tmp_path / "exp")).returncode == 0
    tune = ["train", *common, f"--model.from_hf={tmp_path / 'exp'}", f"--model.init_from={tmp_path / 'exp'}"]
    r = run_here(*tune, f"--log.run_dir={tmp_path / 'tuned'}")  # on the built-in byte-level data
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "was trained with another tokenizer (a vocabulary of 300 tokens) than data.path the built-in data " \
           "(byte-level, 256 tokens)" in r.stderr
    fix = re.search(r"\(scaletrain prepare INPUT\.\.\. --out NEW_FOLDER --tokenizer (\S+)\)", r.stderr).group(1)
    assert run_here("prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "same"), "--tokenizer",
                    fix).returncode == 0
    r = run_here(*tune, f"--data.path={tmp_path / 'same'}", f"--log.run_dir={tmp_path / 'tuned2'}")
    assert r.returncode == 0, r.stderr  # the export's own tokenizer: accepted
    # and a scaletrain safetensors export records its tokenizer, so a single file is checked too
    assert run_here("export", str(step), "--out", str(tmp_path / "m.safetensors")).returncode == 0
    r = run_here("train", *common, f"--model.from_hf={tmp_path / 'exp'}",
                 f"--model.init_from={tmp_path / 'm.safetensors'}", f"--log.run_dir={tmp_path / 'tuned3'}")
    assert r.returncode == 2 and "another tokenizer" in r.stderr


# --------------------------------------------------------------------------------------------
# Export and eval


def test_eval_and_export_take_a_run_folder_and_config_names(finished_run, tmp_path):
    newest = finished_run / "checkpoints" / "step_00000004"
    r = run_here("eval", str(finished_run))
    assert r.returncode == 0, r.stderr
    assert f"its newest complete checkpoint is {newest}" in r.stderr
    logged = read_metrics(finished_run)[-1]["val_loss"]
    assert r.stdout.startswith(f"val_loss {logged:.4f}")
    by_name = run_here("eval", str(finished_run), "--data.path=", "--train.eval_batches=1", "--train.device=cpu")
    by_alias = run_here("eval", str(finished_run), "--data", "", "--batches", "1", "--device", "cpu")
    assert by_name.returncode == 0 and by_name.stdout == by_alias.stdout
    typo = run_here("eval", str(finished_run), "--data.paths=x")
    assert typo.returncode == 2 and "(did you mean --data.path?)" in typo.stderr
    assert len(typo.stderr.strip().splitlines()) == 1


def test_export_creates_folders_follows_the_umask_and_overwrites_on_request(finished_run, tmp_path):
    old = os.umask(0o027)
    try:
        out = tmp_path / "exp" / "sub" / "model.safetensors"
        r = run_here("export", str(finished_run), "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert out.stat().st_mode & 0o777 == 0o640
        again = run_here("export", str(finished_run), "--out", str(out))
        assert again.returncode == 2 and "add --overwrite to replace it" in again.stderr
        out.write_bytes(b"stale")
        assert run_here("export", str(finished_run), "--out", str(out), "--overwrite").returncode == 0
        assert out.stat().st_size > 1000 and out.stat().st_mode & 0o777 == 0o640
        hf = tmp_path / "exp" / "hf"
        assert run_here("export", str(finished_run), "--format", "hf", "--out", str(hf)).returncode == 0
        (hf / "stale.txt").write_text("old")
        assert run_here("export", str(finished_run), "--format", "hf", "--out", str(hf)).returncode == 2
        assert run_here("export", str(finished_run), "--format", "hf", "--out", str(hf), "--overwrite").returncode == 0
        assert not (hf / "stale.txt").exists()  # replaced whole
        assert {f.stat().st_mode & 0o777 for f in hf.iterdir()} == {0o640}
        assert not [p for p in hf.parent.iterdir() if p.name.startswith(".")]  # nothing left aside
    finally:
        os.umask(old)


def test_a_gpt2_export_states_the_datas_special_ids(finished_run, tmp_path):
    """Byte-level data has no end-of-text token: the config says none (not GPT-2's 50256, an id
    outside the 256-token vocabulary), and transformers reads it so."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    step = finished_run / "checkpoints" / "step_00000004"
    assert run_here("export", str(step), "--format", "hf", "--out", str(out)).returncode == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 256
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert loaded.bos_token_id is None and loaded.eos_token_id is None
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] is None


# --------------------------------------------------------------------------------------------
# Names and messages across commands


def test_schedule_takes_the_config_names():
    short = run_here("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved-1f1b",
                     "--virtual", "2")
    named = run_here("schedule", "--parallel.pp=4", "--parallel.pp_microbatches=8",
                     "--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_virtual_stages=2")
    assert short.returncode == named.returncode == 0, named.stderr
    assert named.stdout == short.stdout and "interleaved-1f1b: 4 stages" in named.stdout


def test_did_you_mean_for_verbs_and_launcher_flags_and_a_version():
    r = run_here("trian")
    assert r.returncode == 2 and r.stderr.count("scaletrain") <= 3  # no "scaletrain: error: scaletrain:"
    assert "scaletrain: error: scaletrain:" not in r.stderr and "(did you mean train?)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_here("train", "--nprocs", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'--nprocs' (did you mean --nproc?)" in r.stderr
    r = run_here("--version")
    assert r.returncode == 0 and re.fullmatch(r"scaletrain \S+ \(torch \S+, python \S+\)\n", r.stdout), r.stdout


def test_raw_text_folder_gets_a_prepare_command_that_works(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "some plain text to train on. " * 40)
    (tmp_path / "corpus-tokens").mkdir()  # a name already taken: the suggestion avoids it
    r = run_here("train", *MICRO_ARGS, f"--data.path={corpus}", "--train.eval_every=0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    command = re.search(r"`scaletrain (prepare [^`]+)`", r.stderr).group(1).split()
    data = re.search(r"then train with --data.path=(\S+)", r.stderr).group(1)
    assert command == ["prepare", str(corpus), "--out", str(tmp_path / "corpus-tokens-2")]
    assert data == str(tmp_path / "corpus-tokens-2")
    assert run_here(*command).returncode == 0  # the command as printed
    r = run_here("train", *MICRO_ARGS, f"--data.path={data}", "--train.eval_every=0", "--train.steps=1",
                 f"--log.run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr


def test_no_config_is_the_demo_run():
    from scaletrain.config import load_config

    r = run_here("train", "--print-config")
    assert r.returncode == 0
    assert json.loads(r.stdout) == load_config(REPO / "configs" / "tiny.toml").to_dict()
    # its global batch is the demo's, whatever the number of ranks: 64 ranks do not divide 32 (no launch)
    r = run_here("train", "--nproc", "64", "--train.device=cpu")
    assert r.returncode == 2 and "train.global_batch=32" in r.stderr, r.stderr


def test_prepare_worker_without_a_launcher_is_one_process(monkeypatch, tmp_path):
    from scaletrain.config import load_config
    from scaletrain.runtime import prepare_worker
    from scaletrain.train.trainer import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(REPO / "configs" / "tiny.toml", {**MICRO, "train.steps": 2, "log.run_dir": str(tmp_path / "r")})
    cfg, rt = prepare_worker(cfg)  # the README's snippet, under plain python
    assert rt.world_size == 1 and not rt.distributed
    assert Trainer(cfg, rt).fit()["step"] == 2


def test_auto_layout_on_a_cpu_predicts_no_throughput(tmp_path):
    r = run_here("train", *MICRO_ARGS, "--train.steps=1", "--parallel.layout=auto", f"--log.run_dir={tmp_path / 'r'}")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "parallel.layout=auto chose" in x)
    assert "tokens/s," not in line and "on a CPU it predicts no tokens/s" in line


@pytest.mark.slow
def test_more_ranks_than_cores_is_said_in_one_line(tmp_path):
    """On one core, --nproc 2 oversubscribes it: one line says so, and the job runs."""
    r = subprocess.run([sys.executable, "-m", "scaletrain", "train", *MICRO_ARGS, "--train.steps=1", "--nproc", "2",
                        f"--log.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert r.returncode == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if "oversubscribed" in x]
    assert notes == ["scaletrain: 2 ranks on 1 CPU core(s): oversubscribed, the ranks take turns on the cores and "
                     "each step is slower than with --nproc 1"], r.stderr


@pytest.mark.slow
def test_ctrl_c_while_torch_is_imported_is_one_line(tmp_path):
    """A SIGINT that lands in `import torch` (seconds on a cold start): one line, exit 130."""
    fake = tmp_path / "slow" / "torch"
    fake.mkdir(parents=True)
    started = tmp_path / "importing"
    (fake / "__init__.py").write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "slow"), str(REPO / "src")])}
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "train", "--train.steps=1"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert started.exists(), proc.stderr.read() if proc.poll() is not None else "torch was never imported"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == ["scaletrain: stopped by SIGINT"], err


def test_the_demo_config_ships_inside_the_package():
    from scaletrain.config import DEMO_CONFIG, read_config_file

    assert read_config_file(DEMO_CONFIG) == read_config_file(REPO / "configs" / "tiny.toml")
    assert "demo.toml" in (REPO / "pyproject.toml").read_text()  # package data: installed with scaletrain
