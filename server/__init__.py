"""pagewire: a one-process LLM inference server.

`from server import LLM, SamplingParams` is the offline API. The names are resolved lazily so
that the network edge (which never imports torch) can import `server.*` submodules cheaply.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from server.engine.outputs import CompletionOutput, RequestOutput
    from server.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from server.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from server.llm import LLM

        return LLM
    if name == "SamplingParams":
        from server.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from server.engine.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    if name in ("RequestOutput", "CompletionOutput"):
        from server.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
