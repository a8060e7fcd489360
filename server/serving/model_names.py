"""The names a request may send as `model`: the served model, and each LoRA adapter over it
(`--lora NAME=PATH`). `resolve` is the one place a name becomes (base model, adapter), as vLLM
reads a LoRA module's name; a router over several models resolves through it too.
"""
from __future__ import annotations

from typing import Optional, Sequence

from server.serving.errors import NotFound


class ModelNames:
    """One base model's name and the names of the adapters loaded over it."""

    def __init__(self, base: str, adapters: Sequence[str] = ()) -> None:
        if base in adapters:
            raise ValueError(f"--lora: adapter name {base!r} is the served model's own name; pick another")
        self.base = base
        self.adapters = tuple(adapters)

    def resolve(self, name: Optional[str]) -> tuple[str, Optional[str]]:
        """(base model, adapter or None) for a request's `model` (absent: the base model alone).
        NotFound `model_not_found` naming `model` for any other name."""
        if name is None or name == self.base:
            return self.base, None
        if name in self.adapters:
            return self.base, name
        served = ", ".join(repr(n) for n in (self.base, *self.adapters))
        raise NotFound(f"model: '{name}' does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    def all(self) -> list[tuple[str, Optional[str]]]:
        """Every servable name as (name, the base it runs on, None for the base itself)."""
        return [(self.base, None)] + [(a, self.base) for a in self.adapters]
