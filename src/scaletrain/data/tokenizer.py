"""Tokenizers: built-in byte-level, a BPE trained locally, or a local `tokenizer.json`.

All three share one small interface (`encode`, `decode`, `vocab_size`, `describe`), and a
prepared data folder records which one made it, so training can decode samples and check the
vocabulary against the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from scaletrain.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train or download."""

    kind = "byte"
    vocab_size = 256
    separator: list[int] = [10, 10]  # documents are joined by a blank line

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": "byte", "vocab_size": 256}

    def save(self, folder: Path) -> None:
        pass


class HFTokenizer:
    """A `tokenizers` tokenizer: trained here as byte-level BPE, or loaded from tokenizer.json."""

    def __init__(self, tok, kind: str):
        self.tok = tok
        self.kind = kind
        self.vocab_size = tok.get_vocab_size()
        eot = tok.token_to_id(EOT)
        self.separator = [eot] if eot is not None else []

    @classmethod
    def from_file(cls, path: str | Path) -> "HFTokenizer":
        Tokenizer = _tokenizers().Tokenizer
        p = Path(path)
        if not p.is_file():
            raise DataError(f"tokenizer file {p} not found; give the path of a tokenizer.json")
        try:
            return cls(Tokenizer.from_file(str(p)), "file")
        except Exception as e:  # the library raises plain Exceptions for bad files
            raise DataError(f"tokenizer file {p} could not be read ({e}); is it a Hugging Face tokenizer.json?") from None

    @classmethod
    def train_bpe(cls, texts: Iterator[str], vocab_size: int) -> "HFTokenizer":
        tk = _tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, "bpe")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "file": TOKENIZER_FILE}

    def save(self, folder: Path) -> None:
        self.tok.save(str(folder / TOKENIZER_FILE))


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("BPE tokenizers need the `tokenizers` package: pip install tokenizers") from None
    return tokenizers


def load_tokenizer(meta_tokenizer: dict, folder: Path):
    """The tokenizer recorded in a prepared folder's metadata."""
    kind = meta_tokenizer.get("kind") if isinstance(meta_tokenizer, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("bpe", "file"):
        name = meta_tokenizer.get("file", TOKENIZER_FILE)
        if not isinstance(name, str) or Path(name).name != name:  # it lives in this folder, nowhere else
            raise DataError(f"{folder}: tokenizer file {name!r} in the metadata is not a plain file name in this "
                            "folder; re-run scaletrain prepare")
        return HFTokenizer.from_file(folder / name)
    raise DataError(f"{folder}: unknown tokenizer kind {kind!r} in the metadata; re-run scaletrain prepare")
