"""What the API layer's endpoints share for one Runtime and its Gateway.

The serving layer (`server.serving.runtime.Runtime`) knows nothing of HTTP, WebSockets or
OpenAI's shapes, nor of the gateway (`server.gateway.policy.Gateway`, passed beside it); the
API-layer state that outlives one request lives here instead: the formatter of OpenAI shapes
(built once the Runtime has loaded the tokenizer) and the request-spec builder shared by the
HTTP and WebSocket edges.
"""
from __future__ import annotations

from typing import Optional

from server.api.openai_format import Formatter
from server.gateway.policy import Gateway
from server.serving.errors import InvalidRequest
from server.serving.runtime import Runtime
from server.serving.service import RequestService
from server.text.harmony import CHANNEL
from server.text.tokenizer import ChatTemplateError
from server.text.tool_parsers import HERMES_OPEN, PYTHON_TAG, detect_parser


class ApiContext:
    def __init__(self, rt: Runtime, gateway: Gateway) -> None:
        self.rt = rt
        self.gateway = gateway  # who a caller is (auth) and what its key has left (quotas)
        self._formatter: Optional[Formatter] = None
        self._tool_parser: Optional[tuple[str, bool]] = None

    @property
    def formatter(self) -> Formatter:
        """The formatter for the served model (the Runtime must have started)."""
        if self._formatter is None:
            tok = self.rt.tokenizer
            if tok is None:
                raise RuntimeError("the runtime has not started: no tokenizer yet")
            self._formatter = Formatter(tok, self.rt.model_name)
        return self._formatter

    def _tool_format(self) -> tuple[str, bool]:
        if self._tool_parser is None:
            tok = self.rt.tokenizer
            if tok is None:
                raise RuntimeError("the runtime has not started: no tokenizer yet")
            name = self.rt.settings.tool_call_parser
            if name == "auto":
                try:  # the template used with tools (a model's `tool_use` one when it has several)
                    source: Optional[str] = tok.template_source(tools=[])
                except ChatTemplateError:
                    source = None
                name = detect_parser(source) if source is not None else "none"
            marker = {"hermes": HERMES_OPEN, "llama3_json": PYTHON_TAG, "openai": CHANNEL}.get(name)
            marker_id = tok.token_to_id(marker) if marker is not None else None
            self._tool_parser = (name, marker_id is not None and marker_id in tok.all_special_ids)
        return self._tool_parser

    @property
    def tool_parser(self) -> str:
        """The format `tool_choice: auto` output is parsed in: --tool-call-parser, or detected
        from the chat template (server.text.tool_parsers.detect_parser)."""
        return self._tool_format()[0]

    @property
    def tool_marker_special(self) -> bool:
        """Whether that format's marker (`<tool_call>`, `<|python_tag|>`) is a special token, which
        the detokenizer would drop unless told to keep special tokens."""
        return self._tool_format()[1]

    @property
    def service(self) -> RequestService:
        """The request service (the Runtime must have started)."""
        if self.rt.service is None:
            raise RuntimeError("the runtime has not started: no request service yet")
        return self.rt.service

    def limit_headers(self, key_id: Optional[str]) -> list[tuple[bytes, bytes]]:
        """The key's x-ratelimit-* (OpenAI's names) as ASGI headers, the state right after this
        request's reservation; every API sends them on every answer, not only on a 429 (none for a
        key without limits, or with auth off)."""
        quotas = self.gateway.quotas
        if quotas is None or key_id is None:
            return []
        return [(k.encode(), v.encode()) for k, v in quotas.headers(key_id).items()]

    def check_model(self, model: Optional[str]) -> None:
        """404 `model_not_found` unless `model` is absent or names the served model; a 400 naming
        `model` for a LoRA adapter's name on an API that does not take adapters (model_for does)."""
        base, adapter = self.rt.names.resolve(model)
        if adapter is not None:
            raise InvalidRequest(f"model: '{model}' is a LoRA adapter; adapters are served on /v1/chat/completions, "
                                 f"/v1/completions, /v1/responses, /v1/messages and batch lines; this API serves "
                                 f"'{base}'", param="model")

    def model_for(self, model: Optional[str]) -> tuple[str, Optional[str]]:
        """(the name a request's spec records, the LoRA adapter it runs or None) for its `model`:
        the served model's name, or an adapter's (server.serving.model_names). 404 `model_not_found`
        for any other name."""
        _, adapter = self.rt.names.resolve(model)
        return (adapter, adapter) if adapter is not None else (self.rt.model_name, None)
