"""RL training in one process (issue 50), on recorded rollouts (rl.rollouts): the trainer's loss and gradients
against the loss written out by hand (code that shares none of the trainer's), for each algorithm's
aggregation, with μ = 2 updates a round and a KL to the reference; the rows a round becomes; replay exactly
what was recorded; bad input in one line."""

from __future__ import annotations

import copy
import json
import random
import re

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.objectives.rl_data import Completion, RolloutRecord, to_rows
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, one_line_exit_2, read_metrics, run_here

G = 4
RL = {"train.objective": "rl", "train.global_batch": 12, "train.micro_batch": 3, "train.steps": 4,
      "optim.warmup_steps": 1, "optim.lr": 1e-2, "rl.group_size": G, "rl.max_new_tokens": 12,
      "rl.rewards": "answer_match*1.0", "rl.reward_args": json.dumps({"answer_match": {"extractor": "last_number"}}),
      "rl.temperature": 0.7}


def write_prompts(path, n: int = 10, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        rows.append({"prompt": f"{a}+{b}=" + " " * rng.randint(0, 3), "answer": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def write_record(path, rows: list[dict], rounds: int, batch: int, seed: int = 0, group: int = G) -> None:
    """Made-up rollouts of `rounds` rounds: `batch` completions a round, G per prompt, of uneven lengths, some
    with the right answer (so that groups' rewards differ), some cut by the length limit; the rollout's log-probs
    near an untrained byte model's (-ln 256), so that importance weights are neither 0 nor capped."""
    rng = random.Random(seed)
    record = RolloutRecord(path)
    for r in range(rounds):
        out = []
        for g in range(batch // group):
            p = (r * 7 + g * 3) % len(rows)
            for k in range(group):
                text = rows[p]["answer"] if (k + g) % 3 == 0 else str(rng.randint(0, 99))
                text = text[: rng.randint(1, 3)]
                ids = list(text.encode()) + [rng.randint(97, 122) for _ in range(rng.randint(0, 8))]
                out.append(Completion(p, list(rows[p]["prompt"].encode()), ids,
                                      [-5.545 + 0.2 * (rng.random() - 0.5) for _ in ids], finished=rng.random() < 0.8))
        record.write(r, out)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    rows = write_prompts(root / "prompts.jsonl")
    write_record(root / "rollouts.jsonl", rows, rounds=4, batch=12)
    return {"prompts": str(root / "prompts.jsonl"), "rollouts": str(root / "rollouts.jsonl"), "rows": rows}


def cfg_for(tmp_path, task, **extra):
    return micro_cfg(tmp_path, **{**RL, "rl.prompts": task["prompts"], "rl.rollouts": task["rollouts"], **extra})


def token_logps(model, c: Completion, temperature: float) -> torch.Tensor:
    """log p(token) / temperature's softmax of each completion token, from the full unpadded sequence."""
    seq = torch.tensor(c.prompt_ids + c.completion_ids)
    logits = model(seq[None, :-1])[0].float() / temperature
    logp = logits.log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
    return logp[len(c.prompt_ids) - 1:]


def by_hand(policy, old, reference, completions, rows, *, aggregation, scaling, eps_low, eps_high, beta, temperature,
            max_new):
    """GRPO's family written out: rewards (the last number of the completion equals the answer), advantages
    within each group of G, PPO's clipped ratio to the old policy and k3 to the reference, per token, then
    each algorithm's aggregation over the whole batch."""
    rewards = []
    for c in completions:
        numbers = re.findall(r"\d+(?:\.\d+)?", bytes(c.completion_ids).decode("utf-8", "replace"))
        rewards.append(float(bool(numbers) and float(numbers[-1]) == float(rows[c.prompt]["answer"])))
    r = torch.tensor(rewards).view(-1, G)
    adv = r - r.mean(1, keepdim=True)
    if scaling == "group":
        adv = adv / (r.std(1, keepdim=True) + 1e-4)
    adv = adv.flatten()
    per_seq, tokens = [], 0
    for i, c in enumerate(completions):
        lp = token_logps(policy, c, temperature)
        with torch.no_grad():
            lp_old = token_logps(old, c, temperature)
            lp_ref = token_logps(reference, c, temperature)
        ratio = torch.exp(lp - lp_old)
        loss = -torch.minimum(ratio * adv[i], ratio.clamp(1 - eps_low, 1 + eps_high) * adv[i])
        loss = loss + beta * (torch.exp(lp_ref - lp) - (lp_ref - lp) - 1)
        per_seq.append(loss)
        tokens += lp.numel()
    if aggregation == "sequence":
        return torch.stack([s.mean() for s in per_seq]).mean()
    if aggregation == "token":
        return torch.cat(per_seq).sum() / tokens
    return torch.cat(per_seq).sum() / (len(per_seq) * max_new)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo"])
def test_the_second_update_of_a_round_equals_the_loss_written_out(tmp_path, task, algorithm):
    """μ = 2: the second step of a round trains on the first's rollouts with the policy moved by one update, so
    the ratio to the old policy and the KL to the reference are not 1 and 0; micro-batches of 3 over 12 rows of
    uneven lengths (a per-micro-batch mean would differ)."""
    t = Trainer(cfg_for(tmp_path, task, **{"rl.algorithm": algorithm, "rl.updates": 2, "rl.beta": 0.2,
                                           "rl.dynamic_sampling": "off"}))
    model = t.pm.dp.module
    start = copy.deepcopy(model)
    batches = t.batches()
    t.train_step(batches)
    t.state.step += 1
    t.hooks.begin_step(t.loss_factor())
    loss_value, _ = t.forward_backward(batches)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    completions = RolloutRecord(task["rollouts"]).read(0)
    s = t.cfg.rl.settings()
    want = by_hand(model, start, start, completions, task["rows"], aggregation=s["aggregation"],
                   scaling=s["advantage_scaling"], eps_low=0.2, eps_high=s["eps_high"], beta=0.2, temperature=0.7,
                   max_new=12)
    want.backward()
    assert float(loss_value.detach()) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-7)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
    assert any(float(p.grad.abs().max()) > 0 for p in model.parameters())


def test_rows_hold_targets_on_completion_tokens_only():
    c = Completion(0, [5, 6, 7], [8, 9], [-0.5, -0.25], finished=False)
    rows = to_rows([c], seq_len=6)
    assert rows["inputs"][0].tolist() == [5, 6, 7, 8, 0, 0]
    assert rows["targets"][0].tolist() == [-100, -100, 8, 9, -100, -100]
    assert rows["rollout_logps"][0].tolist() == [0, 0, -0.5, -0.25, 0, 0]
    assert rows["lengths"].tolist() == [2]
    assert to_rows([c], seq_len=6, mask_truncated=True)["targets"][0].tolist() == [-100] * 6


def test_a_run_replays_and_logs_the_rl_metrics(tmp_path, task):
    t = Trainer(cfg_for(tmp_path, task, **{"rl.algorithm": "dapo"}))
    t.fit()
    rows = read_metrics(t.folder.run_dir)
    assert len(rows) == 4
    for key in ("reward", "reward_std", "pass_rate", "clip_ratio/region", "entropy", "logprob_gap",
                "completions/mean_length", "rewards/answer_match", "rewards/answer_match_std"):
        assert key in rows[0], key
    # the rewards of the recorded round 0, by hand
    completions = RolloutRecord(task["rollouts"]).read(0)
    assert rows[0]["completions/mean_length"] == pytest.approx(sum(len(c.completion_ids) for c in completions) / 12)


@pytest.mark.parametrize("extra, fragment", [
    ({"rl.group_size": 1}, "needs 2 or more"),
    ({"rl.max_new_tokens": 40}, "leaves no room for a prompt"),
    ({"rl.rewards": "no_such_module_x:f"}, "does not import"),
    ({"rl.reward_args": "{not json"}, "not a JSON object"),
    ({"rl.group_size": 5}, "multiple of dp x group_size"),
])
def test_bad_rl_settings_are_one_line(tmp_path, task, extra, fragment):
    with pytest.raises(ConfigError) as e:
        Trainer(cfg_for(tmp_path, task, **extra))
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_a_reward_that_needs_an_argument_or_a_field_is_one_line_exit_2(tmp_path, task):
    base = {**RL, "rl.prompts": task["prompts"], "rl.rollouts": task["rollouts"], "log.run_dir": str(tmp_path / "r")}
    args = [f"--{k}={v}" for k, v in base.items()]
    one_line_exit_2(run_here("train", *args, "--rl.rewards=overlong_penalty"), "needs the argument")
    one_line_exit_2(run_here("train", *args, "--rl.rewards=tests_rl_rewards:needs_level"), "does not import")


def test_the_reference_of_adapters_off_is_the_frozen_starting_copy(tmp_path, task):
    """Under LoRA (B starts at 0) the base with the adapters off is the starting policy: rl.reference=adapters and
    rl.reference=model give the same run, over two rounds (the second's reference is not the moved policy)."""
    runs = {}
    for mode in ("adapters", "model"):
        t = Trainer(cfg_for(tmp_path / mode, task, **{"adapter.kind": "lora", "rl.beta": 0.5, "rl.reference": mode,
                                                      "rl.updates": 1, "optim.lr": 5e-2}))
        t.fit()
        runs[mode] = read_metrics(t.folder.run_dir)
    assert max(r["kl"] for r in runs["model"]) > 1e-6
    for a, b in zip(runs["adapters"], runs["model"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-8)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("cut", [1, 2])
def test_an_rl_run_resumes_bitwise_inside_a_round_and_at_its_end(tmp_path, task, cut):
    """μ = 2, stopped after step 1 (inside round 0: its rollouts come back from the run folder) or step 2 (at a
    round's end): the later steps' losses and gradient norms as in one go, with the reference rebuilt."""
    from conftest import run_until

    extra = {"rl.updates": 2, "rl.beta": 0.2}
    whole = Trainer(cfg_for(tmp_path / "whole", task, **extra)).fit()["history"]
    cfg = cfg_for(tmp_path / "cut", task, **extra, **{"checkpoint.resume": "auto"})
    run_until(cfg, cut)
    resumed = Trainer(cfg).fit()["history"]
    for key in ("loss", "grad_norm", "kl"):
        assert [r[key] for r in resumed if r["step"] > cut] == [r[key] for r in whole if r["step"] > cut], key


def test_prompts_without_the_field_a_reward_reads_are_one_line(tmp_path, task):
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in task["rows"]))
    with pytest.raises(ConfigError) as e:
        Trainer(cfg_for(tmp_path, task, **{"rl.prompts": str(bare)}))
    assert "needs the field(s) answer, which the prompt dataset lacks" in str(e.value)


def test_a_sampled_run_exports_and_its_metrics_split_sampling_from_training(tmp_path, task):
    """Sampling from the policy (no replay): the rollouts' time and rate logged apart; the run exports like any
    other (the export's logits are the trained model's)."""
    from scaletrain.trained.export import export_safetensors, load_model_from_checkpoint

    t = Trainer(cfg_for(tmp_path, task, **{"rl.rollouts": "", "rl.rewards": "scaletrain.bench.rl_task:ascii_share",
                                           "rl.reward_args": "", "rl.max_new_tokens": 6, "train.steps": 2,
                                           "checkpoint.save_final": True}))
    t.fit()
    row = read_metrics(t.folder.run_dir)[-1]
    assert row["time/generated_tokens"] > 0 and row["time/generation_tokens_per_s"] > 0
    assert 0 < row["completions/mean_length"] <= 6
    ckpt = t.folder.ckpt_dir / "step_00000002"
    export_safetensors(ckpt, tmp_path / "rl.safetensors")
    model = load_model_from_checkpoint(ckpt)
    tokens = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(tokens), t.pm.dp.module(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_held_out_reward_is_the_rewards_of_one_completion_of_each_prompt(tmp_path, task, temperature):
    """rl.eval_prompts: greedy, or sampled with the same draws every time; val_reward is the mean of the rewards
    of the completions the engine gives for the prompts, scored here by hand (the graded ASCII share)."""
    from scaletrain.rollout.engine import SamplingParams

    t = Trainer(cfg_for(tmp_path, task, **{"rl.eval_prompts": task["prompts"], "rl.eval_temperature": temperature,
                                           "rl.rewards": "scaletrain.bench.rl_task:ascii_share", "rl.reward_args": "",
                                           "rl.max_new_tokens": 6}))
    first, again = t.objective.evaluate(), t.objective.evaluate()
    assert first == again
    ids = t.objective.val.ids
    out = t.objective.engine().generate(ids, SamplingParams(n=1, max_new_tokens=6, temperature=temperature or 1.0,
                                                            top_k=0 if temperature else 1, seed=0))
    want = sum(sum(x < 128 for x in c) / max(1, len(c)) for c in out.completion_ids) / len(ids)
    assert first["val_reward"] == pytest.approx(want, abs=1e-6)  # (the rewards are float32)
    assert 0 < first["val_reward"] <= 1


def test_the_entropy_metric_is_the_categorical_entropy_of_the_counted_tokens(monkeypatch):
    """counted_entropy against torch.distributions.Categorical, at the sampling temperature, over the counted
    tokens only (uneven per row), in chunks that do not divide them."""
    from scaletrain.objectives import rl as rl_objective

    monkeypatch.setattr(rl_objective, "ENTROPY_ROWS", 3)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 1, 0]], dtype=torch.float32)
    got = rl_objective.counted_entropy(logits, mask, temperature=0.7)
    want = torch.distributions.Categorical(logits=logits.double() / 0.7).entropy()[mask.bool()]
    assert float(got.count) == 9
    assert float(got.total) == pytest.approx(float(want.sum()), rel=1e-6)
