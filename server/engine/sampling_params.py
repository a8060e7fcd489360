"""SamplingParams: what a request asks of the sampler and the stop logic, validated once at the edge.

Field names follow vLLM's `SamplingParams`, so scripts written for it read naturally here.
This module imports no torch: the network edge builds these objects too.
"""
from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    from server.text.reasoning import ReasoningFormat


class SamplingParamsError(ValueError):
    """An invalid sampling parameter. `field` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class CompiledConstraint(Protocol):
    """A constraint compiled for one tokenizer (server.engine.grammar.CompiledGrammar, which this
    torch-free module cannot import: grammar imports it)."""

    @property
    def key(self) -> tuple[str, str]: ...

    @property
    def compile_s(self) -> float: ...


def _finite(name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise SamplingParamsError(name, f"must be a number, got {value!r}") from None
    if math.isnan(v) or math.isinf(v):
        raise SamplingParamsError(name, f"must be a finite number, got {value!r}")
    return v


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {value!r}")
    return value


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text, shaped like vLLM's `StructuredOutputsParams`.

    Exactly one of the fields is set:
      - `json`: a JSON schema (a dict, or a JSON string holding one); output is JSON matching it;
      - `regex`: output matches the regular expression in full;
      - `choice`: output is exactly one of these strings;
      - `grammar`: a grammar in Lark syntax or GBNF (llama.cpp's EBNF dialect: `root ::= ...`);
      - `json_object`: True for any JSON object (OpenAI's `response_format: json_object`).

    This validates the shape only; whether the grammar compiles is checked at admission
    (server.engine.structured), where the tokenizer is known. After validation `json` is
    always a dict.
    """

    json: Union[None, str, dict[str, Any]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # Set at admission (server.engine.grammar.compile_params): the compiled grammar, so the
    # engine never compiles. Not part of the constraint's identity or repr.
    compiled: Optional[CompiledConstraint] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_value(cls, value: Any, field_name: str = "structured_outputs") -> "StructuredOutputsParams":
        """Accept an instance or a dict with the same keys (unknown keys are an error)."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise SamplingParamsError(field_name, f"must be an object, got {type(value).__name__}")
        known = set(_STRUCTURED_KINDS)
        unknown = sorted(set(value) - known)
        if unknown:
            raise SamplingParamsError(
                f"{field_name}.{unknown[0]}", f"unknown key; expected one of {sorted(known)}"
            )
        return cls(**value)

    def validate(self, field_name: str = "structured_outputs") -> None:
        set_fields = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise SamplingParamsError(
                field_name,
                "exactly one of json, regex, choice, grammar, json_object must be set, got "
                + (", ".join(set_fields) if set_fields else "none"),
            )
        kind = set_fields[0]
        name = f"{field_name}.{kind}"
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise SamplingParamsError(name, f"is not valid JSON: {e}") from None
            # A JSON schema is an object or a boolean (true: anything, false: nothing).
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise SamplingParamsError(name, "must be a JSON schema object")
            self.json = schema
        elif kind == "regex":
            if not isinstance(self.regex, str) or self.regex == "":
                raise SamplingParamsError(name, "must be a non-empty string")
        elif kind == "choice":
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice:
                raise SamplingParamsError(name, "must be a non-empty list of strings")
            if not all(isinstance(c, str) and c != "" for c in self.choice):
                raise SamplingParamsError(name, "every choice must be a non-empty string")
        elif kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise SamplingParamsError(name, "must be a non-empty grammar string")
        elif kind == "json_object":
            if self.json_object is not True:
                raise SamplingParamsError(name, f"must be true, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The one field that is set: json, regex, choice, grammar or json_object."""
        for k in _STRUCTURED_KINDS:
            if getattr(self, k) not in (None, False):
                return k
        raise AssertionError("validated StructuredOutputsParams has one field set")

    def key(self) -> tuple[str, str]:
        """A hashable (kind, canonical spec) pair: equal constraints share one compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            spec = _json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = _json.dumps(value)
        elif kind == "json_object":
            spec = ""
        else:
            spec = str(value)
        return kind, spec


@dataclass(frozen=True)
class ReasoningGate:
    """Structured outputs wait for the end of the model's reasoning block (server.text.reasoning):
    the grammar applies from the token after `end_token_id`. With `open` (the prompt opened the
    block) the output starts inside it, unconstrained; otherwise the first token is either
    `start_token_id` (the block opens; unconstrained until its end) or the grammar's.

    Harmony (gpt-oss) marks its answer with a header rather than one end token: with
    `answer_channel` (the token ids of the channel name, "final") the output starts unconstrained
    (`open` is implied) and the grammar applies from the token after the first `end_token_id`
    (`<|message|>`) that closes a header opened by `start_token_id` (`<|channel|>`) followed by
    those ids: `<|channel|>final<|message|>` (or `<|channel|>final <|constrain|>json<|message|>`).
    The analysis and commentary messages before it stay free text."""

    start_token_id: int
    end_token_id: int
    open: bool = False
    answer_channel: tuple[int, ...] = ()

    @classmethod
    def from_value(cls, value: Any) -> "ReasoningGate":
        if isinstance(value, ReasoningGate):
            return value
        if not isinstance(value, dict):
            raise SamplingParamsError("reasoning_gate", f"must be an object, got {type(value).__name__}")
        try:
            gate = cls(**value)
        except TypeError as e:
            raise SamplingParamsError("reasoning_gate", str(e)) from None
        for name in ("start_token_id", "end_token_id"):
            if _int(f"reasoning_gate.{name}", getattr(gate, name)) < 0:
                raise SamplingParamsError(f"reasoning_gate.{name}", "must be a token id (>= 0)")
        channel = gate.answer_channel
        if not isinstance(channel, (list, tuple)):
            raise SamplingParamsError("reasoning_gate.answer_channel", "must be a list of token ids")
        for i, t in enumerate(channel):
            if _int(f"reasoning_gate.answer_channel[{i}]", t) < 0:
                raise SamplingParamsError(f"reasoning_gate.answer_channel[{i}]", "must be a token id (>= 0)")
        if isinstance(channel, list):
            gate = cls(gate.start_token_id, gate.end_token_id, gate.open, tuple(channel))
        return gate

    @classmethod
    def for_format(cls, fmt: "ReasoningFormat", prompt_token_ids: list[int]) -> Optional["ReasoningGate"]:
        """Where a reasoning chat's structured output starts: after `</think>`; for harmony after
        the `<|channel|>final…<|message|>` header (analysis and tool-call messages stay free), or
        (None) on the whole output when the tokenizer lacks the ids to see that header."""
        if fmt.parser != "openai_gptoss":
            return cls(fmt.start_token_id, fmt.end_token_id, fmt.starts_open(prompt_token_ids))
        if fmt.message_token_id is None or not fmt.answer_channel:
            return None
        return cls(fmt.start_token_id, fmt.message_token_id, True, fmt.answer_channel)


@dataclass(frozen=True)
class EmbeddingParams:
    """An embedding request (`SamplingParams.embedding`): prefill-only, nothing is sampled; the
    engine pools the prompt's final-norm hidden states by the model's recipe
    (server.models.pooling). `dimensions` keeps the first N values (Matryoshka), normalised again
    afterwards when the model normalises; the engine checks it against the model's width."""

    dimensions: Optional[int] = None

    @classmethod
    def from_value(cls, value: Any) -> "EmbeddingParams":
        if isinstance(value, EmbeddingParams):
            params = value
        elif isinstance(value, dict):
            try:
                params = cls(**value)
            except TypeError as e:
                raise SamplingParamsError("embedding", str(e)) from None
        else:
            raise SamplingParamsError("embedding", f"must be an object, got {type(value).__name__}")
        if params.dimensions is not None and _int("dimensions", params.dimensions) < 1:
            raise SamplingParamsError("dimensions", f"must be at least 1, got {params.dimensions}")
        return params


@dataclass
class SamplingParams:
    """How to sample and when to stop.

    `temperature=0` means greedy. `top_k=-1` (or 0) disables top-k; `top_p=1` and `min_p=0`
    disable those filters. `seed` makes one request reproducible regardless of its batch.
    `logprobs=N` returns the sampled token's logprob plus the top N alternatives.
    `stop` strings are found even when they span tokens and are never included in the text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # A grammar constraint (JSON schema, regex, choice, grammar); a dict is accepted too.
    structured_outputs: Union[None, StructuredOutputsParams, dict[str, Any]] = None
    # With structured outputs: the constraint starts after the reasoning block (ReasoningGate).
    reasoning_gate: Union[None, ReasoningGate, dict[str, Any]] = None
    # An embedding request (EmbeddingParams): the prompt is pooled instead of sampled.
    embedding: Union[None, EmbeddingParams, dict[str, Any]] = None

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise SamplingParamsError (naming the field) for any invalid value; normalise the rest."""
        self.n = _int("n", self.n)
        if self.n < 1:
            raise SamplingParamsError("n", f"must be at least 1, got {self.n}")
        self.temperature = _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be >= 0, got {self.temperature}")
        self.top_p = _finite("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise SamplingParamsError("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        self.min_p = _finite("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not (-2.0 <= v <= 2.0):
                raise SamplingParamsError(name, f"must be in [-2, 2], got {v}")
            setattr(self, name, v)
        self.repetition_penalty = _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            # torch generators take a signed or unsigned 64-bit seed; sample i uses seed + i.
            if not (-(2**63) <= self.seed <= 2**63 - 1):
                raise SamplingParamsError("seed", f"must fit in 64 bits, in [-2**63, 2**63 - 1], got {self.seed}")
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise SamplingParamsError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if not (0 <= self.logprobs <= 20):
                raise SamplingParamsError("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) for s in self.stop
            ):
                raise SamplingParamsError("stop", "must be a string or a list of strings")
            self.stop = list(self.stop)
        if any(s == "" for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", "must be a list of integers")
        self.stop_token_ids = [_int("stop_token_ids", t) for t in self.stop_token_ids]
        bad = next((t for t in self.stop_token_ids if t < 0), None)
        if bad is not None:
            raise SamplingParamsError("stop_token_ids", f"token id {bad} is negative")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.reasoning_gate is not None:
            self.reasoning_gate = ReasoningGate.from_value(self.reasoning_gate)
        if self.embedding is not None:
            self.embedding = EmbeddingParams.from_value(self.embedding)
            if self.n != 1:
                raise SamplingParamsError("n", f"an embedding request has one result, got n={self.n}")
            if self.structured_outputs is not None:
                raise SamplingParamsError("structured_outputs", "an embedding request samples nothing to constrain")

    # -- derived views used by the sampler ----------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> Sequence[str]:
        return [f.name for f in fields(cls)]
