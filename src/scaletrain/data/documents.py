"""Documents packed in windows (data.document_mask): which token ends each one, and what cannot
honour the mask yet. Torch-free: config loading asks it. The mask itself is the model's
(scaletrain.model.transformer: document_ids, document_positions, document_mask); the targets it
leaves out are the dataset's (WindowDataset's `separator`)."""

from __future__ import annotations

from scaletrain.errors import ConfigError


def document_separator(data, source: str) -> int:
    """The one token id that ends each document of `data` (TokenData) for data.document_mask: the
    separator prepare wrote after each document, or the EOS a Hugging Face tokenizer ends each one
    with. Byte-level data, whose documents are joined by a blank line that the text holds too, and
    a tokenizer without such a token, are refused in one line."""
    tok = data.tokenizer
    separator = list(getattr(tok, "separator", []))
    if not separator and getattr(tok, "eos_id", None) is not None:
        separator = [tok.eos_id]  # its encoding already ends each document with EOS
    if len(separator) != 1:
        why = ("byte-level, whose documents are joined by a blank line that the text holds too" if tok.kind == "byte"
               else "written by a tokenizer without an end-of-document token (EOS or <|endoftext|>)")
        raise ConfigError(f"data.document_mask=true finds documents by the token that ends each one, but {source} is "
                          f"{why}; prepare the data with --tokenizer bpe or a Hugging Face tokenizer, or set "
                          "data.document_mask=false")
    return int(separator[0])


def document_mask_problems(cfg) -> list[str]:
    """What data.document_mask cannot honour yet whatever the layout: a mixture (the layouts whose
    ranks do not all see a window's token ids, and fault tolerance: scaletrain.legality). `cfg`: a
    JobConfig."""
    if not cfg.data.document_mask or not cfg.data.mix:
        return []
    return ["data.document_mask with data.mix is not supported (the mixture's sampler does not count the targets it "
            "leaves out); train on one folder (data.path), or set data.document_mask=false"]
