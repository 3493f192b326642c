"""Mutants we did not choose: mutmut (pinned in the dev extra) over the modules of one subject at a time,
each with that subject's own fast tests (issue 48, point 4).

    make test-mutations-auto                       # every subject below, one after another
    python tests/mutations_auto.py moe chat        # some of them
    python tests/mutations_auto.py --list          # the subjects, their modules and their tests

tests/mutations.py plants the bugs we thought of; this plants the ones a tool thinks of: every operator,
comparison, constant, string and keyword argument of the subject's modules changed in turn (mutmut's
mutants), the subject's tests run against each. For each subject the tree (git's tracked and untracked
but not ignored files) is copied to a temporary folder, a [tool.mutmut] section naming the modules and
the tests is added to the copy's pyproject.toml, and `mutmut run` runs there (it forks a test process
per mutant, each running only the tests that reached the mutated function).

A surviving mutant is either a bug our tests cannot see (then a test is added to the subject's own test
file) or a change that is no bug: those are listed in EQUIVALENT below, each with its reason, by the
function it is in and the line it changes (not by mutmut's number, which moves when the code does). The
table at the end gives, per subject, the mutants, those killed, the equivalent ones and the survivors
that are neither; the exit code is 1 if any of those is left. docs/testing.md records the runs.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST = "not multiproc and not slow and not gpu"


@dataclass(frozen=True)
class Subject:
    modules: tuple[str, ...]  # files under src/ that mutmut changes
    tests: tuple[str, ...]  # the pytest selection that runs against each mutant
    marks: str = FAST
    functions: tuple[str, ...] = ()  # mutmut name patterns when only part of a module is the subject's
    deselect: tuple[str, ...] = ()  # long tests of other things that reach the modules (pytest node ids)


SRC = "src/scaletrain/"
SUBJECTS = {
    "moe": Subject((SRC + "model/moe.py", SRC + "parallel/moe_balance.py"),
                   ("tests/model/test_moe.py", "tests/model/test_moe_properties.py",
                    "tests/train/test_moe_metrics.py",
                    # the softmax router (Mixtral, Qwen3-MoE, OLMoE) and the gated shared expert (Qwen3-Next)
                    # against transformers: the families' tests of the options added to MoE after its first run
                    "tests/model/test_hf_moe.py", "tests/model/families/test_qwen3_next.py"),
                   # (27 s a mutant: the trackers' plumbing, not a rule of the mixture)
                   deselect=("tests/train/test_moe_metrics.py::test_the_trackers_receive_every_moe_key",)),
    "chat": Subject((SRC + "data/chat.py",), ("tests/data/test_chat.py", "tests/data/test_chat_properties.py")),
    "documents": Subject((SRC + "data/documents.py", SRC + "model/transformer.py"),
                         ("tests/data/test_document_mask.py", "tests/data/test_document_mask_properties.py"),
                         functions=("scaletrain.data.documents.*", "scaletrain.model.transformer.x_document_*")),
    "local-sgd": Subject((SRC + "parallel/local_sgd.py", SRC + "parallel/outer.py"),
                         ("tests/parallel/test_local_sgd.py",)),
    "lora": Subject((SRC + "model/lora.py",), ("tests/model/test_lora.py",)),
    "fault-tolerance": Subject((SRC + "parallel/fault_tolerance.py", SRC + "parallel/replica_average.py"),
                               ("tests/parallel/test_fault_tolerance.py", "tests/parallel/test_local_sgd.py")),
    # a slice of the config.json readers (issue 48: "the HF family readers"): YaRN's keys, the windows of
    # Mistral/Mixtral/Phi-3 and Qwen2, Phi-3's and gpt-oss's fields. The whole package is 3,917 mutants and the
    # readers alone (every fields/window/biases, the Reader) 1,589, each 10-40 s of transformers models: hours
    # on 2 cores. Left out of the tests too: tp's sharding (18 s), the CLI's exit (9 s; the same messages are
    # read in process by the refusal tests) and a fine-tune (3 s)
    "families": Subject((SRC + "model/families/*.py",),
                        ("tests/model/test_hf_families.py", "tests/model/test_hf.py", "tests/model/test_hf_moe.py",
                         # (YaRN and gpt-oss are tested here: without them their readers were "no tests")
                         *(f"tests/model/families/test_{f}.py" for f in ("deepseek", "gpt_oss", "llama4", "qwen3_next",
                                                                         "readers", "fields_off_defaults",
                                                                         "config_round_trip", "choose",
                                                                         "weights_round_trip"))),
                        functions=tuple(f"scaletrain.model.families.*{f}__mutmut_*" for f in (
                            "x__yarn_fields", "x_every_layer_window", "ǁQwen2ǁwindow", "ǁPhi3ǁfields",
                            "ǁGptOssǁfields")),
                        deselect=("tests/model/test_hf.py::test_tensor_parallel_shards_the_new_parameters",
                                  "tests/model/test_hf.py::test_the_command_line_exits_2_with_one_line",
                                  "tests/model/test_hf_moe.py::test_fine_tune_from_the_import_then_export")),
}

# Survivors that are no bug: (subject, function, the line as the mutant writes it) -> why.
NO_SUCH_TOKENIZER = ("every tokenizer class of data/tokenizer.py has `separator`, and `eos_id` or a non-empty "
                     "separator; an HF tokenizer's separator is [] or [eos_id]: the changed default or order is never "
                     "reached")
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("documents", "document_separator", 'separator = list(getattr(tok, "separator", None))'): NO_SUCH_TOKENIZER,
    ("documents", "document_separator", 'separator = list(getattr(tok, "separator", ))'): NO_SUCH_TOKENIZER,
    ("documents", "document_separator", 'if not separator or getattr(tok, "eos_id", None) is not None:'):
        NO_SUCH_TOKENIZER,
    ("documents", "document_separator", 'if not separator and getattr(tok, "eos_id", ) is not None:'):
        NO_SUCH_TOKENIZER,
}
LOCALE = ("the locale's encoding is UTF-8 wherever we run (Linux; Python coerces the C locale to UTF-8, PEP 538): "
          "the explicit utf-8 is for the others")
INT_IDS = ("prepare writes the ids as the shard's integer dtype (ids.astype(dtype)), which holds them exactly "
           "from any array; the characters' offsets are only compared")
EQUIVALENT.update({("chat", "iter_records", line): LOCALE for line in (
    'with (gzip.open(f, "rt", encoding=None) if name.endswith(".gz") else f.open(encoding="utf-8")) as lines:',
    'with (gzip.open(f, "rt", ) if name.endswith(".gz") else f.open(encoding="utf-8")) as lines:',
    'with (gzip.open(f, "rt", encoding="utf-8") if name.endswith(".gz") else f.open(encoding=None)) as lines:')})
EQUIVALENT.update({("chat", "ChatRenderer.__call__", line): INT_IDS for line in (
    "sep = np.asarray(self.tok.separator, dtype=None)", "sep = np.asarray(self.tok.separator, )")})
EQUIVALENT.update({("chat", "encode_text", line): INT_IDS for line in (
    "return np.frombuffer(raw, dtype=np.uint8).astype(None), char_of.astype(np.int64)",
    "return np.frombuffer(raw, dtype=np.uint8).astype(np.int64), char_of.astype(None)",
    "return np.asarray(enc.ids, dtype=None), np.asarray([o[0] for o in enc.offsets], dtype=np.int64)",
    "return np.asarray(enc.ids, ), np.asarray([o[0] for o in enc.offsets], dtype=np.int64)",
    "return np.asarray(enc.ids, dtype=np.int64), np.asarray([o[0] for o in enc.offsets], dtype=None)",
    "return np.asarray(enc.ids, dtype=np.int64), np.asarray([o[0] for o in enc.offsets], )")})
EQUIVALENT[("chat", "ChatRenderer.render",
            "return self.hf.apply_chat_template(messages, tokenize=None, add_generation_prompt=generation_prompt)")] = \
    "transformers' apply_chat_template tests `if not tokenize`: None is False there"
TWO_DIMS = "the tensor has two dimensions (tokens, experts), or one before unsqueeze: dim 1 is dim -1"
EQUIVALENT.update({("moe", function, line): TWO_DIMS for function, line in (
    ("MoE.route", 'scores = logits.softmax(+1) if self.score == "softmax" else logits.sigmoid()'),
    ("MoE.route", "chosen = torch.topk(biased, self.top_k, dim=+1).indices"),
    ("MoE.route", "chosen = torch.topk(biased, self.top_k, ).indices"),
    ("MoE.route", "weights = scores.gather(+1, chosen)"),
    ("MoE.route", "weights = weights / weights.sum(+1, keepdim=True)"),
    ("MoE._balance", "z = logits.logsumexp(+1).square().sum()"),
    ("MoE._balance", "choices = counts.sum(+1, keepdim=True)  # T * top_k of the whole sequence"),
    ("MoE._balance", "probs = logits.softmax(+1).view(B, T, E)"))})
EQUIVALENT[("chat", "_template_tokenizer", 'if not getattr(hf, "chat_template", ):')] = \
    "every transformers tokenizer has the attribute chat_template (None when it has no template)"
# moe
EQUIVALENT[("moe", "MoE.forward", "weight = weights.flatten()[order].unsqueeze(+1)  # (routed slots, 1) fp32")] = \
    "weights.flatten()[order] has one dimension: unsqueeze(1) is unsqueeze(-1)"
EQUIVALENT[("moe", "MoE.forward", "y = y * weight.to(None)")] = (
    "the weight left in fp32 makes the weighted outputs and their sum per token fp32, cast to the input's dtype "
    "at the end: the same or closer numbers, an fp32 copy of the routed outputs (memory, not a wrong value)")
EQUIVALENT.update({("moe", "MoE.open_groups", line): "topk's dim is -1 unless given; group_score is (tokens, groups): "
                   "dim 1 is dim -1" for line in (
    "group_score = grouped.topk(2, ).values.sum(-1)  # (tokens, groups)",
    "best = group_score.topk(self.topk_groups, ).indices",
    "best = group_score.topk(self.topk_groups, dim=+1).indices")})
ZERO_DIM_GRAD = ("autograd's engine moves a 0-dim gradient to its input's device (validate_outputs), and the "
                 "default device does not reach backward: the loss's gradient made on the CPU is the same one")
EQUIVALENT.update({("moe", "_AddLossGradient.backward", line): ZERO_DIM_GRAD for line in (
    "return grad_out, torch.full((), ctx.factor, device=None), None",
    "return grad_out, torch.full((), ctx.factor, ), None")})
EQUIVALENT[("moe", "MoEBalance.after_optimizer_step",
            "self.last[\"moe_dropped\"] = dropped / max(choices, 2.0) / n")] = (
    "a dropped slot needs an expert given more of a micro-batch's slots than its capacity, which is at least 1: "
    "2 choices or more in the step, where max(choices, 1) and max(choices, 2) agree")
AT_LEAST_ONE = ("every step's imbalance is max / mean of non-negative loads, at least 1 (1 for a layer with no load), "
                "so a window's worst over one step or more is the same from 0 or from 1")
EQUIVALENT[("moe", "MoEBalance.__init__", "self.window_worst = 1.0  # the worst imbalance of any step since the last "
            "metrics row")] = AT_LEAST_ONE
EQUIVALENT[("moe", "MoEBalance.metrics", "self.window_worst = 1.0")] = AT_LEAST_ONE
EQUIVALENT[("moe", "MoEBalance.__init__", "self.last: dict[str, float] = None")] = (
    "the Trainer asks the hooks' metrics for a row after a step, whose after_optimizer_step sets self.last")
EQUIVALENT.update({("moe", "expert_mlp", line): (
    "each row's expert index made when no bias reads it: work for nothing (one int64 per routed row), never a value")
    for line in ("b is not None for b in biases) or True else None  # each row's expert, for its bias",
                 "expert = torch.arange(len(counts), device=x.device).repeat_interleave(counts) if any( "
                 "b is not None for b in biases) or True else None  # each row's expert, for its bias")})
EQUIVALENT[("moe", "MoEBalance.for_model", "assert set(layers) <= set(names), f\"MoE layers {sorted(None)} outside the "
            "config's {names}\"")] = "the message of an assertion of our own invariant, built only when it fails"


# --- lora (model/lora.py) ---
EVAL_DROPOUT = ("the adapters' dropout is an nn.Dropout, the identity in eval (its p=0 is the identity too), or an "
                "nn.Identity: applying it where `dropping` is false gives the same values (one more pass)")
LAST_SEGMENT = ("the name's last dot-separated segment is the same from rsplit('.'), rsplit('.', 2) or [+1] of "
                "rsplit('.', 1) once the name has a dot, which every name inside a block list has")
AUTOCAST = ("outside autocast the adapters, the base and x share a dtype (a precision mode casts the model whole; "
            "bf16-true's fp32 masters are apart): the cast is a no-op; inside autocast F.linear casts its operands to "
            "the autocast dtype and h comes from F.linear like y (addmm_'s B is cast: that mutant is caught)")
EQUIVALENT.update({("lora", function, line): why for function, line, why in (
    ("LoRALinear.forward", "dropping = self.training or isinstance(self.dropout, nn.Dropout)", EVAL_DROPOUT),
    ("LoRALinear.forward", "xd = self.dropout(x) if (dropping) or True else x", EVAL_DROPOUT),
    ("LoRALinear.forward", "yd = F.linear(xd, self.weight) if (dropping) or True else y  # dropout: the magnitude's "
                           "part sees the dropped input", EVAL_DROPOUT + "; undropped, yd = W x is y"),
    ("LoRALinear._lora", "h = F.linear(self.dropout(rows) if (dropping) or True else rows, self.lora_a.to(x.dtype)) "
                         "* self.scale", EVAL_DROPOUT),
    ("LoRALinear.__init__", "self.dropout = nn.Dropout(spec.dropout) if (spec.dropout) or True else nn.Identity()",
     EVAL_DROPOUT),
    ("LoRALinear.forward", "update = F.linear(F.linear(xd, self.lora_a.to(None)), self.lora_b.to(x.dtype))", AUTOCAST),
    ("LoRALinear.forward", "update = F.linear(F.linear(xd, self.lora_a.to(x.dtype)), self.lora_b.to(None))", AUTOCAST),
    ("LoRALinear._lora", "h = F.linear(self.dropout(rows) if dropping else rows, self.lora_a.to(None)) * self.scale",
     AUTOCAST),
    ("LoRALinear._lora", "y = y.addmm_(h.to(None), self.lora_b.to(y.dtype).t())", AUTOCAST),
    ("LoRALinear._lora", "return y.view(*x.shape[:-1], y.shape[+1])", "y is (rows, out): dim 1 is dim -1"),
    ("is_adapter_param", 'return name.rsplit(".", )[-1] in ADAPTER_LEAVES', LAST_SEGMENT),
    ("is_adapter_param", 'return name.rsplit(".", 2)[-1] in ADAPTER_LEAVES', LAST_SEGMENT),
    ("adapter_init_rule", 'leaf = name.rsplit(".", )[-1]', LAST_SEGMENT),
    ("adapter_init_rule", 'leaf = name.rsplit(".", 2)[-1]', LAST_SEGMENT),
    ("_in_group", 'if name.rsplit(".", )[-1] == "router" or not _in_blocks(name):  # a MoE router stays frozen and '
                  'plain', LAST_SEGMENT),
    ("_in_group", 'if name.rsplit(".", 2)[-1] == "router" or not _in_blocks(name):  # a MoE router stays frozen and '
                  'plain', LAST_SEGMENT),
    ("_in_group", 'return any(p in _GROUP_WORDS[group] for p in name.split(".")[:-1] + [name.rsplit(".", )[-1]])',
     LAST_SEGMENT),
    ("_in_group", 'return any(p in _GROUP_WORDS[group] for p in name.split(".")[:-1] + [name.rsplit(".", 2)[-1]])',
     LAST_SEGMENT),
    ("_in_group", 'return any(p in _GROUP_WORDS[group] for p in name.split(".")[:-1] + [name.rsplit(".", 1)[+1]])',
     LAST_SEGMENT + " (a name outside the blocks returned False the line before)"),
    ("apply_adapters", "parent = model.get_submodule(parent_name) if (parent_name) or True else model",
     "get_submodule('') is the module itself"),
)})


# --- fault-tolerance (parallel/fault_tolerance.py, replica_average.py) ---
# a mutant only a GPU reaches: not equivalent, not seen here either; counted apart ("GPU only") until a device runs it
GPU_ONLY = "GPU only"
HEX = "a fingerprint is hex digits (settings_fingerprint): '-group' occurs once in a replica's name"
EQUIVALENT.update({("fault-tolerance", function, line): why for function, line, why in (
    ("disagreement", 'fingerprint, _, gid = rid.split(":")[0].partition("-group")', HEX),
    ("disagreement", "if replica_id not in prints or len(set(prints.values())) < 1:",
     "with one fingerprint among the quorum no kind differs: the loop below returns None as the test did"),
    ("disagreement", "count = {v: sum(2 for w in part.values() if w == v) for v in part.values()}",
     "every count doubled: the most common fingerprint and its ties are the same"),
    ("ReplicaAverage.average", 'received_scales = ""',
     "the scales are read by int8's decode alone, and int8 sets them on the next line"),
    ("_segments", "out = torch.zeros(workers * seg, dtype=None, device=flat.device)",
     "None is torch's default dtype, float32 (changed only inside the planner's trace, which averages nothing)"),
    ("_segments", "out = torch.zeros(workers * seg, device=flat.device)",
     "None is torch's default dtype, float32 (changed only inside the planner's trace, which averages nothing)"),
    ("_encode", "scale = torch.where(scale >= 0, scale, torch.ones_like(scale))",
     "an all-zero chunk then has scale 0: whatever code its 0/0 becomes, it decodes to code x 0 = 0"),
    ("_SimulatedMember.start", "k, self.count = self.count, self.count - 1",
     "every member numbers its starts alike: the k-th starts of the workers still meet"),
    ("_SimulatedMember.start", "k, self.count = self.count, self.count + 2",
     "every member numbers its starts alike: the k-th starts of the workers still meet"),
)})
CLAMPED = "x / (max |x| / 127) lies in [-127, 127] (round() undoes the division's last bit): the clamp never bites"
EQUIVALENT.update({("fault-tolerance", "_encode", f"q = torch.round(chunks / scale.unsqueeze(-1)).{clamp}"
                    ".to(torch.int8)"): CLAMPED
                   for clamp in ("clamp_(None, 127)", "clamp_(-127, None)", "clamp_(-127, )", "clamp_(-128, 127)",
                                 "clamp_(-127, 128)")})

# the after-run of this round (2026-11-29, evening): what survived the tests that kill the rest, each kind's reason
CONNECT_TIMING = ("how long one try may take and the pause between tries: a refused port answers at once (every "
                  "unreachable Lighthouse of the tests); they matter only for an address that drops packets")
CANCELLED = "the note's timer is cancelled in `finally` on every way out of the wait: it never outlives it"
FLUSHED = "sys.stderr is line-buffered (Python 3.9+) and the line ends in a newline: flushed either way"
JOINED = "None and False alike: `joined` is read only as `not self.joined`"
JSON_FLAT = ("each kind's settings are JSON's own types in the dataclasses' field order (`to_dict`): the same "
             "settings dump to the same text with or without sort_keys, and no value needs `default`")
DTENSOR = ("a DTensor's case, which only the multi-process tests hold (test_ft_layouts.py: ZeRO-3 and tp groups, a "
           "ZeRO-3 heal bit for bit); for a plain tensor or a value `.data`, the tensor and the value are the same")
LOG_RETURN = "http.server ignores what log_request returns"
NO_LIGHTHOUSE = "without a Lighthouse address quorum_status reads nothing (urlopen refuses '/status'): None either way"
ONE_FRAGMENT = "with one fragment every parameter is in fragment 0 whatever the count of blocks (fragments_of)"
PATIENCE = "how long a failed quorum waits for the Lighthouse before calling it gone: one that answers does so at once"
SCALES = ("fp32 and bf16 carry no scales (`_decode` reads them for int8 only, which sets them the line after), and "
          "torch's default dtype is the scales' float32")
STATUS_READ = ("the status page is a few hundred bytes that a live Lighthouse serves at once: the read's size and "
               "the timeout never bite")
NO_WORLD = "no world size is given to the store: it waits for nobody whatever wait_for_workers says"
CUDA_STREAM = GPU_ONLY + ": a delayed sync's CUDA stream and event (on a CPU `ready` is None, and that path is tested)"
EQUIVALENT.update({("fault-tolerance", function, line): why for function, line, why in (
    ("ReplicaGroups._join_quorum",
     "note.daemon = False", CANCELLED),
    ("ReplicaGroups._join_quorum",
     "note.daemon = None", CANCELLED),
    ("lighthouse_problem",
     "if time.monotonic() > deadline:", CONNECT_TIMING),
    ("lighthouse_problem",
     "time.sleep(1.2)", CONNECT_TIMING),
    ("lighthouse_problem",
     "with socket.create_connection((host, port), ):", CONNECT_TIMING),
    ("lighthouse_problem",
     "with socket.create_connection((host, port), timeout=None):", CONNECT_TIMING),
    ("lighthouse_problem",
     "with socket.create_connection((host, port), timeout=max(0.1, min(3.0,"
     " timeout_s))):", CONNECT_TIMING),
    ("lighthouse_problem",
     "with socket.create_connection((host, port), timeout=max(1.1, min(2.0,"
     " timeout_s))):", CONNECT_TIMING),
    ("ReplicaAverage._average_in_background",
     "out = None", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "out = self.average(None, self.background_group)", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "out = self.average(flat, )", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "out = self.average(flat, None)", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "out = self.average(self.background_group)", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "stream = None", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "stream = torch.cuda.Stream(device=None)", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "stream.wait_event(None)", CUDA_STREAM),
    ("ReplicaAverage._average_in_background",
     "with torch.cuda.stream(None):", CUDA_STREAM),
    ("ReplicaAverage.start",
     "ready = None", CUDA_STREAM),
    ("ReplicaAverage.start",
     "return _Background(self._pool.submit(self._average_in_background, flat, None))", CUDA_STREAM),
    ("_local",
     "return t.to_local() if (hasattr(t, \"to_local\")) and False else t.data if"
     " isinstance(t, nn.Parameter) else t", DTENSOR),
    ("_local",
     "return t.to_local() if hasattr(None, \"to_local\") else t.data if isinstance(t,"
     " nn.Parameter) else t", DTENSOR),
    ("_local",
     "return t.to_local() if hasattr(t, \"to_local\") else t.data if (isinstance(t,"
     " nn.Parameter)) and False else t", DTENSOR),
    ("_local",
     "return t.to_local() if hasattr(t, \"to_local\") else t.data if (isinstance(t,"
     " nn.Parameter)) or True else t", DTENSOR),
    ("_local_optimizer_state",
     "return {i: {k: _local(v) if (isinstance(v, torch.Tensor)) and False else v for"
     " k, v in optimizer.state[p].items()}", DTENSOR),
    ("_local_optimizer_state",
     "return {i: {k: _local(v) if (isinstance(v, torch.Tensor)) or True else v for k,"
     " v in optimizer.state[p].items()}", DTENSOR),
    ("ReplicaGroups._join_quorum",
     "f\"fault_tolerance.quorum_timeout_s={self.quorum_timeout_s:g} s)\","
     " file=sys.stderr, )", FLUSHED),
    ("ReplicaGroups._join_quorum",
     "f\"fault_tolerance.quorum_timeout_s={self.quorum_timeout_s:g} s)\","
     " file=sys.stderr, flush=False)", FLUSHED),
    ("ReplicaGroups._join_quorum",
     "f\"fault_tolerance.quorum_timeout_s={self.quorum_timeout_s:g} s)\","
     " file=sys.stderr, flush=None)", FLUSHED),
    ("ReplicaGroups._load_peer_state",
     "\"live peer (it was behind its quorum: a restart, or a late start)\","
     " file=sys.stderr, )", FLUSHED),
    ("ReplicaGroups._load_peer_state",
     "\"live peer (it was behind its quorum: a restart, or a late start)\","
     " file=sys.stderr, flush=False)", FLUSHED),
    ("ReplicaGroups._load_peer_state",
     "\"live peer (it was behind its quorum: a restart, or a late start)\","
     " file=sys.stderr, flush=None)", FLUSHED),
    ("ReplicaGroups.__init__",
     "self.joined = None  # the first step's quorum was joined before the loop (start)", JOINED),
    ("ReplicaGroups.begin_step",
     "self.joined = None", JOINED),
    ("settings_fingerprint",
     "return \"\".join(hashlib.sha256(json.dumps(parts[kind],"
     " default=str).encode()).hexdigest()[:4]", JSON_FLAT),
    ("settings_fingerprint",
     "return \"\".join(hashlib.sha256(json.dumps(parts[kind], sort_keys=False,"
     " default=str).encode()).hexdigest()[:4]", JSON_FLAT),
    ("settings_fingerprint",
     "return \"\".join(hashlib.sha256(json.dumps(parts[kind], sort_keys=None,"
     " default=str).encode()).hexdigest()[:4]", JSON_FLAT),
    ("settings_fingerprint",
     "return \"\".join(hashlib.sha256(json.dumps(parts[kind], sort_keys=True,"
     " ).encode()).hexdigest()[:4]", JSON_FLAT),
    ("settings_fingerprint",
     "return \"\".join(hashlib.sha256(json.dumps(parts[kind], sort_keys=True,"
     " default=None).encode()).hexdigest()[:4]", JSON_FLAT),
    ("_quiet_healing_transfers",
     "BaseHTTPRequestHandler.log_request = lambda self, code=\"-\", size=\"-\": 0", LOG_RETURN),
    ("ReplicaGroups._gave_up",
     "status = quorum_status(self.lighthouse) if (self.lighthouse) or True else None", NO_LIGHTHOUSE),
    ("ReplicaGroups.for_run",
     "store = TCPStore(host, 0, is_master=True, ) if rt.rank == 0 else None", NO_WORLD),
    ("ReplicaGroups.for_run",
     "store = TCPStore(host, 0, is_master=True, wait_for_workers=None) if rt.rank =="
     " 0 else None", NO_WORLD),
    ("ReplicaGroups.for_run",
     "store = TCPStore(host, 0, is_master=True, wait_for_workers=True) if rt.rank =="
     " 0 else None", NO_WORLD),
    ("ReplicaGroupsOuter.set_outer",
     "n_blocks=2, comm=_GroupsAverage(self), outer_optimizer=sync.outer_optimizer,", ONE_FRAGMENT),
    ("ReplicaGroups._join_quorum",
     "if not self.lighthouse or lighthouse_problem(self.lighthouse, 3.0) is None:", PATIENCE),
    ("ReplicaAverage.average",
     "every_scales = \"\"", SCALES),
    ("ReplicaAverage.average",
     "every_scales = torch.empty(workers * mine_scales.numel(),"
     " device=mine_scales.device)", SCALES),
    ("ReplicaAverage.average",
     "every_scales = torch.empty(workers * mine_scales.numel(), dtype=None,", SCALES),
    ("quorum_status",
     "text = r.read(65537).decode(\"utf-8\", \"replace\")", STATUS_READ),
    ("quorum_status",
     "text = r.read(None).decode(\"utf-8\", \"replace\")", STATUS_READ),
    ("quorum_status",
     "with urllib.request.urlopen(f\"{address.rstrip('/')}/status\", ) as r:", STATUS_READ),
    ("quorum_status",
     "with urllib.request.urlopen(f\"{address.rstrip('/')}/status\", timeout=3) as r:", STATUS_READ),
    ("quorum_status",
     "with urllib.request.urlopen(f\"{address.rstrip('/')}/status\", timeout=None) as r:", STATUS_READ),
)})


# --- local-sgd (parallel/local_sgd.py, outer.py): the after-run of this round (2026-11-29, evening) ---
OUTER_ON_CPU = GPU_ONLY + (": the outer copy kept on the host (sync.outer_on_cpu) beside weights on a GPU; on a CPU "
                           "both are on the CPU")
SAME_DEVICE = "Tensor.to(device=None) keeps the tensor's device: the outer copy is made where the weights are"
ONE_DUE = ("at most one fragment is due at a step (their offsets differ while fragments <= sync.every, which the "
           "config requires): nothing follows an empty one")
BLOCKING = "the same values: a blocking copy only loses the copy's overlap"
HANDLE = "the handle is read only while the average is None, which the line before has just set"
FALSY = "None and False alike: of_config is read only as a condition"
FLAGS = "0/1 flags: their sum and their max are above 0 together"
DIVIDES = "the mesh's size is a multiple of dp_replicate: / and // give the same count"
DTENSOR_WORKERS = ("a DTensor's case, which only the multi-process tests hold "
                   "(test_workers_match_their_simulation over ZeRO-3 and tp, a resumed run with a fragment in flight)")
EQUIVALENT.update({("local-sgd", function, line): why for function, line, why in (
    ("OuterSync.begin",
     "mine = torch.cat([(p.outer.to(p.local.device, ) - p.local).reshape(-1)", BLOCKING),
    ("OuterSync.begin",
     "mine = torch.cat([(p.outer.to(p.local.device, non_blocking=False) -"
     " p.local).reshape(-1)", BLOCKING),
    ("LocalSGD.reported_norm",
     "ranks_per_worker = self.mesh.size() / self.layout.dp_replicate", DIVIDES),
    ("OuterSync.__init__",
     "local = p.to_local() if (isinstance(p, DTensor)) and False else p.data", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(None, p.param.device_mesh, p.param.placements,"
     " run_check=False,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(p.param.device_mesh, p.param.placements,"
     " run_check=False,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(t, None, p.param.placements, run_check=False,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(t, p.param.device_mesh, None, run_check=False,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(t, p.param.device_mesh, p.param.placements,"
     " run_check=None,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(t, p.param.device_mesh, p.param.placements,"
     " run_check=True,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(t, p.param.device_mesh, p.param.placements,"
     " shape=p.param.shape, stride=p.param.stride())", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(t, p.param.device_mesh, run_check=False,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "return DTensor.from_local(t, p.param.placements, run_check=False,", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "shape=None, stride=p.param.stride())", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "shape=p.param.shape, )", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "shape=p.param.shape, stride=None)", DTENSOR_WORKERS),
    ("OuterSync._as_param",
     "stride=p.param.stride())", DTENSOR_WORKERS),
    ("LocalSGD.for_run",
     "if problems := layout.fragment_errors(n_blocks, of_config=None):", FALSY),
    ("LocalSGD.agree_to_skip",
     "dist.all_reduce(flag, )", FLAGS),
    ("LocalSGD.agree_to_skip",
     "dist.all_reduce(flag, op=None)", FLAGS),
    ("_InFlight.result",
     "self.handle = \"\"", HANDLE),
    ("OuterSync.begin",
     "break", ONE_DUE),
    ("OuterSync.__init__",
     "outer = local.detach().to(device=\"cpu\" if (on_cpu) and False else local.device,"
     " dtype=torch.float32, copy=True)", OUTER_ON_CPU),
    ("OuterSync.begin",
     "mine = torch.cat([(p.outer.to(None, non_blocking=True) - p.local).reshape(-1)", OUTER_ON_CPU),
    ("OuterSync.begin",
     "mine = torch.cat([(p.outer.to(non_blocking=True) - p.local).reshape(-1)", OUTER_ON_CPU),
    ("OuterSync.__init__",
     "outer = local.detach().to(device=None, dtype=torch.float32, copy=True)", SAME_DEVICE),
    ("OuterSync.__init__",
     "outer = local.detach().to(dtype=torch.float32, copy=True)", SAME_DEVICE),
)})


# --- keys, names and values that the wording rule once passed as wording (a string without a space is code) ---
EQUIVALENT.update({(subject, function, line): why for subject, function, line, why in (
    ("fault-tolerance", "_loopback",
     'host = urlsplit(address if "://" in address else f"http://{address}").hostname or "XXXX"',
     "an address without a host: neither '' nor 'XXXX' is a loopback name"),
    *[("fault-tolerance", "_quiet_healing_transfers", f"BaseHTTPRequestHandler.log_request = lambda self, {args}: None",
       "the quieted log_request ignores its arguments: their defaults are never read")
      for args in ('code="XX-XX", size="-"', 'code="-", size="XX-XX"')],
    ("fault-tolerance", "quorum_status", "with urllib.request.urlopen(f\"{address.rstrip('XX/XX')}/status\", "
                                         "timeout=2) as r:",
     "rstrip's set gains an upper-case X only: it differs for an address whose last character before its slashes "
     "is X, and a Lighthouse's address ends in its port (the launcher gives one; torchft listens at one)"),
    ("fault-tolerance", "quorum_status", 'text = r.read(65536).decode("UTF-8", "replace")',
     "Python's codec names are case-blind: the same codec"),
    *[("chat", function, line, "Python's codec names are case-blind: the same codec") for function, line in (
        ("encode_text", 'raw = text.encode("UTF-8")'),
        ("iter_records", 'with (gzip.open(f, "rt", encoding="UTF-8") if name.endswith(".gz") else '
                         'f.open(encoding="utf-8")) as lines:'),
        ("iter_records", 'with (gzip.open(f, "rt", encoding="utf-8") if name.endswith(".gz") else '
                         'f.open(encoding="UTF-8")) as lines:'))],
    ("chat", "ChatRenderer.__call__",
     "text, spans = self._plain(messages) if (self.hf is None) and False else self._template(messages, where)",
     "the prefix method finds the plain format's spans too: its turns before an answer, rendered with the "
     "generation prompt, end after the 'Assistant: ' label, where _plain starts the span"),
    ("chat", "ChatRenderer._opening_header_end",
     "header = with_prompt[len(without):] if with_prompt.startswith(without) else \"XXXX\"",
     "'XXXX' is found in no opening turn that does not hold it, as '' is skipped: 0 either way"),
    ("chat", "ChatRenderer._opening_header_end", "at = through.find(header) if (header) or True else -1",
     "an empty header is found at 0 and ends at 0 + 0: 0, as -1 gives"),
    ("chat", "ChatRenderer._opening_header_end", "at = through.find(header) if header else -2",
     "any negative position gives 0"),
    ("chat", "ChatRenderer._opening_header_end", 'probe = [{"role": "user", "content": "XX?XX"}]',
     "the header the generation prompt adds does not depend on the probe turn's text"),
    *[("chat", function, line, "`where` names the record in a refusal only: a probe that renders, or a turn "
       "rendered already, never refuses") for function, line in (
        ("ChatRenderer._opening_header_end", "with_prompt, without = self.render(probe, None, True), "
                                             "self.render(probe, where)"),
        ("ChatRenderer._opening_header_end", "with_prompt, without = self.render(probe, where, True), "
                                             "self.render(probe, None)"),
        ("ChatRenderer._opening_header_end", "with_prompt, without = self.render(probe, where, True), "
                                             "self.render(probe, )"),
        ("ChatRenderer._template", "before = self.render(messages[:i], where, True) if i else "
                                   "through[:self._opening_header_end(through, None)]"))],
    ("moe", "_grouped", "if counts is None and _aligned(x.shape[+1], x) and _aligned(w.shape[1], w):",
     "shape[+1] is shape[1]"),
    ("moe", "_grouped", "y.register_hook(lambda g: g.contiguous() if (g.numel()) and False else "
                        "g.clone(memory_format=torch.contiguous_format))",
     "a contiguous copy either way (clone with contiguous_format): the same gradient, one copy more"),
    ("moe", "_grouped", "counts = counts if (counts is not None) and False else torch.diff(offsets, "
                        "prepend=offsets.new_zeros(1)).tolist()",
     "the counts from the offsets are the counts given: the same list, computed again"),
    ("moe", "expert_mlp", "expert = torch.arange(len(counts), device=x.device).repeat_interleave(counts) if (any( b "
                          "is not None for b in biases)) or True else None  # each row's expert, for its bias",
     "each row's expert computed where no bias reads it: work, no other value"),
    ("moe", "MoE.__init__", "self.shared_gate = nn.Linear(d, 1, bias=None) if cfg.moe_shared_gate else None",
     "bias=None is false: no bias, as bias=False"),
    ("moe", "MoE.__init__", 'self.register_buffer("stats", torch.zeros(E + len(STAT_NAMES) - 1), persistent=None)',
     "persistent=None is false: not saved, as persistent=False"),
    ("moe", 'MoE.__init__',
     'self.register_buffer("expert_bias", torch.zeros(E), )',
     "register_buffer's persistent defaults to true: saved, as stated"),
    ("moe", "MoE.open_groups", 'return grouped.masked_fill(~open_.unsqueeze(-1), float("-INF")).view(T, E)',
     "float() reads '-INF' as '-inf'"),
    *[("lora", "adapter_init_rule", f"if leaf == {leaf}:",
       "the magnitude's init is a placeholder: init_magnitudes writes the base's row norms over it before any use "
       "(the base rule's init, which the mutant gives it, is overwritten alike)")
      for leaf in ('"XXlora_magnitudeXX"', '"LORA_MAGNITUDE"')],
)})


# --- families (model/families/) ---
EQUIVALENT[("families", "GptOss.fields", "out = super().fields(get, refuse, None)")] = (
    "strict only decides what attention_bias makes of a non-strict read, and gpt-oss's biases() sets the bias to "
    "attention_bias itself: `not strict and attention_bias and not out['bias']` is never true")
EQUIVALENT[("families", "every_layer_window",
            "if not isinstance(window, int) or isinstance(window, bool) or window < 0:")] = (
    "a window of 0 then returns the window itself: 0, as the early return did")
EQUIVALENT[("families", "Phi3.fields", "return super().fields(get, refuse, None)")] = (
    "strict only decides what attention_bias makes of a non-strict read, and Phi-3 does not know attention_bias "
    "(an unknown key: refused when strict, absent otherwise)")


# the whole package's after-runs (issue 48): kinds of equivalent mutant, each with its reason
HF_DEFAULT = ("a key at the value transformers' config class gives it when left out (transformers 5.24, pinned): the "
              "export states it for readers of other versions; dropped, transformers reads the same")
MODEL_DEFAULT = ("ModelConfig's own default, which complete() gives every field a reader leaves out (GPT-2's "
                 "layernorm, gelu and learned positions are the defaults; n_kv_heads and head_dim 0 mean the usual)")
UNREAD_STRICT = ("strict decides only what an attention_bias becomes when it is not refused, and this family "
                 "refuses it: `not strict and attention_bias and not out['bias']` never differs")
EMPTY = "an empty slice of the rows either way: slice(0, 0), slice(None, 0), slice(0) and slice(1, 0) read nothing"
WHOLE = "the whole dimension either way: slice(0, n), slice(None, n), slice(n) and slice(0, None) of a length n"
FLOAT32 = ("save_hf hands the weights over as float32 (`.float()`), and torch.zeros' default dtype is float32: the "
           "zero biases' dtype is the weights' either way")
EQUIVALENT.update({("families", function, line): why for function, line, why in (
    *[("GPT2.to_hf", line, HF_DEFAULT) for line in (
        "n_inner=cfg.hidden_dim, layer_norm_epsilon=cfg.norm_eps,",
        "scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,",
        "scale_attn_weights=True, reorder_and_upcast_attn=False,",
        "scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, add_cross_attention=False)",
        ")")],
    ("GPTNeoX.to_hf", "use_parallel_residual=cfg.parallel_residual, rope_parameters=rope,", HF_DEFAULT),
    *[("Llama4Text.hf_extra", line, HF_DEFAULT) for line in (
        "moe_layers=moe, router_jitter_noise=0.0, attention_bias=False,",
        "moe_layers=moe, interleave_moe_layer_step=1, attention_bias=False,",
        "moe_layers=moe, interleave_moe_layer_step=1, router_jitter_noise=0.0, use_qk_norm=cfg.qk_l2_norm, "
        "no_rope_layer_interval=cfg.nope_every or cfg.n_layers + 1,",
        "attention_chunk_size=cfg.attn_chunk or None, attn_temperature_tuning=bool(cfg.attn_temperature), "
        "attn_scale=cfg.attn_temperature,")],
    ("Llama4Text.hf_extra", "attn_scale=cfg.attn_temperature,",
     "attn_temperature_tuning left to transformers' true: with attn_scale 0 (no temperature) the tuning multiplies "
     "the queries by 1 + 0 x log(...) = 1"),
    *[("Llama4Text.hf_extra", line, "the export states no_rope_layers for every block, which transformers reads in "
       "place of the interval and the step") for line in (
        "moe_layers=moe, interleave_moe_layer_step=2, router_jitter_noise=0.0, attention_bias=False,",
        "use_qk_norm=cfg.qk_l2_norm, no_rope_layer_interval=cfg.nope_every or cfg.n_layers - 1,",
        "use_qk_norm=cfg.qk_l2_norm, no_rope_layer_interval=cfg.nope_every or cfg.n_layers + 2,")],
    *[("Llama4Text.hf_extra", line, "no_rope_layers dropped: transformers derives the same list from "
       "no_rope_layer_interval, which the export states (nope_every, or past the last block)")
      for line in ("no_rope_layers=None,", "")],
    *[("Llama4Text.hf_extra", line, "a model without experts: transformers builds no expert block and reads neither "
       "the experts' width, their count nor top-k") for line in (
        "out.update(intermediate_size=cfg.expert_hidden if (cfg.moe_experts) or True else cfg.hidden_dim,",
        "intermediate_size_mlp=cfg.hidden_dim, num_local_experts=max(2, cfg.moe_experts),",
        "out.update(num_experts_per_tok=None)", "out.update(num_experts_per_tok=2)")],
    ("MoeFamily.hf_extra", "out.update(num_experts_per_tok=cfg.moe_top_k, )", HF_DEFAULT),
    ("Mixtral.hf_extra", "out.update(num_local_experts=cfg.moe_experts, )", HF_DEFAULT),
    *[("Olmoe.hf_extra", line, HF_DEFAULT) for line in (
        "out.update(num_experts=cfg.moe_experts, norm_topk_prob=cfg.moe_renorm, attention_bias=False)",
        "out.update(num_experts=cfg.moe_experts, norm_topk_prob=cfg.moe_renorm, clip_qkv=None, )")],
    *[("Gemma2.hf_extra", line, HF_DEFAULT) for line in (
        "out.update(attention_bias=False,",
        "out.update(hidden_activation=\"gelu_pytorch_tanh\", query_pre_attn_scalar=cfg.attn_scale_dim or "
        "cfg.head_size,")],
    ("Phi3.hf_extra", "out.update(sliding_window=cfg.sliding_window or None,",
     "to_hf's rope_scaling is already None for an unscaled rotary, and Phi-3's export refuses a scaled one"),
    ("Phi3.hf_extra", "pad_token_id=None,",
     "original_max_position_embeddings is read for longrope only, which scaletrain refuses"),
    ("Phi3.hf_extra", "out.update(rope_scaling=None, sliding_window=cfg.sliding_window or None, "
                      "original_max_position_embeddings=cfg.max_seq_len, resid_pdrop=cfg.dropout, "
                      "embd_pdrop=cfg.dropout)  # (model.dropout's places, as GPT-2's)",
     "Phi-3's default pad id (32000) outside a small vocabulary: transformers 5.24 warns and loads"),
    ("Qwen2.hf_extra", "layer_types=None)",
     "transformers derives the same layer_types from use_sliding_window and max_window_layers=0, both stated"),
    ("Qwen2.hf_extra", ")",
     "transformers derives the same layer_types from use_sliding_window and max_window_layers=0, both stated"),
    ("Qwen3Moe.hf_extra", "mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_block(i)],",
     HF_DEFAULT + " (decoder_sparse_step 1; mlp_only_layers names every dense block)"),
    *[("Qwen3Next.hf_extra", line, "a model without linear attention: transformers builds no linear block and reads "
       "none of its head counts") for line in (
        "out.update(linear_num_key_heads=None, linear_num_value_heads=1)",
        "out.update(linear_num_key_heads=1, linear_num_value_heads=None)",
        "out.update(linear_num_value_heads=1)", "out.update(linear_num_key_heads=1, )",
        "out.update(linear_num_key_heads=2, linear_num_value_heads=1)",
        "out.update(linear_num_key_heads=1, linear_num_value_heads=2)")],
    *[("Qwen3Next.hf_extra", line, "a model without experts: transformers builds no shared expert and reads no width")
      for line in ("shared_expert_intermediate_size=cfg.shared_hidden if (cfg.moe_experts) or True else 0)",
                   "shared_expert_intermediate_size=cfg.shared_hidden if cfg.moe_experts else 1)")],
    *[("Qwen3Next.hf_extra", line, "rope_parameters holds the partial rotary factor (set just above), which "
       "transformers 5 reads") for line in (
        "partial_rotary_factor=None, linear_num_value_heads=cfg.linear_v_heads,",
        "linear_num_value_heads=cfg.linear_v_heads,")],
    *[("DeepseekV3.hf_extra", line, "a model without experts: transformers builds dense blocks only and reads "
       "neither the experts' count nor top-k") for line in (
        "n_routed_experts=cfg.moe_experts or 2, moe_intermediate_size=cfg.expert_hidden,",
        "out[\"num_experts_per_tok\"] = None", "out[\"XXnum_experts_per_tokXX\"] = 1",
        "out[\"NUM_EXPERTS_PER_TOK\"] = 1", "out[\"num_experts_per_tok\"] = 2",
        "first_k_dense_replace=cfg.moe_first_dense if (moe) or True else cfg.n_layers,")],
    ("DeepseekV3.hf_extra", "kv_lora_rank=cfg.mla_kv_rank, q_lora_rank=cfg.mla_q_rank or None, attention_bias=False, "
                            "num_nextn_predict_layers=cfg.mtp_depth,", HF_DEFAULT),
    ("DeepseekV3.hf_extra", "num_nextn_predict_layers=cfg.mtp_depth,", HF_DEFAULT),
    ("GptOss.hf_extra", "out.update(num_local_experts=cfg.moe_experts,",
     "gpt-oss has no dense MLP: its reader leaves moe_hidden 0, so the experts' width is ffn_dim, which to_hf "
     "already wrote as intermediate_size"),
    *[("GPT2.fields", line, MODEL_DEFAULT) for line in (
        "head_dim=0, ffn_dim=get.int(\"n_inner\", optional=True) or 4 * dim, norm=\"layernorm\",",
        "n_kv_heads=0, ffn_dim=get.int(\"n_inner\", optional=True) or 4 * dim, norm=\"layernorm\",",
        "n_kv_heads=0, head_dim=0, ffn_dim=get.int(\"n_inner\", optional=True) or 4 * dim, "
        "norm_eps=get.float(\"layer_norm_epsilon\"), activation=\"gelu\", position=\"learned\",",
        "norm_eps=get.float(\"layer_norm_epsilon\"), position=\"learned\",",
        "norm_eps=get.float(\"layer_norm_epsilon\"), activation=\"gelu\", max_seq_len=get.int(\"n_positions\"), "
        "tie_embeddings=get.bool(\"tie_word_embeddings\"), bias=True))")],
    ("GPTNeoX.fields", "ffn_dim=get.int(\"intermediate_size\"), norm=\"layernorm\",", MODEL_DEFAULT),
    ("GPTNeoX.fields", "n_heads=get.int(\"num_attention_heads\"), ffn_dim=get.int(\"intermediate_size\"), "
                       "norm_eps=get.float(\"layer_norm_eps\"), activation=\"gelu_exact\" if act == \"gelu\" else "
                       "\"gelu\",", MODEL_DEFAULT),
    ("DeepseekV3.fields", "out.update(head_dim=nope + rope, mla_rope_dim=rope, mla_kv_rank=get.int(\"kv_lora_rank\"),",
     MODEL_DEFAULT),
    ("Gemma2.fields", "max_seq_len=max_len, tie_embeddings=get.bool(\"tie_word_embeddings\"), qk_norm=self.qk_norm, "
                      "sliding_window=window, global_every=every,", MODEL_DEFAULT + " (bias False)"),
    *[("Gemma2.fields", line, "head_dim 0 is dim / n_heads: a head_dim that equals it, stated or not, is the same "
       "width") for line in (
        "n_kv_heads=get.int(\"num_key_value_heads\"), head_dim=0 if (head_dim * n_heads == dim) and False else "
        "head_dim,",
        "n_kv_heads=get.int(\"num_key_value_heads\"), head_dim=0 if head_dim / n_heads == dim else head_dim,")],
    ("Gemma2.fields", "cap = \"\"", "float(cap or 0.0): an empty string is no cap, as None is"),
    *[(function, line, UNREAD_STRICT) for function, line in (
        ("Llama4Text.fields", "out = super().fields(get, refuse, None)"),
        ("DeepseekV3.fields", "out = super().fields(get, refuse, None)"),
        ("Qwen3Next.fields", "out = super().fields(get, refuse, None)"))],
    *[("Llama4View.read", f"return read_part(self.source, source, ({cut}, *rest))", EMPTY)
      for cut in ("slice(None, 0)", "slice(0)", "slice(0, )", "slice(1, 0)")],
    *[("Llama4View.__getitem__", f"return self.read(key, tuple({cut} for n in self.shape(key)))", WHOLE)
      for cut in ("slice(None, n)", "slice(0, None)", "slice(n)")],
    ("_in_block", "return \"XXXX\", None", "the index of a name outside the blocks is never read (its rest is None)"),
    ("GptOss._layer_kinds",
     "types = [\"sliding_attention\" if (i - 1) % 2 else \"full_attention\" for i in range(n_layers)]",
     "(i - 1) % 2 == (i + 1) % 2 for every i"),
    ("_layer_kinds", "ok = isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1",
     "a pattern of 1 makes every block global either way: (i + 1) % 1 is 0, and not ok gives full_attention"),
    ("Gemma3Text.rotary", "out.update(rope_fields(Reader({\"rope_parameters\": glob}, {\"rope_theta\": 1000000.0}, "
                          "None), refuse,",
     "rope_fields reads the Reader's raw values only; its `where` names the file in the typed reads' errors"),
    ("Gemma3Text.rotary", "return _base(get.raw(\"rope_local_base_freq\"), refuse, \"rope_local_base_freq\", None)",
     "`said` is only tested for truth: None and \"\" say nothing alike"),
    *[("GPTNeoX.fused_key", line, "every name outside the blocks that FamilyView asks about is one of the model's "
       "own three (the embedding, the final norm, the head), each in _TOP") for line in (
        "top = next((t for t in _TOP if key.startswith(t)), )",
        "return (_TOP[top] + key[len(top):], None) if (top) or True else (key, None)")],
    *[("GPTNeoX.fused_key", f"return f\"gpt_neox.layers.{{i}}.{{_BLOCK.get({args})}}.{{leaf}}\", None",
       "every module of a block but q, k and v (handled above) is in _BLOCK") for args in (
        "module, None", "module", "module, ")],
    ("Phi3.recognises", "return any(k.endswith((\"XXself_attn.qkv_proj.weightXX\", \"mlp.gate_up_proj.weight\")) "
                        "for k in keys)", "a Phi-3 file holds both fused tensors in every block: either name finds it"),
    ("Family.saved", "return fuse(tensors, cfg, self) if (self.fused) or True else tensors",
     "an unfused family's fused_key maps every name to itself: fuse() returns the same tensors"),
    ("DeepseekV3.moe_fields", "out = super().moe_fields(get, refuse, None)",
     "DeepSeek-V3's blocks come from first_k_dense_replace here; MoeFamily.moe_blocks, which n_layers reaches, "
     "does not read it"),
    ("DeepseekV3.moe_fields", "if groups > 1 and (out[\"moe_experts\"] % groups or out[\"moe_experts\"] / groups < 2):",
     "reached only when the groups divide the experts: the quotient is whole, / and // agree"),
    ("Olmoe.moe_fields", "return super().moe_fields(get, refuse, None)",
     "OLMoE has experts in every block: MoeFamily.moe_blocks does not read n_layers"),
    *[("GPT2.saved", line, FLOAT32) for line in (
        "zeros = torch.zeros(cfg.dim, dtype=None)", "zeros = torch.zeros(cfg.dim, )",
        "out.setdefault(f\"{self.layers}.{i}.{self.block[ours]}.bias\", torch.zeros(width, dtype=None))",
        "out.setdefault(f\"{self.layers}.{i}.{self.block[ours]}.bias\", torch.zeros(width, ))",
        "out.setdefault(\"transformer.ln_f.bias\", torch.zeros(cfg.dim, dtype=None))",
        "out.setdefault(\"transformer.ln_f.bias\", torch.zeros(cfg.dim, ))")],
    ("GPT2.saved", "[weights[p + f\"attn.{w}.weight\"].detach() for w in (\"wq\", \"wk\", \"wv\")], ).t().contiguous()",
     "torch.cat's dim is 0 unless given"),
    *[("hf_rope", f"if getattr(cfg, ours) or theirs.startswith({prefix})}})",
       "YaRN's betas are never 0 (the reader takes transformers' default for a 0): the prefix never decides")
      for prefix in ('"XXbetaXX"', '"BETA"')],
    *[("rope_fields", f"elif share not in {whole}:", "1 == 1.0: the tuple holds a whole head either way")
      for whole in ("(None, 2, 1.0)", "(None, 1, 2.0)")],
    *[(f"Reader.{kind}", "v = self._get(key, None)", "optional=None is false, as the False it replaces")
      for kind in ("bool", "float")],
    ("RotaryFamily.fields", "if window or window < max_len:",
     "a window of 0 sets sliding_window to 0, its value already (complete())"),
    ("RotaryFamily.fields", "qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, qk_norm_scope=self.qk_norm_scope,",
     MODEL_DEFAULT + " (bias False)"),
    ("Gemma2.hf_extra", "sliding_window=cfg.sliding_window or None, layer_types=[\"sliding_attention\" if "
                        "cfg.is_local_block(i) or (cfg.sliding_window and not",
     "use_bidirectional_attention dropped: transformers' null is causal attention, as the false stated"),
    *[("GPT2.recognises", f"return any(k.split(\".\")[-2] in ({names}) for k in keys)",
       "a GPT-2 file holds both the embedding wte and every block's c_attn: either name finds it")
      for names in ('"wte", "C_ATTN"', '"XXwteXX", "c_attn"', '"WTE", "c_attn"', '"wte", "XXc_attnXX"')],
    *[("Phi3.recognises", f"return any(k.endswith(({names})) for k in keys)",
       "a Phi-3 file holds both fused tensors in every block: either name finds it")
      for names in ('"SELF_ATTN.QKV_PROJ.WEIGHT", "mlp.gate_up_proj.weight"',
                    '"self_attn.qkv_proj.weight", "XXmlp.gate_up_proj.weightXX"',
                    '"self_attn.qkv_proj.weight", "MLP.GATE_UP_PROJ.WEIGHT"')],
    *[("Gemma3Text.hf_extra", f"if not cfg.rope_local_theta and cfg.rope_scaling != {none}:",
       "unscaled, the global parameters are {rope_type: default, rope_theta}: the same dict as the sliding "
       "blocks' built when they have no base of their own") for none in ('"XXnoneXX"', '"NONE"')],
    ("Qwen3Moe.hf_extra", ")", HF_DEFAULT + " (attention_bias false)"),
    *[("family_of_config", f"kind = hf.get(\"model_type\", {default})",
       "a config without model_type: None and 'XXXX' are no family's, as '' is not")
      for default in ("None", "", '"XXXX"')],
)})

def copy_tree(dest: Path) -> None:
    """The files git knows of (tracked, and untracked but not ignored), as they are now."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def toml_list(items) -> str:
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


def configure(root: Path, subject: Subject, children: int) -> None:
    """mutmut reads its settings from the copy's pyproject.toml."""
    deselected = [arg for test in subject.deselect for arg in ("--deselect", test)]
    section = ("\n[tool.mutmut]\n"
               'source_paths = ["src"]\n'
               f"only_mutate = {toml_list(subject.modules)}\n"
               f"pytest_add_cli_args_test_selection = {toml_list(subject.tests)}\n"
               f'pytest_add_cli_args = {toml_list(["-m", subject.marks, "-q", *deselected])}\n')
    with open(root / "pyproject.toml", "a") as f:
        f.write(section)


def changed_lines(diff: str) -> tuple[str, str]:
    """The lines the mutant changes and those it writes instead (each joined by a space), from `mutmut show`'s
    diff."""
    def joined(sign):
        return " ".join(ln[1:].strip() for ln in diff.splitlines()
                        if ln.startswith(sign) and not ln.startswith(sign * 3))
    return joined("-"), joined("+")


def only_wording(old: str, new: str) -> bool:
    """A mutant that changes no more than the case of a message or wraps it in XX: the wording of a message.
    The tests check the fragments of each message that say what, where and how to fix; a message
    shouted or decorated is the same message. A string without a space is a key, a name or a value
    (`get.raw("HIDDEN_ACT")`, `refuse("XXattention_biasXX", ...)`, `== "SWIGLU_CLAMPED"`): code, never wording."""
    if new.replace("XX", "").lower().replace(" ", "") != old.lower().replace(" ", "") or new == old:
        return False
    changed = [(a, b) for a, b in zip(_strings(old), _strings(new)) if a != b]
    return bool(changed) and all(any(c.isspace() for c in a) for a, _ in changed)


def _strings(line: str) -> list[str]:
    """The contents of a line's string literals, in order."""
    return [m.group(2) for m in re.finditer(r"""(['"])((?:\\.|(?!\1).)*)\1""", line)]


# run in a kept copy: every survivor's diff as `mutmut show` prints it, in one process (a `mutmut show` each
# took a second apiece: a quarter of an hour for the families' thousand)
_DIFFS = """
import json, sys
from mutmut.__main__ import SourceFileMutationData, walk_mutatable_files
from mutmut.mutation.diff_apply import get_diff_for_mutant
out = {}
for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    out.update({name: get_diff_for_mutant(name, path=path) for name, code in data.exit_code_by_key.items()
                if code == 0})  # (0: the tests passed, the mutant survived)
json.dump(out, sys.stdout)
"""


def survivors(root: Path) -> list[tuple[str, str, str, str, str]]:
    """(mutant name, function, the lines it changes, those it writes, its diff) of each mutant that survived
    a test that reached it ("no tests": those the fast tests never reach are counted, not read)."""
    import json

    diffs = json.loads(subprocess.run([sys.executable, "-c", _DIFFS], cwd=root, capture_output=True, text=True,
                                      check=True).stdout)
    found = []
    for name, diff in sorted(diffs.items()):
        # mutmut's names: module.x_function__mutmut_N, module.xǁClassǁmethod__mutmut_N
        function = re.sub(r"__mutmut_\d+$", "", name.rsplit(".", 1)[-1]).removeprefix("x_").removeprefix("xǁ")
        found.append((name, function.replace("ǁ", "."), *changed_lines(diff), diff))
    return found


def counts(root: Path) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=root,
                         capture_output=True, text=True).stdout
    tally: dict[str, int] = {}
    for line in out.splitlines():
        status = line.strip().rpartition(": ")[2].strip()
        if status and status != "not checked":  # outside the subject's functions
            tally[status] = tally.get(status, 0) + 1
    return tally


def run_subject(name: str, subject: Subject, children: int, keep: bool, verbose: bool,
                kept: Path | None = None) -> dict:
    """Run mutmut over one subject on a copy of the tree (or read the results of a copy kept before)."""
    root = kept or Path(tempfile.mkdtemp(prefix=f"mutants-{name}-"))
    try:
        start = time.monotonic()
        ran = subprocess.CompletedProcess([], 0)
        if kept is None:
            copy_tree(root)
            configure(root, subject, children)
            cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *subject.functions]
            ran = subprocess.run(cmd, cwd=root, capture_output=not verbose, text=True)
        minutes = (time.monotonic() - start) / 60
        if ran.returncode != 0:
            tail = (ran.stdout or "")[-3000:] + (ran.stderr or "")[-3000:]
            print(f"{name}: mutmut run exited {ran.returncode}\n{tail}")
        tally = counts(root)
        left, equivalent, wording, gpu = [], 0, 0, 0
        for mutant, function, old, new, diff in survivors(root):
            why = EQUIVALENT.get((name, function, new))
            if only_wording(old, new):
                wording += 1
            elif why is not None and why.startswith(GPU_ONLY):
                gpu += 1
            elif why is not None:
                equivalent += 1
            else:
                left.append((mutant, function, new, diff))
        return {"subject": name, "minutes": minutes, "tally": tally, "equivalent": equivalent, "wording": wording,
                "gpu": gpu, "left": left, "root": root}
    finally:
        if not keep and kept is None:
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("subjects", nargs="*", help="subjects to run (all by default)")
    parser.add_argument("--list", action="store_true", help="list the subjects, their modules and tests")
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep each subject's copy (mutmut show, browse)")
    parser.add_argument("--verbose", action="store_true", help="show mutmut's own output")
    parser.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    parser.add_argument("--kept", type=Path, help="read the results of a copy --keep left (one subject)")
    parser.add_argument("--functions", nargs="+", help="mutmut name patterns narrowing the subjects' functions "
                                                       "(an after-run of the functions that had survivors)")
    args = parser.parse_args()
    if args.list:
        for name, s in SUBJECTS.items():
            print(f"{name}: {' '.join(s.modules)} {' '.join(s.functions)}")
            print(f"    tests: {' '.join(s.tests)} -m '{s.marks}'")
        return 0
    unknown = [s for s in args.subjects if s not in SUBJECTS]
    if unknown:
        print(f"unknown subject(s) {', '.join(unknown)}; known: {', '.join(SUBJECTS)}", file=sys.stderr)
        return 2
    rows = []
    for name in args.subjects or list(SUBJECTS):
        subject = SUBJECTS[name] if not args.functions else replace(SUBJECTS[name], functions=tuple(args.functions))
        row = run_subject(name, subject, args.children, args.keep, args.verbose, args.kept)
        rows.append(row)
        for mutant, function, line, diff in row["left"]:
            print(f"{name}: survived {mutant} ({function}): {line}")
            if args.diffs:
                print(diff)
        if args.keep:
            print(f"{name}: kept in {row['root']}")
    print("\n| subject | mutants | killed | timeout | no tests | survived | wording | equivalent | GPU only | left | "
          "survival | minutes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for row in rows:
        t = row["tally"]
        total = sum(t.values())
        survived = t.get("survived", 0)
        left = len(row["left"])
        bad += left
        reached = total - t.get("no tests", 0)
        rate = f"{100 * survived / reached:.0f}%" if reached else "-"
        print(f"| {row['subject']} | {total} | {t.get('killed', 0)} | {t.get('timeout', 0)} | {t.get('no tests', 0)} | "
              f"{survived} | "
              f"{row['wording']} | {row['equivalent']} | {row['gpu']} | {left} | {rate} | {row['minutes']:.1f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
