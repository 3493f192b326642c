"""Preference rows -> token ids: what `scaletrain prepare --preference` writes (issue 49).

Rows are TRL's dataset formats, read from jsonl or parquet (scaletrain.data.sources.iter_rows):

    pairs      `prompt`, `chosen`, `rejected`; or `chosen` and `rejected` alone, whose shared start is
               the prompt (TRL's implicit prompt: the common turns of two conversations, the common
               characters of two texts less a trailing space, as TRL's extract_prompt)
    unpaired   `prompt`, `completion` and a boolean `label` (KTO: true desirable, false undesirable)

Each field is text (TRL's standard format) or a list of {"role", "content"} turns (conversational),
all of one row alike. Text is tokenized as it is, the prompt after the tokenizer's BOS where its
encoding adds one, each completion followed by its EOS (the byte tokenizer's blank line), as TRL
appends EOS. A conversation is rendered as chat data is (scaletrain.data.chat, --chat-format,
template by default): the prompt is the rendering of its turns with the generation prompt, a
completion what the rendering of prompt + completion adds to it (the template's end-of-turn marker
included), as TRL's apply_chat_template does.

Truncation, as TRL's max_prompt_length and max_length: a prompt longer than `max_prompt_tokens` keeps
its last tokens (cut from the left), then each completion keeps its first tokens (cut from the right)
so that prompt + completion holds at most `max_length`. A row left with no completion token to train
on is dropped and counted, as is a pair whose chosen and rejected are the same tokens (it teaches
nothing: its loss has no gradient); neither is ever trained on silently.

Stored per example: the prompt's ids, then each completion's (chosen, rejected; or the one
completion), one after another in the token shards; and an index row of three integers (prompt
length, chosen length, rejected length; or prompt length, completion length, label).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from scaletrain.data.chat import PREFIX_REWRITTEN, ChatRenderer, check_turns, encode_text
from scaletrain.errors import DataError

PREFERENCE_FORMAT = "scaletrain.preference"
PREFERENCE_KINDS = ("pairs", "unpaired")
COMPLETIONS = {"pairs": ("chosen", "rejected"), "unpaired": ("completion",)}
INDEX_COLUMNS = {"pairs": ("prompt", "chosen", "rejected"), "unpaired": ("prompt", "completion", "label")}
EXPECTED = {"pairs": "a preference pair needs `chosen` and `rejected` (and a `prompt`, or conversations that share "
                     "their first turns)",
            "unpaired": "an unpaired example needs `prompt`, `completion` and a boolean `label`"}


@dataclass
class Example:
    """One row's token ids: the prompt, then each completion (chosen, rejected; or the completion)."""

    prompt: np.ndarray
    completions: list[np.ndarray]
    label: int  # unpaired: 1 desirable, 0 undesirable; pairs: 0

    def index_row(self) -> list[int]:
        lengths = [self.prompt.size, *(c.size for c in self.completions)]
        return lengths + [self.label] if len(self.completions) == 1 else lengths


@dataclass
class Tally:
    """What became of the rows, for meta.json and the summary."""

    rows: int = 0
    conversational: int = 0
    prompts_cut: int = 0  # rows kept whose prompt lost tokens on the left
    completions_cut: int = 0  # rows kept with a completion that lost tokens on the right
    too_long: int = 0  # dropped: no completion token left to train on
    identical: int = 0  # dropped pairs: chosen and rejected the same tokens
    desirable: int = 0
    first: dict = field(default_factory=dict)  # reason -> the first row dropped for it (FILE:LINE)

    def drop(self, reason: str, where: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        self.first.setdefault(reason, where)


class PreferenceEncoder:
    """Rows -> Examples for one kind (pairs, unpaired, or auto: the first row's fields say), one tokenizer,
    one --chat-format for conversations (None: template) and the truncation limits."""

    def __init__(self, tok, kind: str = "auto", chat_format: str | None = None,
                 max_prompt_tokens: int | None = None, max_length: int | None = None):
        if kind not in (*PREFERENCE_KINDS, "auto"):
            raise DataError(f"--preference {kind}: expected one of {', '.join(PREFERENCE_KINDS)} (or no value: "
                            "read from the first row)")
        for flag, value in (("--max-prompt-tokens", max_prompt_tokens), ("--max-length", max_length)):
            if value is not None and value < 1:
                raise DataError(f"{flag} must be at least 1, got {value}")
        self.tok, self.kind, self.chat_format = tok, kind, chat_format
        self.max_prompt, self.max_length = max_prompt_tokens, max_length
        self.tally = Tally()
        self._renderer: ChatRenderer | None = None  # made at the first conversation
        eos = getattr(tok, "eos_id", None)
        self.end = np.asarray([eos] if eos is not None else tok.separator, dtype=np.int64)  # after a text completion
        bos = getattr(tok, "bos_id", None)
        adds_bos = bos is not None and tok.tok.encode("x").ids[:1] == [bos]
        self.bos = np.asarray([bos] if adds_bos else [], dtype=np.int64)

    def __call__(self, row: dict, where: str) -> Example | None:
        """The row's Example, or None when it is dropped (counted in `tally`)."""
        self.tally.rows += 1
        if self.kind == "auto":
            self.kind = _kind_of(row, where)
        prompt, completions, label = self._fields(row, where)
        if len(completions) == 2 and completions[0] == completions[1]:
            self.tally.drop("identical", where)
            return None
        if isinstance(prompt, list):
            self.tally.conversational += 1
            ids = self._rendered(prompt, completions, where)
        else:
            ids = [np.concatenate([self.bos, encode_text(self.tok, prompt)[0]])]
            ids += [np.concatenate([encode_text(self.tok, c)[0], self.end]) for c in completions]
        return self._truncated(Example(ids[0], ids[1:], label), where)

    def _fields(self, row: dict, where: str) -> tuple:
        """(prompt, completions, label) of a row, checked; an implicit prompt split off (not from a pair whose
        chosen is its rejected: that pair is dropped whole)."""
        names = COMPLETIONS[self.kind]
        missing = [k for k in (*names, *(("prompt", "label") if self.kind == "unpaired" else ())) if k not in row]
        if missing:
            found = ", ".join(sorted(row)) or "none"
            raise DataError(f"{where}: no `{missing[0]}` field (found {found}); {EXPECTED[self.kind]}")
        label = 0
        if self.kind == "unpaired":
            if not isinstance(row["label"], bool):
                raise DataError(f"{where}: `label` is {row['label']!r}; give true (a desirable completion) or false "
                                "(an undesirable one)")
            label = int(row["label"])
        completions = [row[k] for k in names]
        identical = len(completions) == 2 and completions[0] == completions[1]
        if "prompt" in row:
            prompt = row["prompt"]
        else:
            prompt = _shared_start(*completions) if not identical else completions[0][:0]
            completions = [c[len(prompt):] for c in completions]
        fields = {"prompt": prompt, **dict(zip(names, completions))}
        shapes = {k: _what(v) for k, v in fields.items()}
        if len(set(shapes.values())) > 1 or shapes["prompt"] not in SHAPES:
            odd = next((k for k, v in shapes.items() if v not in SHAPES), None) or \
                next(k for k in names if shapes[k] != shapes["prompt"])
            other = names[0] if odd == "prompt" else "prompt"
            raise DataError(f"{where}: `{odd}` is {shapes[odd]} where `{other}` is {shapes[other]}; give every field "
                            "as text, or every one as a list of {\"role\", \"content\"} turns")
        conversational = isinstance(prompt, list)
        for name, value in fields.items():
            if conversational:
                check_turns(value, where, name)
            if name == "prompt":
                continue
            if not (any(m["content"].strip() for m in value) if conversational else value.strip()):
                raise DataError(f"{where}: `{name}` is empty, so there is nothing to train on; fix the row or "
                                "remove it")
            if conversational and not any(m["role"] == "assistant" for m in value):
                raise DataError(f"{where}: `{name}` holds no assistant turn; a completion is the assistant's answer")
        return prompt, completions, label

    def _rendered(self, prompt: list, completions: list, where: str) -> list[np.ndarray]:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tok, self.chat_format or "template")
        before = self._renderer.render(prompt, where, generation_prompt=True)
        ids = [encode_text(self.tok, before)[0]]
        for turns in completions:
            whole = self._renderer.render(prompt + turns, where)
            if not whole.startswith(before):
                raise DataError(f"{where}: {PREFIX_REWRITTEN}")
            ids.append(encode_text(self.tok, whole[len(before):])[0])
        return ids

    def _truncated(self, ex: Example, where: str) -> Example | None:
        prompt_cut = self.max_prompt is not None and ex.prompt.size > self.max_prompt
        if prompt_cut:
            ex.prompt = ex.prompt[ex.prompt.size - self.max_prompt:]
        room = max(self.max_length - ex.prompt.size, 0) if self.max_length is not None else None
        completion_cut = room is not None and any(c.size > room for c in ex.completions)
        ex.completions = [c[:room] for c in ex.completions]
        # a target is predicted from the token before it: without a prompt, a completion's first token is none
        if min(c.size for c in ex.completions) - (ex.prompt.size == 0) < 1:
            self.tally.drop("too_long", where)
            return None
        if len(ex.completions) == 2 and np.array_equal(*ex.completions):
            self.tally.drop("identical", where)
            return None
        self.tally.prompts_cut += prompt_cut
        self.tally.completions_cut += completion_cut
        self.tally.desirable += ex.label
        return ex

    def report(self, kept: int) -> list[str]:
        """Lines on what was dropped or cut, for the user."""
        t, lines = self.tally, []
        if t.too_long:
            lines.append(f"{t.too_long} row(s) dropped, no completion token left to train on (first: "
                         f"{t.first['too_long']}); raise --max-length or lower --max-prompt-tokens")
        if t.identical:
            lines.append(f"warning: {t.identical} pair(s) dropped whose chosen and rejected are the same tokens "
                         f"(first: {t.first['identical']}): they teach nothing; fix or remove them")
        cut = ([f"{t.prompts_cut} prompt(s) from the left (--max-prompt-tokens {self.max_prompt})"] if t.prompts_cut
               else []) + ([f"{t.completions_cut} row(s)' completions from the right (--max-length {self.max_length})"]
                           if t.completions_cut else [])
        if cut:
            lines.append(f"truncated {' and '.join(cut)}; {kept} of {t.rows} row(s) kept")
        return lines

    def describe(self) -> dict:
        """meta.json's `preference` entry."""
        t = self.tally
        d = {"kind": self.kind, "index_columns": list(INDEX_COLUMNS[self.kind]), "rows_read": t.rows,
             "conversational_rows": t.conversational, "chat_format": (self.chat_format or "template")
             if t.conversational else None, "max_prompt_tokens": self.max_prompt, "max_length": self.max_length,
             "prompts_truncated": t.prompts_cut, "completions_truncated": t.completions_cut,
             "dropped_no_completion": t.too_long}
        if self.kind == "pairs":
            d["dropped_identical"] = t.identical
        else:
            d["desirable"] = t.desirable
        return d


def row_key(row: dict) -> str:
    """The text a row's split (--val-fraction) is decided by."""
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)


def _kind_of(row: dict, where: str) -> str:
    if "chosen" in row or "rejected" in row:
        return "pairs"
    if "completion" in row or "label" in row:
        return "unpaired"
    found = ", ".join(sorted(row)) or "none"
    raise DataError(f"{where}: neither a preference pair nor an unpaired example (found {found}); "
                    f"{EXPECTED['pairs']}; {EXPECTED['unpaired']}")


def _shared_start(chosen, rejected):
    """TRL's implicit prompt: the turns two conversations share, or the characters two texts share, less a
    trailing space (which then starts each completion, as tokenizers attach a space to the next word)."""
    if not (isinstance(chosen, type(rejected)) and isinstance(chosen, (str, list))):
        return ""  # the field check names the mismatch
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n]


SHAPES = ("text", "a list of turns")


def _what(value) -> str:
    return SHAPES[0] if isinstance(value, str) else SHAPES[1] if isinstance(value, list) else type(value).__name__


def summary(meta: dict, out: str) -> list[str]:
    """prepare's closing lines for preference data, from its meta.json."""
    p = meta["preference"]
    what = "preference pairs" if p["kind"] == "pairs" else "unpaired examples"
    n = meta["num_documents"] + meta.get("num_val_documents", 0)
    labels = f", {p['desirable']} desirable" if p["kind"] == "unpaired" else ""
    chat = f", {p['conversational_rows']} conversational (--chat-format {p['chat_format']})" \
        if p["conversational_rows"] else ""
    lines = [f"wrote {meta['num_documents']:,} {what}{labels}{chat} ({meta['num_tokens']:,} tokens, {meta['dtype']}, "
             f"{len(meta['shards'])} shard(s), vocabulary {meta['tokenizer']['vocab_size']}) to {out}; "
             f"{p['rows_read'] - n} of {p['rows_read']} row(s) dropped"]
    if "val_shards" in meta:
        lines.append(f"validation split: {meta['num_val_documents']:,} {what}, {meta['num_val_tokens']:,} tokens "
                     f"(--val-fraction {meta['val_fraction']:g} by row)")
    return lines
