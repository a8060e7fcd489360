"""Quality of quantised weights: perplexity on a fixed text and greedy agreement with a baseline.

perplexity() feeds the text's tokens through the model in chunks of --chunk tokens (16 by
default: each chunk's matrix products then run the small-batch kernels -- the quantised ones for a
quantised model -- rather than prefill's dequantised GEMM), each chunk attending to everything
before it in a paged KV cache, and returns exp(mean negative log-likelihood of every next token).
greedy_tokens() generates with the engine (temperature 0) so agreement can be compared, and
divergence_margin() says whether a continuation that leaves the baseline's does so at a near-tie.

The text is tests/data/perplexity_text.txt (self-written for this project, 2.6 KB of plain English).
The tests in tests/models/test_quant_quality.py import this module; run it directly to print the
figures:
    .venv/bin/python -m bench.perplexity --model default --dtype bfloat16 --quantization none int8 gguf
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import Optional

import torch

from server.models.attention import AttentionMetadata
from server.models.decoder import DecoderForCausalLM
from server.models.loader import load_model

TEXT_PATH = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity_text.txt"
PROMPT = "The lighthouse keeper woke before the sun, and"


def load_quantized(model: str | Path, dtype: str, quantization: str) -> DecoderForCausalLM:
    """The model as the engine would load it with `quantization` (none, int8, int4 or gguf)."""
    m, _ = load_model(model, dtype, keep_gguf_blocks=quantization == "gguf")
    if quantization in ("int8", "int4"):
        m.quantize_weights(quantization)
    m.interleave_bf16()  # as the engine does: bf16 matrices in the x8 layout on AVX2
    return m


@torch.inference_mode()
def perplexity(model: DecoderForCausalLM, token_ids: list[int], chunk: int = 16, block_size: int = 16) -> float:
    """exp(mean NLL) of token_ids[1:] given their prefixes, fed `chunk` tokens per forward."""
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"token_ids: need at least 2 tokens, got {n}")
    num_blocks = (n + block_size - 1) // block_size
    shape = model.kv_cache_shape(num_blocks, block_size)
    kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
          for _ in range(model.config.num_layers)]
    table = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)  # one sequence, blocks in order
    nll = 0.0
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)  # the last token is only ever a target
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, dtype=torch.int64),
            block_tables=table,
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            max_query_len=end - start,
            max_seq_len=end,
        )
        ids = torch.tensor(token_ids[start:end], dtype=torch.int64)
        hidden = model(ids, torch.arange(start, end, dtype=torch.int64), kv, meta)
        logp = torch.log_softmax(model.compute_logits(hidden).double(), dim=-1)
        targets = torch.tensor(token_ids[start + 1:end + 1], dtype=torch.int64)
        nll -= float(logp.gather(1, targets.view(-1, 1)).sum())
    return math.exp(nll / (n - 1))


def greedy_tokens(model: str | Path, dtype: str, quantization: str, prompt: str = PROMPT, n: int = 32) -> list[int]:
    """The first `n` greedy tokens the engine generates for `prompt` (ignore_eos)."""
    return greedy_run(model, dtype, quantization, prompt, n)[1]


def greedy_run(model: str | Path, dtype: str, quantization: str, prompt: str = PROMPT,
               n: int = 32) -> tuple[list[int], list[int]]:
    """(the prompt's token ids, the first `n` greedy tokens) as the engine generates them."""
    from server import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, quantization=quantization, num_threads=torch.get_num_threads())
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return list(out[0].prompt_token_ids), list(out[0].outputs[0].token_ids)


@torch.inference_mode()
def position_logits(model: DecoderForCausalLM, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """The model's next-token logits (float64) after each prefix of `token_ids`, in one forward."""
    n = len(token_ids)
    num_blocks = (n + block_size - 1) // block_size
    shape = model.kv_cache_shape(num_blocks, block_size)
    kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
          for _ in range(model.config.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).view(1, -1),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    hidden = model(torch.tensor(token_ids, dtype=torch.int64), torch.arange(n, dtype=torch.int64), kv, meta)
    return model.compute_logits(hidden).double()


def divergence_margin(model: DecoderForCausalLM, prompt_ids: list[int], base: list[int],
                      other: list[int]) -> Optional[float]:
    """Where `other` first leaves the baseline continuation `base`: how far below its own pick the
    baseline model (`model`) scored `other`'s token there, in logits (None if they never part).
    Near 0 means a near-tie of the baseline, which any rounding may tip either way."""
    lead, _ = agreement(base, other)
    if lead >= min(len(base), len(other)):
        return None
    row = position_logits(model, prompt_ids + base[:lead])[-1]
    return float(row[base[lead]] - row[other[lead]])


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(leading tokens equal, positions equal) of two greedy continuations."""
    lead = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return lead, sum(x == y for x, y in zip(a, b))


def text_token_ids(model: str | Path) -> list[int]:
    from server.text.loader import load_tokenizer

    return load_tokenizer(str(model)).encode(TEXT_PATH.read_text())


def main() -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a Hugging Face folder or .gguf file ('default': the default model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", nargs="+", default=["none", "int8", "gguf"],
                   choices=["none", "int8", "int4", "gguf"], help="the first is the baseline")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    model: str | Path = a.model
    if a.model == "default":
        from server.models.default_model import find_default_model

        found = find_default_model()
        if found is None:
            raise SystemExit("--model default: the default model package is not installed")
        model = found.path
    ids = text_token_ids(model)
    print(f"model {model} dtype {a.dtype}: {TEXT_PATH.name}, {len(ids)} tokens, chunks of {a.chunk}")
    base_ppl, base_tokens = 0.0, []
    for q in a.quantization:
        ppl = perplexity(load_quantized(model, a.dtype, q), ids, a.chunk)
        tokens = greedy_tokens(model, a.dtype, q)
        if not base_tokens:
            base_ppl, base_tokens = ppl, tokens
        lead, same = agreement(base_tokens, tokens)
        print(f"  {q:5s}: perplexity {ppl:8.4f} ({(ppl / base_ppl - 1) * 100:+6.2f}% vs {a.quantization[0]})  "
              f"greedy vs {a.quantization[0]}: first {lead}/32 equal, {same}/32 positions equal")


if __name__ == "__main__":
    main()
