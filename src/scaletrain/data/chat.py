"""Chat and instruction records -> (token ids, loss mask): what `scaletrain prepare --chat-format` writes.

A record (one jsonl line) is either `messages`, a list of {"role", "content"} turns, or one
prompt field (PROMPT_FIELDS) with one response field (RESPONSE_FIELDS), and an optional
"system" field; the latter becomes [system,] user, assistant turns.

Rendering:
    template   the tokenizer's own chat template (a Hugging Face folder's `chat_template`),
               through transformers' apply_chat_template. The assistant's spans are found by
               rendering prefixes: the text of turns [0, i) with the generation prompt ends where
               assistant turn i starts, the text of turns [0, i] where it ends (its end-of-turn
               marker included). A token is the assistant's when its first character is.
    plain      "Role: content\\n" per turn ("User: ...\\nAssistant: ...\\n"), for any tokenizer; the
               assistant's content and its newline are counted, the "Assistant: " label is not.

The mask holds 1 where a token is a training target (the loss counts it), else 0; the
separator after each record is counted with the assistant's tokens only under `loss_on_prompt`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from scaletrain.errors import DataError
from scaletrain.vocab import did_you_mean

CHAT_FORMATS = ("template", "plain")
PROMPT_FIELDS = ("prompt", "instruction", "question")
RESPONSE_FIELDS = ("response", "completion", "output", "answer")
# the roles of Hugging Face's chat format; another (a misspelling) would be rendered as a prompt turn and never
# trained on, so it is refused
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
PREFIX_REWRITTEN = ("the tokenizer's chat template renders a conversation's prefix differently from the whole (it "
                    "rewrites earlier turns), so the assistant's tokens cannot be found; use --chat-format plain")
EXPECTED = (f"a `messages` list of {{\"role\", \"content\"}} turns, or one of {', '.join(PROMPT_FIELDS)} with one of "
            f"{', '.join(RESPONSE_FIELDS)}")


def iter_records(files: list[Path]) -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) for each record of jsonl files (.jsonl, .jsonl.gz), `where` = FILE:LINE."""
    for f in files:
        name = f.name
        if not (name.endswith(".jsonl") or name.endswith(".jsonl.gz")):
            raise DataError(f"{f}: chat data is read from .jsonl or .jsonl.gz files; convert it to jsonl, one "
                            "conversation a line")
        with (gzip.open(f, "rt", encoding="utf-8") if name.endswith(".gz") else f.open(encoding="utf-8")) as lines:
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{f}:{n}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e.msg})") from None
                yield where, messages_of(record, where)


def messages_of(record, where: str) -> list[dict]:
    """The turns of one record, checked: roles and contents are strings, an assistant turn exists."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a chat record must be a JSON object with {EXPECTED}")
    if "messages" in record:
        messages = record["messages"]
        check_turns(messages, where)
    else:
        prompt = next((record[k] for k in PROMPT_FIELDS if k in record), None)
        response = next((record[k] for k in RESPONSE_FIELDS if k in record), None)
        if not isinstance(prompt, str) or not isinstance(response, str):
            found = ", ".join(sorted(record)) or "none"
            raise DataError(f"{where}: no chat fields (found {found}); expected {EXPECTED}")
        system = record.get("system")
        messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to train on; every record needs one")
    return messages


def check_turns(messages, where: str, field: str = "messages") -> None:
    """`messages` (a record's `field`) is a list of {"role", "content"} turns, each role a known one."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where}: `{field}` must be a list of {{\"role\": str, \"content\": str}} turns")
    for m in messages:
        if m["role"] not in KNOWN_ROLES:
            raise DataError(f"{where}: role {m['role']!r} is not one of {', '.join(KNOWN_ROLES)}"
                            f"{did_you_mean(m['role'], KNOWN_ROLES)}; fix the record (only the assistant's turns "
                            "are trained on)")


class ChatRenderer:
    """messages -> (ids, mask) with one tokenizer and format (see the module's docstring)."""

    def __init__(self, tok, chat_format: str, loss_on_prompt: bool = False):
        if chat_format not in CHAT_FORMATS:
            raise DataError(f"--chat-format {chat_format}: expected one of {', '.join(CHAT_FORMATS)}")
        self.tok, self.format, self.loss_on_prompt = tok, chat_format, loss_on_prompt
        self.hf = None
        if chat_format == "template":
            self.hf = _template_tokenizer(tok)

    def __call__(self, messages: list[dict], where: str = "a record") -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of one record's turns; `where` (FILE:LINE) names it in a refusal."""
        text, spans = self._plain(messages) if self.hf is None else self._template(messages, where)
        ids, starts = self._encode(text)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for lo, hi in spans:
            mask[(starts >= lo) & (starts < hi)] = 1
        sep = np.asarray(self.tok.separator, dtype=np.int64)
        ids = np.concatenate([ids, sep])
        mask = np.concatenate([mask, np.zeros(sep.size, np.uint8)])
        if self.loss_on_prompt:
            mask[:] = 1
        return ids, mask

    def _plain(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        text, spans = "", []
        for m in messages:
            text += f"{m['role'].capitalize()}: "
            start = len(text)
            text += m["content"] + "\n"
            if m["role"] == "assistant":
                spans.append((start, len(text)))
        return text, spans

    def render(self, messages: list[dict], where: str = "a record", generation_prompt: bool = False) -> str:
        """The text of `messages`, ending with the start of an assistant turn with `generation_prompt`."""
        if self.hf is None:
            return self._plain(messages)[0] + ("Assistant: " if generation_prompt else "")
        from jinja2.exceptions import TemplateError  # (transformers renders templates with jinja2)

        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except TemplateError as e:  # the template's own raise_exception: a role or an order it refuses
            raise DataError(f"{where}: the tokenizer's chat template refuses this conversation ({e}); fix the "
                            "record, or give --chat-format plain") from None

    def _template(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        text, spans = self.render(messages, where), []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            through = self.render(messages[:i + 1], where)
            before = self.render(messages[:i], where, True) if i else through[:self._opening_header_end(through, where)]
            if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
                raise DataError(PREFIX_REWRITTEN)
            spans.append((len(before), len(through)))
        return text, spans

    def _opening_header_end(self, through: str, where: str) -> int:
        """Where the content of a conversation's opening assistant turn starts in `through` (that turn's text):
        after the role header the generation prompt writes, as for every later turn (the header is no target).
        An empty conversation does not render (transformers refuses it; Llama 3's template reads messages[0]):
        the header is what the generation prompt adds to a one-turn conversation, found in `through`; 0 when
        the template writes none or will not render that turn."""
        probe = [{"role": "user", "content": "?"}]
        try:
            with_prompt, without = self.render(probe, where, True), self.render(probe, where)
        except DataError:
            return 0
        header = with_prompt[len(without):] if with_prompt.startswith(without) else ""
        at = through.find(header) if header else -1
        return at + len(header) if at >= 0 else 0

    def _encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        return encode_text(self.tok, text)


def encode_text(tok, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `text`, no special token added (a template writes its own BOS), and each token's first
    character."""
    if tok.kind == "byte":
        raw = text.encode("utf-8")
        # a byte's character: the count of characters that start before it
        char_of = np.cumsum([(b & 0xC0) != 0x80 for b in raw]) - 1
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64), char_of.astype(np.int64)
    enc = tok.tok.encode(text, add_special_tokens=False)
    return np.asarray(enc.ids, dtype=np.int64), np.asarray([o[0] for o in enc.offsets], dtype=np.int64)


def _template_tokenizer(tok):
    """transformers' tokenizer of a Hugging Face folder, for its chat template; refused in one line
    for a tokenizer without one."""
    folder = getattr(tok, "source", None)
    if folder is None:
        raise DataError(f"--chat-format template needs a Hugging Face tokenizer folder with a chat_template; the "
                        f"{tok.kind} tokenizer has none: give --chat-format plain")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--chat-format template renders with transformers, which is not installed: pip install "
                        "transformers, or give --chat-format plain") from None
    hf = AutoTokenizer.from_pretrained(str(folder))
    if not getattr(hf, "chat_template", None):
        raise DataError(f"{folder}: the tokenizer has no chat_template (in tokenizer_config.json or "
                        "chat_template.jinja); give --chat-format plain, or a folder whose tokenizer has one")
    return hf
