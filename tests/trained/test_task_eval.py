"""Downstream tasks through lm-evaluation-harness: `scaletrain eval CKPT --tasks` scores what lm-eval's own
Hugging Face backend (`--model hf`) scores on `scaletrain export --format hf` of the same checkpoint, request
by request; eval.tasks during training logs the same scores to metrics.jsonl and the trackers, leaves the
training as it was, and gives one process's scores under ZeRO-3 and tensor parallelism; bad input is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is an optional extra: pip install 'scaletrain[eval]'")

from scaletrain.data.prepare import prepare
from scaletrain.errors import ConfigError
from scaletrain.train.downstream import evaluate_tasks, scores, task_names, task_specs
from scaletrain.train.trainer import Trainer

from conftest import CKPT, CORPUS, Case, assert_one_clear_line, micro_cfg, read_metrics, run_group, run_here

TASKS = "scaletrain_choice,scaletrain_complete"
STEPS = 24
# a window of 64 tokens: the generation task's 12 new tokens and its prompts fit whole
RUN = {"model.max_seq_len": 64, "data.seq_len": 32, "model.vocab_size": 0, "train.steps": STEPS,
       "model.dropout": 0.1, "log.every": 6, "checkpoint.every": 12, "eval.tasks": TASKS, "eval.every": 12}


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory) -> Path:
    """A folder of the test corpus with a BPE tokenizer: a vocabulary with <|endoftext|>, words of several bytes."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "corpus.txt").write_text(CORPUS)
    prepare([root / "corpus.txt"], root / "data", tokenizer="bpe", vocab_size=300)
    return root / "data"


@pytest.fixture(scope="module")
def scored_run(bpe_data, tmp_path_factory) -> dict:
    """A run that scored the shipped tasks at steps 12 and 24, with checkpoints there, and the same run
    without the tasks."""
    tmp = tmp_path_factory.mktemp("scored")
    with_tasks = Trainer(micro_cfg(tmp / "with", **RUN, **{"data.path": str(bpe_data)})).fit()
    without = Trainer(micro_cfg(tmp / "without", **{**RUN, "eval.every": 0, "data.path": str(bpe_data)})).fit()
    return {"with": with_tasks, "without": without, "run": Path(with_tasks["run_dir"]), "data": bpe_data}


def _hf_results(hf_dir: Path, batch_size: int) -> dict:
    """lm-eval's own Hugging Face backend on a model folder, on the shipped tasks, as scaletrain runs them."""
    from lm_eval import simple_evaluate

    from scaletrain.train.downstream import hub, random_state_kept

    names = task_names(TASKS, "tasks")
    specs, manager = task_specs(names, "", "tasks")
    import torch

    with hub(False), random_state_kept(torch.device("cpu")):
        return simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                               tasks=specs, task_manager=manager, batch_size=batch_size, bootstrap_iters=0,
                               log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                               fewshot_random_seed=0)


def _responses(samples: dict) -> dict:
    """{(task, doc_id): the model's answers}: log-likelihoods (and greediness), or generated text."""
    return {(task, s["doc_id"]): [r[0] for r in s["resps"]] for task, rows in samples.items() for s in rows}


@pytest.fixture(scope="module")
def exported(scored_run, tmp_path_factory) -> tuple[Path, Path]:
    """(the run's last checkpoint, its `export --format hf` folder)."""
    ckpt = scored_run["run"] / "checkpoints" / f"step_{STEPS:08d}"
    hf_dir = tmp_path_factory.mktemp("exported") / "hf"
    assert run_here("export", str(ckpt), "--format", "hf", "--out", str(hf_dir)).returncode == 0
    return ckpt, hf_dir


@pytest.mark.slow
def test_scores_equal_lm_evals_hugging_face_backend_on_the_exported_model(exported):
    from scaletrain.trained.task_eval import evaluate_checkpoint_tasks

    ckpt, hf_dir = exported
    ours = evaluate_checkpoint_tasks(ckpt, TASKS, batch_size=3)  # batches that do not divide 11 or 9 requests
    ref = _hf_results(hf_dir, batch_size=4)
    assert ours["tasks"] == {"scaletrain_choice": 11, "scaletrain_complete": 9}
    assert ours["scores"] == scores(ref), (ours["scores"], scores(ref))
    got, want = _responses(ours["samples"]), _responses(ref["samples"])
    assert got.keys() == want.keys() and len(got) == 11 + 9
    assert sum(len(a) for a in want.values()) == 11 * 4 + 9  # a request per choice, one per prompt
    for key, answers in want.items():
        for mine, theirs in zip(got[key], answers, strict=True):
            if isinstance(theirs, str):  # the generated continuation: the same text
                assert mine == theirs, key
            else:  # (log-likelihood, is greedy) of each choice
                assert math.isclose(mine[0], theirs[0], rel_tol=1e-5, abs_tol=1e-5) and mine[1] == theirs[1], key
    # the scores are not trivial: the trained model knows some answers, not all
    assert 0 < ours["scores"]["tasks/scaletrain_choice/acc"] and \
        0 < ours["scores"]["tasks/scaletrain_complete/exact_match/strip"] < 1


def test_long_texts_are_cut_and_rolled_as_by_the_hugging_face_backend(exported):
    """Inputs past the window (64 tokens) cut from the left, and whole texts scored in rolling windows,
    request by request as lm-eval's HFLM scores the exported model."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from scaletrain.train.lm_eval_model import HarnessLM
    from scaletrain.trained.generate import load_for_generation

    ckpt, hf_dir = exported
    model, tok, _ = load_for_generation(ckpt)
    ours = HarnessLM(model.eval(), tok, max_length=64, device=torch.device("cpu"), batch_size=3)
    ref = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=2)
    long = CORPUS[:700]  # about 150 tokens: three windows
    assert len(tok.encode(long)) > 2 * 64
    pairs = [(long, " fox"), (long[:-30], " the lazy dog"), ("the quick", " brown"), ("", long[:100])]
    req = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    for (a, greedy_a), (b, greedy_b) in zip(ours.loglikelihood(req), ref.loglikelihood(req), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4) and greedy_a == greedy_b, (a, b)
    texts = [long, "the quick brown fox", long[:333]]
    rolled = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    for a, b in zip(ours.loglikelihood_rolling(rolled), ref.loglikelihood_rolling(rolled), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4), (a, b)
    until = {"until": ["\n"], "max_gen_toks": 10, "do_sample": False}
    gen = [Instance("generate_until", {}, (c, until), i) for i, c in enumerate([long, "the model", long[:-5]])]
    assert ours.generate_until(gen) == ref.generate_until(gen)
    with pytest.raises(ConfigError, match="a continuation of .* tokens is longer than the model's window of 64"):
        ours.loglikelihood([Instance("loglikelihood", {}, ("the", " " + long), 0)])


def test_a_log_likelihood_is_the_sum_of_the_continuation_tokens_log_probabilities(scored_run):
    """A known answer worked out by hand: one forward of the whole text, the log-softmax of each position
    that predicts a continuation token, added up."""
    import torch
    from lm_eval.api.instance import Instance

    from scaletrain.train.lm_eval_model import HarnessLM
    from scaletrain.trained.generate import load_for_generation

    model, tok, _ = load_for_generation(scored_run["run"] / "checkpoints" / f"step_{STEPS:08d}")
    lm = HarnessLM(model.eval(), tok, max_length=64, device=torch.device("cpu"), batch_size=2)
    pairs = [("the quick brown", " fox"), ("the lazy dog sleeps while the", " model trains"), ("", "the quick")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    eot = tok.separator[0]
    for (context, continuation), (logp, _) in zip(pairs, got, strict=True):
        ctx = tok.encode(context) if context else [eot]  # an empty context: the end-of-text token before it
        cont = tok.encode(context + continuation)[len(ctx):] if context else tok.encode(continuation)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = torch.log_softmax(model(ids[:, :-1]).float(), -1)[0]
        want = sum(float(logits[len(ctx) - 1 + k, t]) for k, t in enumerate(cont))
        assert math.isclose(logp, want, rel_tol=1e-5), (context, logp, want)


def test_in_loop_scores_are_logged_equal_the_checkpoints_and_leave_training_unchanged(scored_run):
    from scaletrain.trained.task_eval import evaluate_checkpoint_tasks

    rows = read_metrics(scored_run["run"])
    logged = {r["step"]: {k: v for k, v in r.items() if k.startswith("tasks/")} for r in rows}
    assert [s for s, v in logged.items() if v] == [12, 24]
    for step in (12, 24):
        ckpt = scored_run["run"] / "checkpoints" / f"step_{step:08d}"
        assert logged[step] == evaluate_checkpoint_tasks(ckpt, TASKS)["scores"], step
    # lm-eval seeds the random generators: put back, the dropout of the next steps draws as without tasks
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in scored_run["with"]["history"]] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in scored_run["without"]["history"]]


def test_in_loop_scores_reach_the_trackers(bpe_data, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    cfg = micro_cfg(tmp_path, **{**RUN, "train.steps": 4, "checkpoint.every": 0, "eval.every": 4,
                                 "eval.tasks": "scaletrain_choice", "eval.limit": 3, "data.path": str(bpe_data),
                                 "log.mlflow": "tasks"})
    history = Trainer(cfg).fit()["history"]
    acc = next(r["tasks/scaletrain_choice/acc"] for r in history if r["step"] == 4)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tasks").experiment_id])[0]
    logged = client.get_metric_history(run.info.run_id, "tasks/scaletrain_choice/acc")
    assert [(m.step, m.value) for m in logged] == [(4, acc)]


def test_the_cli_prints_each_score_and_json(scored_run):
    ckpt = scored_run["run"] / "checkpoints" / f"step_{STEPS:08d}"
    r = run_here("eval", str(ckpt), "--tasks", "scaletrain_choice", "--limit", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tasks"] == {"scaletrain_choice": 5} and set(out["scores"]) == {
        "tasks/scaletrain_choice/acc", "tasks/scaletrain_choice/acc_norm"}
    text = run_here("eval", str(ckpt), "--tasks", "scaletrain_choice", "--limit", "5")
    assert "tasks/scaletrain_choice/acc" in text.stdout and "(5 examples)" in text.stdout


def test_a_task_whose_data_is_on_the_hub_is_refused_in_one_line_unless_allowed(scored_run):
    """The data set of lm-eval's lambada_openai is on the Hugging Face Hub; none is reached here."""
    import torch

    from scaletrain.train.lm_eval_model import HarnessLM
    from scaletrain.trained.generate import load_for_generation

    model, tok, _ = load_for_generation(scored_run["run"] / "checkpoints" / f"step_{STEPS:08d}")
    lm = HarnessLM(model.eval(), tok, max_length=64, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        evaluate_tasks(lm, ["lambada_openai"])
    assert len(e.value.lines) == 1 and "must be downloaded first" in e.value.lines[0] and \
        "lambada_openai" in e.value.lines[0] and "eval.download=true" in e.value.lines[0]


BAD_INPUT = [
    Case("tasks-unknown", ["eval", CKPT, "--tasks", "scaletrain_choise"],
         ("unknown task 'scaletrain_choise'", "did you mean scaletrain_choice", "lm-eval ls tasks")),
    Case("tasks-empty", ["eval", CKPT, "--tasks", " , "], ("--tasks names no task",)),
    pytest.param(Case("tasks-download", ["eval", CKPT, "--tasks", "lambada_openai"],
                      ("--tasks: a task's data set must be downloaded first", "lambada_openai", "--download")),
                 marks=pytest.mark.slow),  # lm-eval's index of its own tasks: seconds
    Case("tasks-include-missing", ["eval", CKPT, "--tasks", "mine", "--include", "nowhere"],
         ("include folder nowhere does not exist",)),
    pytest.param(Case("tasks-in-training-unknown", ["train", "--eval.tasks=nope", "--eval.every=2", "--train.steps=2"],
                      ("eval.tasks: unknown task 'nope'",)), marks=pytest.mark.slow),
    Case("tasks-every-without-tasks", ["train", "--eval.every=2"], ("eval.every=2 scores eval.tasks",)),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[getattr(c, "values", [c])[0].id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)


# ---------------------------------------------------------------------------------------------
# sharded: every rank takes part in each forward and the scores are one process's

LAYOUTS = [("dp2-zero3", {"parallel.zero": 3}), ("tp2", {"parallel.tp": 2})]
SHARDED = {**RUN, "train.steps": 6, "model.dropout": 0.0, "checkpoint.every": 0, "log.every": 1, "eval.every": 3,
           "model.n_heads": 4, "model.tie_embeddings": False, "train.micro_batch": 2}


@pytest.mark.multiproc
@pytest.mark.slow
def test_in_loop_scores_under_zero3_and_tp_equal_one_process(bpe_data, tmp_path):
    from conftest import micro_overrides

    base = {**SHARDED, "data.path": str(bpe_data)}
    jobs = [{"overrides": micro_overrides(tmp_path / n, **{**base, **e})} for n, e in LAYOUTS]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    one = Trainer(micro_cfg(tmp_path / "one", **base)).fit()["history"]
    want = {r["step"]: {k: v for k, v in r.items() if k.startswith("tasks/")} for r in one if r["step"] in (3, 6)}
    assert all(want.values())
    for (name, _), result in zip(LAYOUTS, results, strict=True):
        got = {r["step"]: {k: v for k, v in r.items() if k.startswith("tasks/")} for r in result["history"]
               if r["step"] in (3, 6)}
        assert got == want, name


@pytest.mark.parametrize("axis", ["pp", "cp"])
def test_tasks_during_training_with_pipeline_or_context_parallelism_are_refused_in_one_line(axis):
    """Each rank holds a pipeline stage, or chunks of a window: none has every position's logits."""
    from scaletrain.config import load_config
    from scaletrain.layout import Layout
    from scaletrain.legality import Techniques, job_errors

    cfg = load_config(None, {"eval.tasks": "scaletrain_choice", "eval.every": 10})
    layout = Layout(**{axis: 2})
    errors = job_errors(layout, cfg.model, Techniques.of(cfg), seq_len=cfg.data.seq_len)
    refusals = [e for e in errors if e.startswith("eval.tasks")]
    assert len(refusals) == 1 and refusals[0].startswith(f"eval.tasks with parallel.{axis}=2:") and \
        "`scaletrain eval CKPT --tasks ...`" in refusals[0]
    off = load_config(None, {"eval.tasks": "scaletrain_choice", "eval.every": 0})  # at the end only: by eval
    assert not [e for e in job_errors(layout, off.model, Techniques.of(off), seq_len=off.data.seq_len)
                if e.startswith("eval.tasks")]
