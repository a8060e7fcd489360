"""make_thinking_model: a tiny random-weight Qwen3 that "thinks", for the reasoning tests (no downloads).

A Qwen3-style chat template with a `<think>` block (the generation prompt opens it, as Qwen3's
thinking templates do, and `enable_thinking: false` renders it closed and empty), `<think>` /
`</think>` as added tokens, and an lm_head whose `</think>` row is a scaled copy of another
token's, so greedy decoding closes the block after a few tokens and then keeps answering: the
scale is searched once with transformers until the first `</think>` lands at position 3..12 of a
24-token greedy answer. Everything is checked against transformers' own greedy output.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


def make_thinking_model(out: Path) -> dict[str, Any]:
    """Write the model folder; returns {"path", "start_id", "end_id", "vocab_size"}."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from server.models.demo_model import build_tokenizer
    from server.text.loader import load_tokenizer
    from tests.tiny_models import make_tiny_model

    info = build_tokenizer(out, vocab_size=400)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    start_id, end_id = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    vocab = tok.get_vocab_size()
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    make_tiny_model(out, "qwen3", vocab_size=vocab, bos_token_id=info.bos_token_id,
                    eos_token_id=list(info.eos_token_ids), tie_word_embeddings=False, seed=7)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": info.bos_token_id, "eos_token_id": list(info.eos_token_ids)}))
    weights = load_file(str(out / "model.safetensors"))
    head = weights["lm_head.weight"].clone()
    ids = load_tokenizer(out).encode(
        load_tokenizer(out).apply_chat_template(PROMPT, add_generation_prompt=True), add_special_tokens=False)
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    plain = _greedy(model, ids, 24)
    # Copy (scaled) the row of a token the model emits a few tokens in: `</think>` then wins there.
    for donor_pos in range(3, 12):
        donor = plain[donor_pos]
        if donor in plain[:donor_pos] or donor in info.eos_token_ids:
            continue
        for scale in (1.05, 1.2, 1.5):
            head[end_id] = weights["lm_head.weight"][donor] * scale
            with torch.no_grad():
                model.lm_head.weight.copy_(head)
            got = _greedy(model, ids, 24)
            first = got.index(end_id) if end_id in got else -1
            tail = got[first + 1:]
            if 3 <= first <= 12 and len([t for t in tail if t not in (end_id, *info.eos_token_ids)]) >= 4:
                weights["lm_head.weight"] = head
                save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
                return {"path": out, "start_id": start_id, "end_id": end_id, "vocab_size": vocab,
                        "eos": list(info.eos_token_ids)}
    raise AssertionError("no lm_head scale put </think> inside the first 12 greedy tokens")


def greedy_reference(model_dir: Path, messages: list[dict[str, Any]], max_tokens: int, eos: list[int],
                     **template_kwargs: Any) -> tuple[list[int], str, list[int]]:
    """transformers' greedy answer: (prompt ids, its decoded text, its token ids), stopping at EOS."""
    import transformers as tf

    from server.text.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs),
                        add_special_tokens=False)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = _greedy(model, prompt, max_tokens)
    for i, t in enumerate(out):
        if t in eos:
            out = out[:i]
            break
    return prompt, tok.decode(out), out
