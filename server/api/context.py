"""What the API layer's endpoints share for one Runtime.

The serving layer (`server.serving.runtime.Runtime`) knows nothing of HTTP, WebSockets or
OpenAI's shapes; the API-layer state that outlives one request lives here instead: the
formatter of OpenAI shapes (built once the Runtime has loaded the tokenizer) and the request-spec
builder shared by the HTTP and WebSocket edges.
"""
from __future__ import annotations

from typing import Optional

from server.api.openai_format import Formatter
from server.serving.errors import NotFound
from server.serving.runtime import Runtime
from server.serving.service import RequestService


class ApiContext:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._formatter: Optional[Formatter] = None

    @property
    def formatter(self) -> Formatter:
        """The formatter for the served model (the Runtime must have started)."""
        if self._formatter is None:
            tok = self.rt.tokenizer
            if tok is None:
                raise RuntimeError("the runtime has not started: no tokenizer yet")
            self._formatter = Formatter(tok, self.rt.model_name)
        return self._formatter

    @property
    def service(self) -> RequestService:
        """The request service (the Runtime must have started)."""
        if self.rt.service is None:
            raise RuntimeError("the runtime has not started: no request service yet")
        return self.rt.service

    def check_model(self, model: Optional[str]) -> None:
        """404 `model_not_found` unless `model` is absent or names the served model."""
        if model is not None and model != self.rt.model_name:
            raise NotFound(f"model: '{model}' does not exist; this server serves '{self.rt.model_name}'",
                           param="model", code="model_not_found")
