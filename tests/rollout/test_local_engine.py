"""The colocated engine in one process: batching changes no draw, the cache changes no token, the log-probs
are the trainer's forward's (within 1e-6 in fp32, and of the whole distribution at the temperature), and
stop ids, stop strings and the length limit end completions where a hand rule over the unstopped
completion says."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import ConfigError
from scaletrain.model.config import model_config
from scaletrain.model.transformer import Transformer
from scaletrain.rollout import Rollouts, SamplingParams
from scaletrain.rollout.engine import RolloutEngine
from scaletrain.rollout.local import PIPELINE_REFUSAL, WINDOW_PADDING_REFUSAL, LocalEngine, logprobs_of

SHAPES = {
    "gpt2": {"position": "learned"},
    "llama-gqa": {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "n_kv_heads": 2},
    "sliding-window": {"position": "rope", "norm": "rmsnorm", "sliding_window": 4, "global_every": 2},
}
# prompts of uneven lengths, two of them of the same length (one batch)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9], [7], [2, 7, 1, 8, 2, 8, 1]]
HOT = SamplingParams(n=3, max_new_tokens=11, temperature=0.7, top_p=0.9, top_k=20, seed=5)


def tiny(vocab: int = 64, **kw) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(model_config({"vocab_size": vocab, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 24,
                                      **kw}))
    for p in model.parameters():  # larger weights than init: logits that differ token to token
        torch.nn.init.normal_(p, std=0.3)
    return model


def with_(params: SamplingParams, **kw) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **kw)


@pytest.mark.parametrize("shape", SHAPES)
def test_batched_equals_one_prompt_at_a_time(shape):
    engine = LocalEngine(tiny(**SHAPES[shape]))
    r = engine.generate(PROMPTS, HOT)
    assert isinstance(engine, RolloutEngine) and isinstance(r, Rollouts)
    assert r.prompt_index == [i for i in range(5) for _ in range(3)]  # prompt-major, G adjacent
    assert r.prompt_ids == [p for p in PROMPTS for _ in range(3)]
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], HOT, first_index=i)
        assert alone.completion_ids == r.completion_ids[3 * i:3 * i + 3]
        torch.testing.assert_close(torch.cat(alone.logprobs), torch.cat(r.logprobs[3 * i:3 * i + 3]), rtol=0,
                                   atol=1e-6)
    # a group's completions differ (a seed each), and the seed changes them
    assert len({tuple(c) for c in r.completion_ids[:3]}) == 3
    assert engine.generate(PROMPTS, with_(HOT, seed=6)).completion_ids != r.completion_ids
    assert engine.generate(PROMPTS, HOT).completion_ids == r.completion_ids
    assert r.tokens_generated == sum(r.lengths) == 15 * 11 and r.generation_seconds > 0


@pytest.mark.parametrize("shape", SHAPES)
def test_the_cache_changes_no_token_and_costs_one_position_per_token(shape):
    model = tiny(**SHAPES[shape])
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = with_(HOT, max_new_tokens=8)
    cached = LocalEngine(model, rescore=False).generate(prompts, params)
    cached_shapes = list(seen)
    seen.clear()
    plain = LocalEngine(model, use_cache=False, rescore=False).generate(prompts, params)
    assert cached.completion_ids == plain.completion_ids
    torch.testing.assert_close(torch.cat(cached.logprobs), torch.cat(plain.logprobs), rtol=0, atol=1e-6)
    # each prompt's 3 rows: the prompt once, then one position per new token
    assert cached_shapes == [(3, 5)] + [(3, 1)] * 7 + [(3, 3)] + [(3, 1)] * 7
    assert seen == [(3, t) for t in range(5, 13)] + [(3, t) for t in range(3, 11)]  # the whole sequence each time
    assert cached.forwards == plain.forwards == 16


@pytest.mark.parametrize("shape", SHAPES)
def test_rollout_log_probs_are_the_trainer_forwards(shape):
    """Temperature 0.7 with top-p and top-k on: the log-probs are of the whole distribution at 0.7, not of
    the filtered one; rescored (the default) they are logprobs_of's bit for bit, and those of the forwards
    that drew the tokens (rescore=False) are within 1e-6 of them (measured here: at most 7.2e-7)."""
    model = tiny(**SHAPES[shape])
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    r = LocalEngine(model).generate(PROMPTS, HOT)
    # after the draws, one forward of each row's prompt + completion, batch by batch (prompts of 5 tokens:
    # 0 and 2, then 3, 1 and 7)
    assert seen[-15:] == [(1, 5 + 11)] * 6 + [(1, 3 + 11)] * 3 + [(1, 1 + 11)] * 3 + [(1, 7 + 11)] * 3
    assert r.forwards == len(seen)
    drawn = LocalEngine(model, rescore=False).generate(PROMPTS, HOT)
    assert drawn.completion_ids == r.completion_ids and drawn.sampling_gap == 0.0
    worst = 0.0
    for prompt, completion, lps, lps_drawn in zip(r.prompt_ids, r.completion_ids, r.logprobs, drawn.logprobs,
                                                  strict=True):
        assert lps.dtype == torch.float32 and lps.shape == (len(completion),)
        ref = logprobs_of(model, prompt, completion, 0.7)
        assert torch.equal(ref, lps)
        worst = max(worst, (ref - lps_drawn).abs().max().item())
        # logprobs_of against the definition, in float64 from the full forward's logits
        logits = model(torch.tensor([prompt + completion])).double()[0, len(prompt) - 1:-1] / 0.7
        by_hand = logits.gather(1, torch.tensor(completion)[:, None])[:, 0] - logits.exp().sum(-1).log()
        torch.testing.assert_close(ref.double(), by_hand, rtol=0, atol=1e-5)
    assert worst <= 1e-6 and r.sampling_gap == worst, (worst, r.sampling_gap)
    # greedy (top_k=1): the filtered distribution would give every token log-prob 0; the full one does not
    for rescore in (True, False):
        greedy = LocalEngine(model, rescore=rescore).generate(PROMPTS[:2], with_(HOT, top_k=1, n=2))
        assert all((lp < 0).all() for lp in greedy.logprobs)
        assert greedy.completion_ids[0] == greedy.completion_ids[1]  # (and every draw is the argmax)


def test_stop_ids_end_a_completion_at_their_first_draw_and_are_kept():
    engine = LocalEngine(tiny())
    free = engine.generate(PROMPTS, HOT)
    stop = free.completion_ids[0][3]  # a token completion 0 draws 4th: it will stop there (or before)
    stopped = engine.generate(PROMPTS, with_(HOT, stop_token_ids=(stop, 63)))
    hits = 0
    for whole, cut, finished, lps, lps_free in zip(free.completion_ids, stopped.completion_ids, stopped.finished,
                                                   stopped.logprobs, free.logprobs, strict=True):
        ends = [k for k, t in enumerate(whole) if t in (stop, 63)]
        if ends:  # the same draws up to the first stop id, which is kept
            assert cut == whole[:ends[0] + 1] and finished
            torch.testing.assert_close(lps, lps_free[:ends[0] + 1], rtol=0, atol=1e-6)
            hits += 1
        else:  # cut by the length limit: not finished
            assert cut == whole and len(cut) == HOT.max_new_tokens and not finished
    assert 0 < hits < len(free)  # both cases seen
    assert stopped.tokens_generated == sum(len(c) for c in stopped.completion_ids)


def test_stop_strings_cut_after_the_token_that_completes_them():
    engine = LocalEngine(tiny(vocab=256), tokenizer=ByteTokenizer())
    prompts = [list(b"ab"), list(b"hello"), list(b"xyz")]
    params = SamplingParams(n=2, max_new_tokens=14, temperature=1.2, seed=2)
    free = engine.generate(prompts, params)
    text = ByteTokenizer().decode(free.completion_ids[0])
    stop = text[4:6]  # two characters completion 0 writes (bytes here: one token each, or a part of one)
    assert "\ufffd" not in stop or len(stop) == 2
    stopped = engine.generate(prompts, with_(params, stop_strings=(stop,)))
    hits = 0
    for whole, cut, finished in zip(free.completion_ids, stopped.completion_ids, stopped.finished, strict=True):
        first = next((k for k in range(len(whole)) if stop in ByteTokenizer().decode(whole[:k + 1])), None)
        if first is not None:
            assert cut == whole[:first + 1] and finished
            hits += 1
        else:
            assert cut == whole and not finished
    assert hits >= 1
    assert stopped.lengths[0] <= 6


def test_an_engine_refuses_what_it_cannot_do_in_one_line():
    model = tiny()
    with pytest.raises(ConfigError, match=r"^prompt 1 of 20 tokens \+ max_new_tokens=5 exceeds the model's context "
                                          r"of 24 positions; lower max_new_tokens or shorten the prompt$"):
        LocalEngine(model).generate([[1], [2] * 20], with_(HOT, max_new_tokens=5))
    with pytest.raises(ConfigError, match=r"^prompt 0 holds no token"):
        LocalEngine(model).generate([[]], HOT)
    with pytest.raises(ConfigError, match=r"^sampling: stop_strings=\['</a>'\] need a tokenizer"):
        LocalEngine(model).generate([[1]], with_(HOT, stop_strings=("</a>",)))
    model.output = None  # a pipeline stage without the head
    with pytest.raises(ConfigError) as e:
        LocalEngine(model)
    assert e.value.lines == [PIPELINE_REFUSAL] and "use tp or ZeRO-3" in PIPELINE_REFUSAL


def test_training_mode_is_restored_and_dropout_is_off_while_sampling():
    model = tiny(dropout=0.5).train()
    engine = LocalEngine(model)
    a = engine.generate(PROMPTS[:2], HOT)
    assert model.training
    b = engine.generate(PROMPTS[:2], HOT)
    assert a.completion_ids == b.completion_ids  # no dropout draws in between
    assert math.isfinite(float(torch.cat(a.logprobs).sum()))


@pytest.mark.parametrize("shape", SHAPES)
def test_padding_each_forward_to_a_multiple_changes_no_token(shape):
    """Sequence parallelism's padding (length_multiple), run in one process: no real position sees it."""
    model = tiny(**SHAPES[shape])
    if shape == "sliding-window":  # its cache cannot forget the padding: refused, without the cache it runs
        with pytest.raises(ConfigError) as e:
            LocalEngine(model, length_multiple=3)
        assert e.value.lines == [WINDOW_PADDING_REFUSAL]
        plain = LocalEngine(model, rescore=False).generate(PROMPTS, HOT)
        padded = LocalEngine(model, use_cache=False, length_multiple=3).generate(PROMPTS, HOT)
        assert padded.completion_ids == plain.completion_ids
        return
    plain = LocalEngine(model).generate(PROMPTS, HOT)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    padded = LocalEngine(model, length_multiple=3, rescore=False).generate(PROMPTS, HOT)
    assert padded.completion_ids == plain.completion_ids
    torch.testing.assert_close(torch.cat(padded.logprobs), torch.cat(plain.logprobs), rtol=0, atol=1e-6)
    # batches by prompt length in order of first appearance (5: prompts 0 and 2; 3; 1; 7), each prompt
    # padded to a multiple of 3, then 10 steps of one token and 2 of padding
    assert seen == [6] + [3] * 10 + [3] + [3] * 10 + [3] + [3] * 10 + [9] + [3] * 10
    r = LocalEngine(model, length_multiple=4).generate(PROMPTS, HOT)
    assert r.completion_ids == plain.completion_ids
    for prompt, completion, lps in zip(r.prompt_ids, r.completion_ids, r.logprobs, strict=True):
        assert torch.equal(logprobs_of(model, prompt, completion, 0.7, length_multiple=4), lps)
        torch.testing.assert_close(logprobs_of(model, prompt, completion, 0.7), lps, rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match=r"max_new_tokens=11 \+ 2 of padding exceeds the model's context of 24"):
        LocalEngine(model, length_multiple=3).generate([[1] * 12], HOT)


def test_a_cache_rewinds_what_padding_stored_and_refuses_more():
    from scaletrain.model.kv_cache import KVCache

    model = tiny()
    tokens = torch.randint(0, 64, (2, 9))
    cache = KVCache(12)
    model(torch.cat([tokens[:, :5], torch.zeros(2, 2, dtype=torch.long)], 1), cache)  # 5 real + 2 padding
    cache.rewind(2)
    assert cache.length == 5
    torch.testing.assert_close(model(tokens[:, 5:], cache), model(tokens)[:, 5:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cannot rewind 10 of 9 positions"):
        cache.rewind(10)
