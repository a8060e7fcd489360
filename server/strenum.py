"""`StrEnum`: a str-valued enum for Python 3.10 (the stdlib's enum.StrEnum needs 3.11).

Its members are the strings they stand for: they compare, hash, serialise (json, msgspec,
sqlite) and format as their values, so a typed field accepts and stores exactly the strings it
did before. A leaf: every layer may use it.
"""
from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
