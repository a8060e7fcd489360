"""Grammar compilation for structured outputs: llguidance's tokenizer view of our tokenizer, and
compiled grammars cached per constraint.

Torch-free: the network edge compiles every constraint at admission (so a schema that does not
compile is a 400 there, and the engine never sees a bad grammar), and the engine thread only
ever copies compiled matchers (see server.engine.structured).

One `GrammarCompiler` exists per tokenizer content (`compiler_for`), shared by the edge and the
engine thread of one process, so a grammar compiled at admission is a cache hit in the engine.
A compiled grammar is an llguidance `LLMatcher` in its start state: building it parses the
grammar and builds its lexer, which is the expensive part; every sequence then starts from a
`deep_copy()` of it (microseconds).

llguidance (not xgrammar) because it has no runtime dependencies: xgrammar pulls in transformers
and triton, which this server does not otherwise need (see docs/structured_outputs.md).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import llguidance

from server.engine.sampling_params import ReasoningGate, SamplingParamsError, StructuredOutputsParams
from server.text.tokenizer import Tokenizer

# Compiled grammars kept per tokenizer; the least recently used is dropped beyond this.
DEFAULT_CACHE_SIZE = 256

# JSON is generated without free whitespace (separators ", " and ": ", like json.dumps): with
# llguidance's default "any whitespace" a model can pad the output with whitespace forever, which
# is what weak models do. A schema may still ask for other settings through its "x-guidance" key.
JSON_DEFAULTS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(SamplingParamsError):
    """A constraint that llguidance cannot compile; `field` names it, the message says why."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one tokenizer. `matcher` is never advanced: copy it."""

    key: tuple[str, str]
    matcher: llguidance.LLMatcher
    compile_s: float  # wall time of the compile that produced it (a cache miss)

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.matcher.deep_copy()


GATE_WAIT, GATE_DECIDE = "wait", "decide"


class GrammarState:
    """One sequence's matcher and how many tokens it has consumed (`Sequence.grammar`; the engine
    step drives it through server.engine.structured).

    With a ReasoningGate the grammar starts after the model's reasoning block: `gate` is "wait"
    (inside the block: no mask, tokens not consumed) until the block's end token, or "decide"
    (first token of a prompt that did not open a block: the grammar's mask plus the block's
    start token), and None once the grammar applies. The tokens taken before that are kept, so a
    rollback past them restores the gate. A harmony gate (`ReasoningGate.answer_channel`) waits
    for its answer header; `_header` holds the tokens of the header being read (None outside one)."""

    __slots__ = ("matcher", "num_consumed", "grammar", "reasoning", "gate", "pre", "_header")

    def __init__(self, grammar: CompiledGrammar, matcher: Optional[llguidance.LLMatcher] = None,
                 reasoning: Optional[ReasoningGate] = None) -> None:
        self.grammar = grammar
        self.matcher = matcher if matcher is not None else grammar.new_matcher()
        self.num_consumed = 0
        self.reasoning = reasoning
        self.pre: list[int] = []  # tokens taken while gated
        self._header: Optional[list[int]] = None
        self.gate: Optional[str] = self._initial_gate()

    def _initial_gate(self) -> Optional[str]:
        self._header = None
        if self.reasoning is None:
            return None
        return GATE_WAIT if self.reasoning.open or self.reasoning.answer_channel else GATE_DECIDE

    def fork(self) -> "GrammarState":
        child = GrammarState(self.grammar, self.matcher.deep_copy(), self.reasoning)
        child.num_consumed = self.num_consumed
        child.pre = list(self.pre)
        child.gate = self.gate
        child._header = None if self._header is None else list(self._header)
        return child

    def _step_harmony(self, token: int, r: ReasoningGate) -> None:
        """A harmony gate's header tracking: lifted by the `end_token_id` of an answer header."""
        if token == r.start_token_id:
            self._header = []
        elif self._header is not None:
            if token == r.end_token_id:
                if tuple(self._header[:len(r.answer_channel)]) == r.answer_channel:
                    self.gate = None
                self._header = None
            elif len(self._header) < 64:  # a header is a few tokens; only its start is compared
                self._header.append(token)

    def _step_gate(self, token: int) -> bool:
        """Take `token` while gated; False when it goes to the matcher instead (gate lifted)."""
        r = self.reasoning
        assert r is not None
        if r.answer_channel:
            self.pre.append(token)
            self._step_harmony(token, r)
            return True
        if self.gate == GATE_DECIDE:
            if token == r.start_token_id:
                self.gate = GATE_WAIT
                self.pre.append(token)
                return True
            self.gate = None
            return False
        self.pre.append(token)
        if token == r.end_token_id:
            self.gate = None
        return True

    def consume(self, token: int) -> bool:
        if self.gate is not None and self._step_gate(token):
            return True
        ok = bool(self.matcher.consume_token(token))
        if ok:
            self.num_consumed += 1
        return ok

    @property
    def total(self) -> int:
        return len(self.pre) + self.num_consumed

    def rollback(self, k: int) -> None:
        if not 0 <= k <= self.total:
            raise ValueError(f"rollback: k must be in [0, {self.total}], got {k}")
        m = min(k, self.num_consumed)
        if m and not self.matcher.rollback(m):
            raise RuntimeError(f"grammar matcher could not roll back {m} tokens: {self.matcher.get_error()}")
        self.num_consumed -= m
        if self.num_consumed == 0 and self.reasoning is not None:
            # Back to (or into) the gated prefix: the gate is what replaying what is left of it gives.
            keep = self.pre[: len(self.pre) - (k - m)]
            self.pre, self.gate = [], self._initial_gate()
            for t in keep:
                self._step_gate(t)

    @property
    def is_complete(self) -> bool:
        """Nothing but EOS may follow (the grammar is satisfied and cannot grow)."""
        return self.gate is None and bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


@dataclass
class CompilerStats:
    hits: int = 0
    misses: int = 0
    compile_s_total: float = 0.0
    last_compile_s: float = 0.0
    cached: int = 0


def _grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for one constraint; ValueError if malformed."""
    kind = so.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(so.json or {}, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex or "")
    if kind == "choice":
        # Each choice as a Lark string literal; JSON string escapes are what Lark literals take.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice or []))
    # "grammar": Lark, or GBNF (llama.cpp's EBNF), which llguidance converts to Lark.
    return llguidance.grammar_from("grammar", so.grammar or "")


class GrammarCompiler:
    """Compiles constraints for one tokenizer and caches the results (thread-safe)."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size: must be at least 1, got {cache_size}")
        self.ll_tokenizer = ll_tokenizer
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CompilerStats()

    @property
    def vocab_size(self) -> int:
        return int(self.ll_tokenizer.vocab_size)

    def lookup(self, so: StructuredOutputsParams) -> Optional[CompiledGrammar]:
        """The cached compile of `so`, or None (counts a hit when found)."""
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._stats.hits += 1
            return hit

    def compile(self, so: StructuredOutputsParams, field_name: Optional[str] = None) -> CompiledGrammar:
        """Compile `so` (or return the cached result). Raises GrammarError naming `field_name`
        (default `structured_outputs.<kind>`) with llguidance's reason.

        llguidance drops the GIL while it builds the grammar, so callers may run this on a worker
        thread without holding up the event loop or the engine thread.
        """
        hit = self.lookup(so)
        if hit is not None:
            return hit
        key = so.key()
        name = field_name or f"structured_outputs.{key[0]}"
        t0 = time.perf_counter()
        try:
            text = _grammar_text(so)
        except (ValueError, TypeError) as e:
            raise GrammarError(name, _clean(str(e))) from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(name, _clean(matcher.get_error()))
        compiled = CompiledGrammar(key, matcher, time.perf_counter() - t0)
        with self._lock:
            self._stats.misses += 1
            self._stats.compile_s_total += compiled.compile_s
            self._stats.last_compile_s = compiled.compile_s
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def stats(self) -> CompilerStats:
        with self._lock:
            s = self._stats
            return CompilerStats(s.hits, s.misses, s.compile_s_total, s.last_compile_s, len(self._cache))

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


def _clean(message: str) -> str:
    """llguidance's message on one line, without its trailing blank lines."""
    lines = [ln.rstrip() for ln in message.strip().splitlines() if ln.strip()]
    return "; ".join(lines) if lines else "the grammar does not compile"


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`: built from the `tokenizers` backend's JSON (HF folders
    and GGUF files alike, since both build one), with our EOS ids. Masks are one bit per token id
    below `tokenizer.vocab_size`; the engine treats ids beyond that (a padded embedding) as
    never allowed."""
    backend = tokenizer._tok  # noqa: SLF001 - the one place that needs the backend's JSON
    eos = sorted(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(
        backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos if eos else None
    )


_by_tokenizer: "weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler]" = weakref.WeakKeyDictionary()
_by_content: dict[str, GrammarCompiler] = {}
_registry_lock = threading.Lock()
# Held while a compiler is built (seconds for a large vocabulary), so that concurrent first
# requests wait for one build instead of each doing it.
_build_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer) -> GrammarCompiler:
    """The process-wide compiler for this tokenizer's content (built on first use: ~0.5 s for a
    50k vocabulary). Two Tokenizer objects loaded from the same files share one compiler, so the
    edge's compile is the engine's cache hit."""
    with _registry_lock:
        found = _by_tokenizer.get(tokenizer)
        if found is not None:
            return found
    with _build_lock:
        with _registry_lock:
            found = _by_tokenizer.get(tokenizer)
        if found is not None:
            return found
        ident = hashlib.sha256(
            tokenizer._tok.to_str().encode("utf-8")  # noqa: SLF001
            + repr(sorted(tokenizer.eos_token_ids)).encode()
        ).hexdigest()
        with _registry_lock:
            comp = _by_content.get(ident)
        if comp is None:
            comp = GrammarCompiler(ll_tokenizer(tokenizer))
        with _registry_lock:
            _by_content[ident] = comp
            _by_tokenizer[tokenizer] = comp
        return comp


def compile_params(tokenizer: Tokenizer, so: StructuredOutputsParams,
                   field_name: Optional[str] = None) -> CompiledGrammar:
    """Compile `so` for `tokenizer` and attach the result to it (`so.compiled`)."""
    compiled = compiler_for(tokenizer).compile(so, field_name)
    so.compiled = compiled
    return compiled
