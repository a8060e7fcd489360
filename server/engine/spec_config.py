"""SpeculativeConfig: the speculative-decoding settings, validated once (vLLM's `speculative_config` shape).

Torch-free, like EngineConfig, so the CLI can parse `--speculative-config '{...}'` before torch
loads. Every invalid value raises ConfigError naming the field as `speculative_config.<field>`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from server.engine.errors import ConfigError

METHODS = ("ngram", "draft_model")
_PREFIX = "speculative_config"


def _int_field(name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_PREFIX}.{name}", f"must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"{_PREFIX}.{name}", f"must be {bound}, got {value}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Args:
    method: "ngram" (prompt lookup over the sequence's own prompt and output) or "draft_model".
    num_speculative_tokens: k, tokens proposed per sequence per step (the target scores k + 1).
    model: the draft model's folder or GGUF file (method "draft_model" only).
    prompt_lookup_min / prompt_lookup_max: n-gram sizes matched (method "ngram"); the longest
        matching suffix wins.
    disable_by_batch_size: a step with at least this many running sequences speculates for none
        (the batch is compute-bound, so verifying k extra tokens would cost real time); 0 = never.
    acceptance_window / min_acceptance_rate: once a sequence has had `acceptance_window` tokens
        proposed since its last check, speculation stops for it if it accepted fewer than
        `min_acceptance_rate` of them (checked again every window while it stays on).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: Optional[str] = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 8
    acceptance_window: int = 32
    min_acceptance_rate: float = 0.15

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"{_PREFIX}.method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        _int_field("num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        _int_field("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _int_field("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"{_PREFIX}.prompt_lookup_min",
                f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}",
            )
        _int_field("disable_by_batch_size", self.disable_by_batch_size, 0)
        _int_field("acceptance_window", self.acceptance_window, 1)
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
            raise ConfigError(f"{_PREFIX}.min_acceptance_rate", f"must be a number in [0, 1], got {rate!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(f"{_PREFIX}.model", "is required for method 'draft_model' (a model folder or GGUF file)")
        elif self.model is not None:
            raise ConfigError(f"{_PREFIX}.model", f"applies to method 'draft_model' only, got {self.model!r}")

    @classmethod
    def from_value(cls, value: Any) -> "SpeculativeConfig":
        """Build from a SpeculativeConfig, a mapping, or a JSON object string (the CLI's form)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(_PREFIX, f"is not valid JSON ({e.msg} at position {e.pos})") from None
        if not isinstance(value, Mapping):
            raise ConfigError(_PREFIX, f"must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise ConfigError(f"{_PREFIX}.{key}", f"unknown field (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ConfigError(f"{_PREFIX}.method", f"is required (one of {', '.join(METHODS)})")
        return cls(**dict(value))
