"""Named random-weight model shapes for the benchmarks, and a builder that writes them as cached Hugging Face folders.

A shape fixes an architecture and its sizes (not its weights): the benchmarks measure speed, so
random weights (normal, std 0.02, fixed seed) are enough, and nothing needs downloading. Built
models are cached under `bench/out/models/<shape>-<dtype>/` and reused while their recorded
fingerprint (shape + dtype + builder version) matches.

Usage:
    .venv/bin/python -m bench.shapes llama-246m --dtype bfloat16   # build (or find) and print its path
    .venv/bin/python bench/shapes.py --list
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_CACHE_DIR = BENCH_DIR / "out" / "models"
# Bump when the builder changes what it writes, so cached folders are rebuilt.
BUILDER_VERSION = 2
COMPLETE_MARKER = ".pagewire-bench-complete.json"

BOS_ID, EOS_ID = 1, 2
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, Llama style (fallback tokenizer)
# A minimal chat template so chat endpoints work against bench models too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """The architecture and sizes of a benchmark model; weights are random."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    description: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_params(self) -> int:
        """Parameter count (embeddings and lm_head included; norms included)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        return self.num_hidden_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2) + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes per token: K and V, every layer."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


SHAPES: dict[str, ModelShape] = {
    "llama-246m": ModelShape(
        architecture="LlamaForCausalLM",
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        description="the issue's benchmark shape: 16 layers, GQA 16/4, head_dim 64, untied embeddings",
    ),
    "llama-tiny": ModelShape(
        architecture="LlamaForCausalLM",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=704,
        description="smoke-test shape: same vocab as llama-246m, head_dim 64",
    ),
}

DTYPES = ("float32", "bfloat16", "float16")


def _fingerprint(shape_name: str, dtype: str) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    return {"shape": shape_name, "dtype": dtype, "builder_version": BUILDER_VERSION, "params": asdict(shape)}


def model_dir_for(shape_name: str, dtype: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Where `make_random_model` caches this shape in this dtype."""
    return Path(cache_dir) / f"{shape_name}-{dtype}"


def is_built(model_dir: Path, shape_name: str, dtype: str) -> bool:
    """True when `model_dir` holds a complete build of exactly this shape and dtype."""
    marker = Path(model_dir) / COMPLETE_MARKER
    try:
        return json.loads(marker.read_text()) == _fingerprint(shape_name, dtype)
    except (OSError, ValueError):
        return False


# -- tokenizer ----------------------------------------------------------------------------------
def _local_text(max_bytes: int) -> Iterator[str]:
    """Deterministic local training text: this Python's standard library sources, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def train_bpe_tokenizer(out_dir: Path, vocab_size: int, max_text_bytes: int = 8_000_000) -> None:
    """Train a byte-level BPE on local text and write tokenizer.json + tokenizer_config.json.

    If training stops short of `vocab_size` (not enough merges in the text), the vocabulary is
    padded with `<|filler_N|>` tokens so that every model token id in [0, vocab_size) decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_local_text(max_text_bytes), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|filler_{i}|>" for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


class TokenizerSummary(NamedTuple):
    """Which builder wrote the tokenizer, its trained size (before padding) and its special ids."""

    source: str
    trained_vocab_size: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]


def pad_tokenizer_vocab(out_dir: Path, vocab_size: int) -> int:
    """Pad tokenizer.json with plain (non-special) `<|filler_N|>` tokens up to `vocab_size`.

    A random-weight model samples ids from its whole 32000-token vocabulary; padding makes every
    id decode to non-empty text, so streamed deltas are never empty. Returns the size before.
    """
    from tokenizers import Tokenizer

    path = out_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    before = tok.get_vocab_size()
    if before < vocab_size:
        tok.add_tokens([f"<|filler_{i}|>" for i in range(before, vocab_size)])
        tok.save(str(path))
    return before


def write_tokenizer(out_dir: Path, vocab_size: int) -> TokenizerSummary:
    """Write a tokenizer into `out_dir`, padded to `vocab_size` ids.

    Prefers the project's demo-model tokenizer (`server.models.demo_model.build_tokenizer`), so bench
    models tokenise and chat like the demo model; falls back to training a BPE here.
    """
    try:
        from server.models.demo_model import build_tokenizer
    except ImportError:
        build_tokenizer = None  # type: ignore[assignment]
    summary: Optional[TokenizerSummary] = None
    if build_tokenizer is not None:
        try:
            info = build_tokenizer(out_dir, vocab_size=vocab_size)
            summary = TokenizerSummary("server.models.demo_model.build_tokenizer", info.vocab_size,
                                       info.bos_token_id, tuple(info.eos_token_ids))
        except Exception as exc:  # a colleague's builder failing must not block benchmarks
            print(f"[shapes] server.models.demo_model.build_tokenizer failed ({exc!r}); training a BPE here",
                  file=sys.stderr)
    if summary is None:
        train_bpe_tokenizer(out_dir, vocab_size)
        summary = TokenizerSummary("bench.shapes.train_bpe_tokenizer", vocab_size, BOS_ID, (EOS_ID,))
    trained = pad_tokenizer_vocab(out_dir, vocab_size)
    return summary._replace(trained_vocab_size=trained)


# -- model --------------------------------------------------------------------------------------
def hf_config(shape_name: str, dtype: str, bos_token_id: int = BOS_ID,
              eos_token_ids: tuple[int, ...] = (EOS_ID,)) -> Any:
    """The transformers config object for a named shape, with the tokenizer's special ids."""
    import transformers

    shape = SHAPES[shape_name]
    config_cls = getattr(transformers, shape.architecture.replace("ForCausalLM", "Config"))
    return config_cls(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        initializer_range=0.02,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids),
        pad_token_id=eos_token_ids[0],
        architectures=[shape.architecture],
        torch_dtype=dtype,
    )


def make_random_model(
    shape_name: str,
    out_dir: Optional[Path] = None,
    dtype: str = "bfloat16",
    *,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write (or reuse) a random-weight Hugging Face folder for a named shape.

    Args:
        shape_name: a key of SHAPES, e.g. "llama-246m".
        out_dir: target folder; default `bench/out/models/<shape>-<dtype>`. Reused when it already
            holds a complete build of the same shape and dtype (unless `force`).
        dtype: "float32", "bfloat16" or "float16": the dtype the weights are stored in.
        seed: torch seed for the random init (normal, std 0.02).
        force: rebuild even if a matching build exists.

    Returns:
        The folder, holding config.json, model.safetensors, generation_config.json,
        tokenizer.json and tokenizer_config.json.
    """
    if shape_name not in SHAPES:
        raise KeyError(f"unknown shape {shape_name!r}; known: {', '.join(SHAPES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir) if out_dir is not None else model_dir_for(shape_name, dtype)
    if not force and is_built(out, shape_name, dtype):
        return out

    import torch
    import transformers

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shape = SHAPES[shape_name]
    # Tokenizer first: the model config must carry its bos/eos ids. save_pretrained then writes a
    # generation_config.json consistent with both.
    tok = write_tokenizer(out, shape.vocab_size)
    config = hf_config(shape_name, dtype, tok.bos_token_id, tok.eos_token_ids)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, shape.architecture)
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / COMPLETE_MARKER).write_text(json.dumps(_fingerprint(shape_name, dtype)))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[shapes] built {shape_name} ({n_params / 1e6:.1f}M params, {dtype}) at {out}; "
          f"tokenizer from {tok.source} ({tok.trained_vocab_size} trained tokens, padded to {shape.vocab_size})",
          file=sys.stderr)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--list", action="store_true", help="list the shapes")
    args = parser.parse_args(argv)
    if args.list or args.shape is None:
        for name, s in SHAPES.items():
            print(f"{name:12s} {s.architecture} hidden={s.hidden_size} layers={s.num_hidden_layers} "
                  f"heads={s.num_attention_heads}/{s.num_key_value_heads} inter={s.intermediate_size} "
                  f"vocab={s.vocab_size} params={s.num_params() / 1e6:.1f}M  {s.description}")
        return 0
    print(make_random_model(args.shape, args.out_dir, args.dtype, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
