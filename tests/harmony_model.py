"""make_harmony_model: a tiny gpt-oss whose greedy output is harmony, for the end-to-end tests
(tests/server/test_harmony_api.py, tests/engine/test_harmony_llm.py); no downloads.

Random weights do not write harmony, so this model's are set by hand, as a bigram chain with one
bit of context:
  * the token embeddings of the chain's tokens are orthonormal (times 8); the lm_head row of a
    token is the sum of the embeddings of the tokens it must follow, so the next token is a
    function of the current one;
  * one attention layer (queries zero, so every key scores alike, and a large sink, so each
    key's weight hardly depends on the prompt's length) reads one dimension, set only on the
    marker token `to=assistant` that the chat template writes in a tool result's header, into a
    dimension of the residual that one lm_head row also reads: the first
    answer token differs when the conversation holds a tool result;
  * the experts are zero, so the MoE layer adds nothing (its router and sinks are still loaded).
A conversation without a tool result is answered with reasoning and a tool call (SCRIPT_CALL);
with one, with reasoning and a final JSON answer (SCRIPT_FINAL). Inside one answer every token is
distinct (a bigram chain cannot repeat a token), so the tags a script writes twice are spelled
in pieces ("<|ch" "annel|>"); the parsers read text, and the final header uses the real special
tokens, which the engine's harmony gate for structured outputs reads as token ids.
`make_harmony_model` checks both scripts against transformers' greedy output.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>")
MARKER = "to=assistant"
REASON_CALL = "The user wants the weather."
REASON_FINAL = "Sunny; answer in JSON."
ARGS = '{"city": "Paris"}'
ANSWER = '{"weather": "sunny"}'
# Each script's tokens, as token strings (every one a single token of the tokenizer).
SCRIPT_CALL = ("<|ch", "annel|>", "analysis", "<|mes", "sage|>", REASON_CALL, "<|end|>",
               "<|chan", "nel|>", "commentary to=functions.get_weather", "<|messa", "ge|>", ARGS, "<|call|>")
SCRIPT_FINAL = ("<|c", "hannel|>", "ana", "lysis", "<|m", "essage|>", REASON_FINAL, "<|e", "nd|>",
                "<|channel|>", "final", "<|message|>", ANSWER, "<|return|>")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def with_tool_result(call_id: str = "call_1") -> list[dict[str, Any]]:
    """The conversation after the call: the assistant's tool call and the tool's result."""
    return USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 20}'}]


# A harmony-shaped template (gpt-oss's own is long): developer tools, user turns, the assistant's
# past calls, tool results with the `to=assistant` marker, and the `<|start|>assistant` prompt.
# The analysis channel is what the model writes first.
TEMPLATE = (
    "{#- the model answers on the analysis channel, then the final one (or a tool call) #}"
    "{%- if tools %}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- for tc in m.tool_calls %}{%- set a = tc.function.arguments %}"
    "<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>"
    "{{ a if a is string else a | tojson }}<|call|>{%- endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def _greedy(model: Any, ids: list[int], n: int, eos: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


def make_harmony_model(out: Path) -> dict[str, Any]:
    """Write the model folder; returns {"path", "call_ids", "final_ids", "eos"} (the two scripts'
    token ids, each ending with its stop token)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from server.models.demo_model import build_tokenizer
    from server.text.loader import load_tokenizer
    from tests.tiny_models import make_tiny_model

    build_tokenizer(out, vocab_size=400)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    words = [w for w in dict.fromkeys(SCRIPT_CALL + SCRIPT_FINAL + (MARKER,)) if w not in SPECIALS]
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    tok.save(str(out / "tokenizer.json"))
    tid = {s: tok.token_to_id(s) for s in SPECIALS + tuple(words)}
    assert all(v is not None for v in tid.values())
    vocab = tok.get_vocab_size()
    eos = [tid["<|return|>"], tid["<|call|>"]]
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    added = cfg["added_tokens_decoder"]
    for s in SPECIALS:
        added[str(tid[s])] = {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}
    cfg.update({"chat_template": TEMPLATE, "eos_token": "<|return|>"})
    cfg_path.write_text(json.dumps(cfg))
    make_tiny_model(out, "gpt_oss", vocab_size=vocab, num_hidden_layers=1, sliding_window=64,
                    bos_token_id=None, eos_token_id=eos, seed=11)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))

    mine = load_tokenizer(out)

    def prompt(messages: list[dict[str, Any]]) -> list[int]:
        return mine.encode(mine.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS),
                           add_special_tokens=False)

    p_call, p_final = prompt(USER), prompt(with_tool_result())
    assert p_call[-1] == p_final[-1]
    chain = [p_call[-1]] + [tid[s] for s in SCRIPT_CALL + SCRIPT_FINAL]
    assert len(set(chain)) == len(chain)  # distinct within and across the scripts
    w = load_file(str(out / "model.safetensors"))
    H = w["model.embed_tokens.weight"].shape[1]
    basis = torch.linalg.qr(torch.randn(H - 4, H - 4, generator=torch.Generator().manual_seed(3)))[0]
    emb = w["model.embed_tokens.weight"]
    emb[:, H - 4:] = 0
    for i, t in enumerate(dict.fromkeys(chain)):
        emb[t] = 0
        emb[t, : H - 4] = 8 * basis[i]
    marker = tid[MARKER]
    emb[marker] = 0
    emb[marker, H - 1] = 1.0  # the input norm makes this 8 whatever its size
    head = torch.zeros(vocab, H)
    for script in (SCRIPT_CALL, SCRIPT_FINAL):
        ids = [p_call[-1]] + [tid[s] for s in script]
        for a, b in zip(ids, ids[1:]):
            head[b] += emb[a] / 8
    first = tid[SCRIPT_FINAL[0]]  # the tool-result answer's first token: 3/4 of the row, plus the marker
    head[first] *= 0.75
    head[first, H - 2] = 1.0
    w["lm_head.weight"] = head
    a = "model.layers.0."
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w[f"{a}self_attn.{name}.weight"].zero_()
        w[f"{a}self_attn.{name}.bias"].zero_()
    # A sink of logit ln(1000) outweighs the (at most a few hundred) zero-score keys, so each key
    # weighs about 1/1000 whatever the prompt's length: the marker reads as about 4.
    w[f"{a}self_attn.sinks"].fill_(math.log(1000.0))
    w[f"{a}self_attn.v_proj.weight"][0, H - 1] = 500.0  # kv head 0, dim 0 <- the marker dimension (8 after the norm)
    w[f"{a}self_attn.o_proj.weight"][H - 2, 0] = 1.0  # query head 0's dim 0 -> the readout dimension
    for name in ("input_layernorm", "post_attention_layernorm"):
        w[f"{a}{name}.weight"].fill_(1.0)
    w["model.norm.weight"].fill_(1.0)
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        w[f"{a}mlp.experts.{name}"].zero_()
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})

    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want_call = [tid[s] for s in SCRIPT_CALL]
    want_final = [tid[s] for s in SCRIPT_FINAL]
    got_call, got_final = _greedy(model, p_call, 32, eos), _greedy(model, p_final, 32, eos)
    assert got_call == want_call, (got_call, want_call)
    assert got_final == want_final, (got_final, want_final)
    return {"path": out, "call_ids": want_call, "final_ids": want_final, "eos": eos, "vocab_size": vocab}
