"""`load_tokenizer`: the tokenizer of a Hugging Face model folder or of a GGUF file.

Above both builders (`Tokenizer.from_dir` in server.text.tokenizer, `tokenizer_from_gguf` in
server.text.gguf_tokenizer, which builds on the first), so neither imports the other back.
"""
from __future__ import annotations

from pathlib import Path

from server.models.gguf_file import is_gguf_path
from server.text.gguf_tokenizer import tokenizer_from_gguf
from server.text.tokenizer import Tokenizer


def load_tokenizer(model: str | Path) -> Tokenizer:
    """The tokenizer of a model folder, or the one a GGUF file's metadata describes."""
    if is_gguf_path(model):
        return tokenizer_from_gguf(model)
    return Tokenizer.from_dir(model)
