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
from server.serving.errors import NotFound
from server.serving.runtime import Runtime
from server.serving.service import RequestService
from server.text.harmony import CHANNEL
from server.text.tokenizer import ChatTemplateError, Tokenizer
from server.text.tool_parsers import HERMES_OPEN, PYTHON_TAG, detect_parser


class ApiContext:
    """The API's state for one served model: the default one, or (`for_model`) another that a
    request names, with its own formatter and tool-call format (each model has its tokenizer)."""

    def __init__(self, rt: Runtime, gateway: Gateway, model: Optional[str] = None) -> None:
        self.rt = rt
        self.gateway = gateway  # who a caller is (auth) and what its key has left (quotas)
        self._model = model  # None: the default model
        self._formatter: Optional[Formatter] = None
        self._tool_parser: Optional[tuple[str, bool]] = None
        self._views: dict[str, ApiContext] = {}

    @property
    def model_name(self) -> str:
        """The name requests and answers use for this context's model."""
        return self._model if self._model is not None else self.rt.model_name

    def _tokenizer(self) -> Optional[Tokenizer]:
        if self._model is None or self.rt.pool is None:
            return self.rt.tokenizer
        route = self.rt.pool.route(self._model)
        return route.lane.tokenizer if route is not None else None

    def for_model(self, model: Optional[str]) -> "ApiContext":
        """The context of the model a request names (404 `model_not_found` for an unknown name);
        this one for None or its own name."""
        if model is None or model == self.model_name:
            return self
        self.check_model(model)
        if model == self.rt.model_name and self._model is not None:
            model = None
        view = self._views.get(model or "")
        if view is None:
            view = self._views[model or ""] = ApiContext(self.rt, self.gateway, model)
        return view

    @property
    def formatter(self) -> Formatter:
        """The formatter for this context's model (the Runtime must have started)."""
        if self._formatter is None:
            tok = self._tokenizer()
            if tok is None:
                raise RuntimeError("the runtime has not started: no tokenizer yet")
            self._formatter = Formatter(tok, self.model_name)
        return self._formatter

    def _tool_format(self) -> tuple[str, bool]:
        if self._tool_parser is None:
            tok = self._tokenizer()
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

    def limit_headers(self, key_id: Optional[str], model: Optional[str] = None) -> list[tuple[bytes, bytes]]:
        """The key's x-ratelimit-* (OpenAI's names) as ASGI headers, the state right after this
        request's reservation; every API sends them on every answer, not only on a 429 (none for a
        key without limits, or with auth off). With the request's `model`, each kind's figures are
        those of whichever binds first: the key-wide bucket or the key's bucket for that model."""
        quotas = self.gateway.quotas
        if quotas is None or key_id is None:
            return []
        return [(k.encode(), v.encode()) for k, v in quotas.headers(key_id, model).items()]

    def check_model(self, model: Optional[str]) -> None:
        """404 `model_not_found` unless `model` is absent or names a served model."""
        if model is None or model == self.rt.model_name:
            return
        pool = self.rt.pool
        if pool is None or pool.route(model) is None:
            names = pool.names() if pool is not None else [self.rt.model_name]
            served = f"'{names[0]}'" if len(names) == 1 else ", ".join(f"'{n}'" for n in names)
            raise NotFound(f"model: '{model}' does not exist; this server serves {served}",
                           param="model", code="model_not_found")
