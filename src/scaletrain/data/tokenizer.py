"""Tokenizers: built-in byte-level, a BPE trained locally, a local `tokenizer.json`, or the fast
tokenizer of a Hugging Face model folder.

All four share one small interface (`encode`, `decode`, `vocab_size`, `describe`), and a
prepared data folder records which one made it, so training can decode samples and check the
vocabulary against the model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from scaletrain.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"
# what transformers' AutoTokenizer reads from a model folder for a fast tokenizer
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIAL_FILE = "special_tokens_map.json"
# the chat template, where a folder keeps it apart from tokenizer_config.json (transformers >= 4.43 writes
# chat_template.jinja): copied with the rest, so chat data and exports keep it
HF_CHAT_FILES = ("chat_template.jinja", "chat_template.json")
HF_FILES = (TOKENIZER_FILE, HF_CONFIG_FILE, HF_SPECIAL_FILE, *HF_CHAT_FILES)
# the named special tokens, in the order transformers adds those missing from the vocabulary
HF_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train or download."""

    kind = "byte"
    vocab_size = 256
    separator: list[int] = [10, 10]  # documents are joined by a blank line

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

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
        self.source: Path | None = None  # the Hugging Face folder (kind "hf") whose files save() copies
        self.model_vocab_size: int | None = None  # its config.json's vocab_size, when larger (padding rows)
        self.bos_id: int | None = None
        self.eos_id: int | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        Tokenizer = _tokenizers().Tokenizer
        p = Path(path)
        if not p.is_file():
            raise DataError(f"tokenizer file {p} not found; give the path of a tokenizer.json")
        try:
            return cls(Tokenizer.from_file(str(p)), "file")
        except Exception as e:  # the library raises plain Exceptions for bad files
            raise DataError(f"tokenizer file {p} could not be read ({e}); "
                            "is it a Hugging Face tokenizer.json?") from None

    @classmethod
    def from_hf_folder(cls, path: str | Path, *, read_model_config: bool = True) -> HFTokenizer:
        """The fast tokenizer of a Hugging Face model folder, encoding as transformers'
        `AutoTokenizer.from_pretrained(folder)(text)["input_ids"]` does by default: tokenizer.json
        (its post-processor adds BOS/EOS where the model wants them), plus the special tokens that
        tokenizer_config.json names and the vocabulary lacks. Documents are separated by the EOS
        token, unless encoding already ends each one with it."""
        folder = Path(path)
        if not folder.is_dir():
            raise DataError(f"--tokenizer {folder}: no such folder; give byte, bpe, file or a Hugging Face model "
                            "folder holding tokenizer.json")
        if not (folder / TOKENIZER_FILE).is_file():
            found = ", ".join(sorted(p.name for p in folder.iterdir() if "token" in p.name)) or "no tokenizer files"
            raise DataError(f"{folder}: no {TOKENIZER_FILE} (found {found}); scaletrain reads fast tokenizers only: "
                            "convert it once with transformers, AutoTokenizer.from_pretrained(FOLDER)"
                            ".save_pretrained(FOLDER)")
        self = cls.from_file(folder / TOKENIZER_FILE)
        self.kind, self.source = "hf", folder
        tk = _tokenizers()
        # special_tokens_map.json is the older place for them; tokenizer_config.json wins
        config = {**_read_json(folder / HF_SPECIAL_FILE), **_read_json(folder / HF_CONFIG_FILE)}
        special = {k: _token_text(config.get(k)) for k in HF_SPECIAL}
        missing = [t for t in special.values() if t is not None and self.tok.token_to_id(t) is None]
        if missing:
            self.tok.add_special_tokens([tk.AddedToken(t, special=True) for t in dict.fromkeys(missing)])
        # tokenizer.json's post-processor says which special tokens encoding adds: transformers (v5)
        # drops tokenizer_config.json's add_bos_token/add_eos_token when a tokenizer.json exists
        bos, eos = special["bos_token"], special["eos_token"]
        self.bos_id = self.tok.token_to_id(bos) if bos is not None else None
        self.eos_id = self.tok.token_to_id(eos) if eos is not None else None
        ends_with_eos = self.eos_id is not None and self.tok.encode("x").ids[-1:] == [self.eos_id]
        self.separator = [] if self.eos_id is None or ends_with_eos else [self.eos_id]
        # ids, not their count: added tokens may leave gaps
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        if read_model_config and (folder / "config.json").is_file():
            model_vocab = _read_json(folder / "config.json").get("vocab_size")
            if model_vocab is not None and (isinstance(model_vocab, bool) or not isinstance(model_vocab, int)):
                raise DataError(f"{folder / 'config.json'}: vocab_size {model_vocab!r} is not an integer")
            if model_vocab is not None and model_vocab > self.vocab_size:
                self.model_vocab_size = model_vocab
        return self

    def hf_files(self, max_len: int) -> dict[str, str]:
        """The copied Hugging Face files (kind "hf") for an exported model folder, with
        model_max_length set to the model's, and the BOS/EOS ids for its config.json."""
        assert self.source is not None, "hf_files needs a tokenizer read from a Hugging Face folder"
        files = {name: (self.source / name).read_text() for name in HF_FILES if (self.source / name).is_file()}
        config = {**_read_json(self.source / HF_CONFIG_FILE), "model_max_length": max_len}
        files[HF_CONFIG_FILE] = json.dumps(config, indent=2) + "\n"
        ids = {k: v for k, v in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id)) if v is not None}
        return {**files, "special_ids.json": json.dumps(ids)}

    @classmethod
    def train_bpe(cls, texts: Iterator[str], vocab_size: int) -> HFTokenizer:
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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, as `encode` gives them (without the offsets `encode` also works out)."""
        fast = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # tokenizers >= 0.21 has the fast one
        return [e.ids for e in fast(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def describe(self) -> dict:
        d = {"kind": self.kind, "vocab_size": self.vocab_size, "file": TOKENIZER_FILE}
        if self.kind == "hf":
            d["files"] = [name for name in HF_FILES if (self.source / name).is_file()]
            if self.model_vocab_size is not None:  # the embedding rows the model has (padding past the tokenizer)
                d["model_vocab_size"] = self.model_vocab_size
        return d

    def save(self, folder: Path) -> None:
        if self.kind == "hf":  # the folder's own files, unchanged: transformers reads them as they were
            for name in HF_FILES:
                if (self.source / name).is_file():
                    shutil.copyfile(self.source / name, folder / name)
        else:
            self.tok.save(str(folder / TOKENIZER_FILE))


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("BPE tokenizers need the `tokenizers` package: pip install tokenizers") from None
    return tokenizers


def _read_json(path: Path) -> dict:
    """A JSON object from a Hugging Face folder; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); restore it from the model's files") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}; restore it from the model's files")
    return data


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


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
    if kind == "hf":
        names = meta_tokenizer.get("files", [TOKENIZER_FILE])
        if not isinstance(names, list) or TOKENIZER_FILE not in names or any(
                not isinstance(n, str) or n not in HF_FILES for n in names):
            raise DataError(f"{folder}: tokenizer files {names!r} in the metadata are not those of a Hugging Face "
                            f"tokenizer ({', '.join(HF_FILES)}); re-run scaletrain prepare")
        for name in names:  # a lost tokenizer_config.json would change the encoding without a word
            if not (folder / name).is_file():
                raise DataError(f"{folder / name}: the tokenizer file named in the metadata is missing; "
                                "re-run scaletrain prepare")
        return HFTokenizer.from_hf_folder(folder, read_model_config=False)
    raise DataError(f"{folder}: unknown tokenizer kind {kind!r} in the metadata; re-run scaletrain prepare")


# --------------------------------------------------------------------------------------------
# Which tokenizer: the identity of a vocabulary (data folders, exports, model.init_from)


def byte_chars() -> list[str]:
    """The printable character that byte-level BPE (`tokenizers`' ByteLevel) shows for each byte:
    printable Latin-1 bytes stand for themselves, the others take code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _identity(vocab: dict[str, int]) -> str:
    """A vocabulary's identity: how many ids it has and a hash of which text each id stands for."""
    import hashlib

    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:16]
    return f"{max(vocab.values(), default=-1) + 1}:{digest}"


def byte_identity() -> str:
    """The identity of scaletrain's byte-level tokenizer (as its exported tokenizer.json shows it)."""
    return _identity({c: b for b, c in enumerate(byte_chars())})


def tokenizer_json_identity(text: str) -> str | None:
    """The identity of a `tokenizers` tokenizer.json: its model's vocabulary and its added tokens."""
    try:
        tok = json.loads(text)
    except json.JSONDecodeError:
        return None
    model = tok.get("model") if isinstance(tok, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
        vocab = {entry[0]: i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    if not isinstance(vocab, dict):
        return None
    vocab = {str(k): int(v) for k, v in vocab.items() if isinstance(v, int)}
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str) and isinstance(added.get("id"), int):
            vocab[added["content"]] = added["id"]
    return _identity(vocab)


def identity_of_data(data_path: str) -> str | None:
    """The identity of a prepared data folder's tokenizer (empty path: the built-in byte-level
    data); None when the folder does not say."""
    if not data_path:
        return byte_identity()
    folder = Path(data_path)
    try:
        described = json.loads((folder / "meta.json").read_text())["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    kind = described.get("kind") if isinstance(described, dict) else None
    if kind == "byte":
        return byte_identity()
    name = described.get("file", TOKENIZER_FILE)
    if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
        return None
    return tokenizer_json_identity((folder / name).read_text(encoding="utf-8", errors="replace"))


def identity_of_weights(path: str | Path) -> str | None:
    """The identity of the tokenizer that weights to start from (model.init_from) were trained
    with: the tokenizer.json of a model folder (an `export --format hf`, a Hugging Face model), or
    what a `scaletrain export` safetensors file records; None when they do not say."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        try:
            from safetensors import safe_open

            with safe_open(str(p), "pt") as f:
                recorded = (f.metadata() or {}).get("scaletrain.tokenizer")
        except Exception:  # an unreadable header is reported by the weights' own loading
            return None
        if recorded:
            return recorded
        p = p.parent
    folder = p if p.is_dir() else p.parent
    if (folder / TOKENIZER_FILE).is_file():
        return tokenizer_json_identity((folder / TOKENIZER_FILE).read_text(encoding="utf-8", errors="replace"))
    return None


def describe_identity(identity: str) -> str:
    size = identity.split(":", 1)[0]
    kind = "byte-level" if identity == byte_identity() else "a vocabulary of"
    return f"{kind} {int(size):,} tokens" if kind != "byte-level" else "byte-level, 256 tokens"


def check_same_tokenizer(init_from: str, data_path: str, *, what: str = "model.init_from",
                         otherwise: str = "start from weights trained on this data's tokenizer") -> None:
    """Refuse weights (model.init_from; `what` names them otherwise, e.g. a folder `eval` reads) trained
    with another tokenizer than the data's: every token id would stand for other text. Weights that
    do not say which tokenizer they were trained with pass unchecked. `otherwise`: the other fix."""
    theirs, ours = identity_of_weights(init_from), identity_of_data(data_path)
    if theirs is None or ours is None or theirs == ours:
        return
    data = data_path or "the built-in data"
    folder = Path(init_from) if Path(init_from).is_dir() else Path(init_from).parent
    how = (f"scaletrain prepare INPUT... --out NEW_FOLDER --tokenizer {folder}" if (folder / TOKENIZER_FILE).is_file()
           else "the tokenizer of the run it was exported from")
    raise DataError(f"{what} {init_from} was trained with another tokenizer ({describe_identity(theirs)}) "
                    f"than data.path {data} ({describe_identity(ours)}): its token ids would stand for other text; "
                    f"prepare the data with its tokenizer ({how}), or {otherwise}")
