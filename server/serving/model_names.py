"""The LoRA adapters' names over the default model (`--lora NAME=PATH`): checked against the
model's own name and listed. The model pool routes them (server.serving.model_pool: each adapter is
an alias for its base model's lane), as vLLM reads a LoRA module's name.
"""
from __future__ import annotations

from typing import Optional, Sequence


class ModelNames:
    """One base model's name and the names of the adapters loaded over it."""

    def __init__(self, base: str, adapters: Sequence[str] = ()) -> None:
        if base in adapters:
            raise ValueError(f"--lora: adapter name {base!r} is the served model's own name; pick another")
        self.base = base
        self.adapters = tuple(adapters)

    def all(self) -> list[tuple[str, Optional[str]]]:
        """Every servable name as (name, the base it runs on, None for the base itself)."""
        return [(self.base, None)] + [(a, self.base) for a in self.adapters]
