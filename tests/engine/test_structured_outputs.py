"""Structured outputs in the engine, on a random-weight tiny model: nothing but the constraint
makes its output valid, so every valid output is the grammar's doing.

Covers generated JSON schemas (validated with `jsonschema`), regex (`re.fullmatch`) and choice
constraints at temperature 1.0; n = 4 forks; forced preemption; prefix-cache hits; grammar
completion (stop like EOS) and dead ends; rollback; bad constraints raising SamplingParamsError.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from server import LLM, SamplingParams, StructuredOutputsParams
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.grammar import GrammarError, compiler_for
from server.engine.sampling_params import SamplingParamsError
from server.engine.structured import DEAD_END

# -- a seeded generator of bounded JSON schemas --------------------------------------------------


class SchemaGen:
    """Random JSON schemas whose instances are bounded in size (so a random model finishes):
    nested objects, arrays with minItems/maxItems, enums, bounded integers and numbers, required
    and optional properties, strings with maxLength or a pattern."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.names = ["id", "name", "tags", "score", "kind", "count", "ok", "items", "meta", "level",
                      "code", "ratio"]

    def leaf(self) -> dict[str, Any]:
        r = self.rng
        choice = r.randrange(7)
        if choice == 0:
            lo = r.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 200)}
        if choice == 1:
            lo = r.choice([-10, 0, 1])
            return {"type": "number", "minimum": lo, "maximum": lo + r.choice([1, 10, 100])}
        if choice == 2:
            return {"enum": r.sample(["red", "green", "blue", "on", "off", 1, 2, None, True], r.randint(1, 4))}
        if choice == 3:
            return {"type": "string", "pattern": r.choice(["^[a-z]{2,6}$", "^[A-Z][0-9]{3}$", "^(yes|no|maybe)$"])}
        if choice == 4:
            return {"type": "string", "minLength": r.randint(0, 2), "maxLength": r.randint(3, 8)}
        if choice == 5:
            return {"type": "boolean"}
        return {"type": "string", "enum": r.sample(["alpha", "beta", "gamma", "delta"], r.randint(1, 3))}

    def node(self, depth: int) -> dict[str, Any]:
        r = self.rng
        pick = r.random()
        if depth > 0 and pick < 0.3:
            return self.obj(depth - 1)
        if depth > 0 and pick < 0.5:
            lo = r.randint(0, 2)
            return {"type": "array", "items": self.node(depth - 1), "minItems": lo, "maxItems": lo + r.randint(0, 3)}
        return self.leaf()

    def obj(self, depth: int) -> dict[str, Any]:
        r = self.rng
        names = r.sample(self.names, r.randint(1, 4))
        props = {n: self.node(depth) for n in names}
        required = [n for n in names if r.random() < 0.6]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _schemas(n: int, seed: int) -> list[dict[str, Any]]:
    gen = SchemaGen(seed)
    return [gen.obj(depth=2) for _ in range(n)]


def _llm(model_dir: Path, **kw: Any) -> LLM:
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("kv_cache_tokens", 16384)
    return LLM(str(model_dir), **kw)


@pytest.fixture(scope="module")
def model_dir(tiny_model: Any) -> Path:
    return tiny_model("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return _llm(model_dir)


def _check_json(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_generated_json_schemas_all_validate(llm: LLM) -> None:
    schemas = _schemas(50, seed=2024)
    params = [SamplingParams(temperature=1.0, max_tokens=600, seed=i, structured_outputs={"json": s})
              for i, s in enumerate(schemas)]
    outs = llm.generate(["Describe it as JSON:"] * len(schemas), params)
    for i, (out, schema) in enumerate(zip(outs, schemas)):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text, schema)
        _check_json(c.text, schema)
    # The constraint made the difference: the same sampling without it is not valid JSON.
    free = llm.generate(["Describe it as JSON:"], SamplingParams(temperature=1.0, max_tokens=40, seed=0))
    with pytest.raises(ValueError):
        json.loads(free[0].outputs[0].text)


def test_json_schema_given_as_a_string_and_json_object(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2, 3]}}, "required": ["x"],
              "additionalProperties": False}
    out = llm.generate(["a"], SamplingParams(temperature=1.0, max_tokens=100, seed=3,
                                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema))))
    _check_json(out[0].outputs[0].text, schema)
    # json_object: any object; cut by max_tokens, the text is still a valid object prefix.
    out = llm.generate(["a"], SamplingParams(temperature=1.0, max_tokens=30, seed=4,
                                             structured_outputs={"json_object": True}))
    text = out[0].outputs[0].text
    assert text.startswith("{")
    if out[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


REGEXES = [
    r"[a-c]{2,5}-[0-9]{3}",
    r"(cat|dog|bird)s?",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
    r"0x[0-9a-f]{2,8}",
    r"(yes|no)!{0,3}",
    r"[+-]?[0-9]{1,3}(\.[0-9]{1,2})?",
    r"[a-z]+@[a-z]{2,5}\.(com|org)",
]


def test_regex_constraints_fullmatch(llm: LLM) -> None:
    params = [SamplingParams(temperature=1.0, max_tokens=120, seed=100 + i, structured_outputs={"regex": rx})
              for i in range(3) for rx in REGEXES]
    outs = llm.generate(["Say:"] * len(params), params)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        rx = p.structured_outputs.regex  # type: ignore[union-attr]
        if c.finish_reason == "length":  # only `+` is unbounded; it must still be a valid prefix
            assert rx.endswith(r"\.(com|org)"), c.text
            continue
        assert c.finish_reason == "stop"
        assert re.fullmatch(rx, c.text), (rx, c.text)


def test_choice_constraint(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral", 'say "hi"\\', "émoji ✓"]
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=7, n=4, structured_outputs={"choice": choices})
    outs = llm.generate(["Sentiment:"] * 10, params)
    seen = set()
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop"
            assert c.text in choices, c.text
            seen.add(c.text)
    assert len(seen) > 1  # the sampler still chooses between them


def test_grammar_lark_and_gbnf(llm: LLM) -> None:
    lark = 'start: greet " " name\ngreet: "hello" | "hi"\nname: /[a-z]{2,5}/'
    gbnf = 'root ::= ("up" | "down") " " [0-9] [0-9]?'
    outs = llm.generate(["x", "y"], [
        SamplingParams(temperature=1.0, max_tokens=30, seed=1, structured_outputs={"grammar": lark}),
        SamplingParams(temperature=1.0, max_tokens=30, seed=2, structured_outputs={"grammar": gbnf}),
    ])
    assert re.fullmatch(r"(hello|hi) [a-z]{2,5}", outs[0].outputs[0].text)
    assert re.fullmatch(r"(up|down) [0-9][0-9]?", outs[1].outputs[0].text)


def test_n4_preemption_and_prefix_hits_stay_valid(model_dir: Path) -> None:
    schemas = _schemas(6, seed=77)
    prompt = list(range(10, 90))  # one long shared prompt: later requests hit the prefix cache
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=512, kv_cache_tokens=512,
                                    enable_prefix_caching=True))
    for i, s in enumerate(schemas):
        engine.add_request(str(i), prompt, SamplingParams(
            temperature=1.0, n=4, max_tokens=300, seed=i, structured_outputs={"json": s}))
    texts: dict[tuple[str, int], str] = {}
    reasons: dict[tuple[str, int], str] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            for s in d.samples:
                key = (d.request_id, s.index)
                texts[key] = texts.get(key, "") + s.text
                if s.finish_reason is not None:
                    reasons[key] = s.finish_reason
    assert engine.scheduler.num_preemptions > 0  # 24 samples x ~150 tokens in a 512-token pool
    assert engine.stats().prefix_hit_tokens > 0
    assert len(texts) == 24
    for (rid, idx), text in texts.items():
        assert reasons[(rid, idx)] == "stop", (rid, idx, text)
        _check_json(text, schemas[int(rid)])
    assert engine.kv_cache.stats().used_blocks == 0


def test_constraints_with_ngram_speculation(model_dir: Path) -> None:
    """With n-gram speculation on, constrained sequences are speculated too: drafts are cut to
    what the grammar accepts and every verified position is masked by the grammar state after the
    draft tokens before it. Greedy constrained output is token for token the same as without
    speculation, sampled constrained output stays valid, and unconstrained neighbours keep their
    greedy output."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": 0, "min_acceptance_rate": 0.0}
    schemas = _schemas(6, seed=5)
    on = _llm(model_dir, speculative_config=spec)
    off = _llm(model_dir)
    assert on.engine.spec is not None

    # Greedy, constrained only: every proposal counted here is a constrained sequence's.
    greedy = [SamplingParams(temperature=0.0, max_tokens=300, structured_outputs={"json": s}) for s in schemas]
    prompt = list(range(20, 40))
    got = on.generate([prompt] * len(schemas), greedy)
    ref = off.generate([prompt] * len(schemas), greedy)
    assert on.engine.spec.stats.num_proposed > 0 and on.engine.spec.stats.num_accepted > 0
    for g, r, s in zip(got, ref, schemas):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].finish_reason == "stop", g.outputs[0].text
        _check_json(g.outputs[0].text, s)

    # Sampled constrained samples (n = 2) beside unconstrained greedy neighbours.
    repetitive = [7, 8, 9, 10, 11] * 12  # the n-gram proposer finds matches in it
    free = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, max_tokens=300, seed=i, n=2, structured_outputs={"json": s})
               for i, s in enumerate(schemas[:4])]
    outs = on.generate([repetitive] * 2 + [prompt] * 4, [free, free, *sampled])
    for out, s in zip(outs[2:], schemas):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            _check_json(c.text, s)
    plain = off.generate([repetitive] * 2, [free, free])
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in plain]


def test_grammar_completion_stops_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(["q"], SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True,
                                             structured_outputs={"choice": ["done"]}))
    c = out[0].outputs[0]
    assert (c.text, c.finish_reason) == ("done", "stop")
    assert len(c.token_ids) < 50


def test_dead_end_finishes_with_its_own_reason(llm: LLM) -> None:
    # Only EOS may follow "ab", but min_tokens forbids EOS until 20 tokens are out: nothing is
    # allowed, and the sample must end (never hang, never emit a token outside the grammar).
    eos = min(llm.engine.tokenizer.eos_token_ids)
    grammar = f'start: "ab" <[{eos}]>'
    out = llm.generate(["q"], SamplingParams(temperature=1.0, max_tokens=50, min_tokens=20,
                                             structured_outputs={"grammar": grammar}))
    c = out[0].outputs[0]
    assert c.finish_reason == DEAD_END
    assert c.text == "ab"
    assert llm.engine.structured.num_dead_ends >= 1


def test_matcher_rollback_and_draft_validation(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("rb", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40,
                                                        structured_outputs={"regex": "[a-z]{30}"}))
    seq = engine.requests["rb"].sequences[0]
    for _ in range(4):
        engine.step()
    state = seq.grammar
    assert state.num_consumed == seq.num_output_tokens == 4  # every step sampled one token
    out_ids = list(seq.output_token_ids)
    engine.structured.rollback(seq, 2)
    assert state.num_consumed == 2
    # After rolling back, the same tokens are accepted again, and a non-letter token is not.
    assert engine.structured.validate_draft(seq, out_ids[2:]) == 2
    bad = engine.tokenizer.encode("!", add_special_tokens=False)
    assert engine.structured.validate_draft(seq, bad) == 0
    assert state.matcher.consume_tokens(out_ids[2:])
    state.num_consumed += 2
    engine.abort_request("rb")
    engine.step()
    with pytest.raises(ValueError):
        state.rollback(5)


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "strin"}}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "structured_outputs.json"),
    ({"regex": "(a"}, "structured_outputs.regex"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar"),
    ({"grammar": "root ::= [a-"}, "structured_outputs.grammar"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
])
def test_bad_constraints_raise_naming_the_field(llm: LLM, so: dict[str, Any], field: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so))
    assert info.value.field == field
    assert info.value.message
    assert not llm.engine.has_unfinished_requests()


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    comp = compiler_for(llm.engine.tokenizer)
    so = StructuredOutputsParams(regex="[0-9]{3}z")
    before = comp.stats()
    first = comp.compile(so)
    again = comp.compile(StructuredOutputsParams(regex="[0-9]{3}z"))
    after = comp.stats()
    assert again is first
    assert after.misses == before.misses + 1 and after.hits >= before.hits + 1
    assert first.compile_s > 0
    with pytest.raises(GrammarError):
        comp.compile(StructuredOutputsParams(regex="[0-9"))


@pytest.mark.parametrize("vocab", [50, 64, 90, 96, 130])
def test_apply_token_bitmask_matches_a_per_bit_reference(vocab: int) -> None:
    import torch

    from server.engine.sampler import apply_token_bitmask

    gen = torch.Generator().manual_seed(vocab)
    words = 3  # 96 token ids: fewer, equal or more than the logits' columns
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, vocab, generator=gen)
    got = apply_token_bitmask(logits, bitmask)
    for r in range(4):
        for t in range(vocab):
            allowed = t < words * 32 and (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert got[r, t].item() == (logits[r, t].item() if allowed else float("-inf")), (r, t)
