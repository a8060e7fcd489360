"""Ollama's API on the one request path: /api/chat, /api/generate (whole or newline-delimited JSON
streams), /api/tags, /api/show, /api/ps, /api/version, and /api/embed.

Generation goes the way an OpenAI request goes: bounded body read (413) → msgspec Struct (400
naming the field) → the same GenerationSpec (server.api.ollama_format) bound to the caller's key →
`service.start` (quota reserve, ledger row committed) → only then the response starts
(server.api.follow). A vanished client detaches, which cancels the request at the engine's next
step. As in Ollama, `stream` defaults to true, and a request with no prompt (or no messages)
only loads the model (it starts loading and the answer comes at once), or with `keep_alive` 0
unloads it once idle. A request's `keep_alive` sets how long its model stays loaded once idle
(server.serving.model_pool); /api/ps lists the loaded models with that expiry, /api/tags all.
The key is `Authorization: Bearer`, which the ollama client sends from OLLAMA_API_KEY or its
`headers`. `Idempotency-Key` works as on the OpenAI routes. Every error is Ollama's `{"error": "..."}`.

Models are named as Ollama names them, with a tag: `demo` is listed as `demo:latest`, and a
request may name it either way.

/api/embed (and the older /api/embeddings): with an embedding model (server.models.pooling) each
input is one engine request and ledger row, as on /v1/embeddings (server.api.embeddings_http);
the answer is Ollama's `{model, embeddings, total_duration, load_duration, prompt_eval_count}`,
or the older route's `{embedding}`. A generation model answers 400 `not_embedding_model` naming
`model`. As in Ollama, /api/embed cuts an input longer than the context to its first tokens
(`truncate`, default true; `options.num_ctx` may lower the bound), or with `truncate: false`
refuses it with a 400 naming it (server.serving.truncation); /api/embeddings always refuses it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from server.api.admission import read_and_admit
from server.api.context import ApiContext
from server.api.decode import decode
from server.api.embeddings_format import embedding_inputs, embedding_specs, vector_of
from server.api.embeddings_http import run_embeddings
from server.api.follow import follow_stream, wait_finished
from server.api.http_io import Receive, Scope, Send, header, peer, read_body, retry_headers, send_json
from server.api.ollama_format import (
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    ModelRequest,
    chat_spec,
    check_keep_alive,
    generate_spec,
    ollama_error,
    unloads,
)
from server.api.ollama_models import ModelFacts, model_facts
from server.api.ollama_output import NdjsonStream, Timing, chat_body, generate_body, load_body
from server.gateway.auth import bind, principal_of
from server.serving.durations import keep_alive_seconds
from server.serving.errors import InvalidRequest, NotFound, PagewireError
from server.serving.idempotency import check_header_key
from server.serving.jobs import GenerationSpec
from server.serving.service import Admitted
from server.serving.streams import EndEvent
from server.serving.truncation import Truncation

# The Ollama release whose API these routes follow (what /api/version reports; clients compare it
# to decide which fields they may send).
OLLAMA_API_VERSION = "0.12.0"
# A model that never unloads: Ollama reports keep_alive -1 as an expiry far in the future.
_NEVER = "2318-11-28T00:00:00Z"


def tag_of(name: str) -> str:
    """Ollama's name for a model: with a tag (`demo` → `demo:latest`)."""
    return name if ":" in name else f"{name}:latest"


async def send_error(send: Send, exc: PagewireError) -> None:
    await send_json(send, exc.status, ollama_error(exc), retry_headers(exc))


class OllamaApi:
    """The /api/* routes for one ApiContext."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api
        self._facts: dict[str, ModelFacts] = {}

    # -- naming ----------------------------------------------------------------------------------
    @property
    def tag_name(self) -> str:
        return tag_of(self.api.rt.model_name)

    def _names(self) -> list[str]:
        pool = self.api.rt.pool
        return pool.names() if pool is not None else [self.api.rt.model_name]

    def served_name(self, model: Optional[str]) -> Optional[str]:
        """The served name `model` means (with or without `:latest`); 404 for an unknown one."""
        if model is None:
            return None
        for name in self._names():
            if model in (name, tag_of(name)):
                return name
        served = ", ".join(f"'{tag_of(n)}'" for n in self._names())
        raise NotFound(f"model '{model}' not found; this server serves {served}", param="model",
                       code="model_not_found")

    def check_model(self, model: Optional[str]) -> None:
        self.served_name(model)

    def context(self, model: Optional[str]) -> ApiContext:
        """The ApiContext of the model a request names (404 for an unknown one)."""
        return self.api.for_model(self.served_name(model))

    async def facts(self, name: Optional[str] = None) -> ModelFacts:
        name = name or self.api.rt.model_name
        facts = self._facts.get(name)
        if facts is None:
            s = self.api.rt.settings
            pool = self.api.rt.pool
            route = pool.route(name) if pool is not None else None
            path = route.lane.entry.path if route is not None else self.api.rt.model_dir
            facts = self._facts[name] = await asyncio.get_running_loop().run_in_executor(
                None, model_facts, path, s.dtype, s.quantization)
        return facts

    def _entry(self, name: str, facts: ModelFacts) -> dict[str, Any]:
        tag = tag_of(name)
        return {"name": tag, "model": tag, "modified_at": facts.modified_at,
                "size": facts.size, "digest": facts.digest, "details": facts.details()}

    def _context_length(self, name: Optional[str] = None) -> Optional[int]:
        pool = self.api.rt.pool
        route = pool.route(name) if pool is not None else None
        bridge = route.lane.bridge if route is not None else self.api.rt.bridge
        return bridge.max_model_len if bridge is not None and bridge.ready else None

    # -- routes ----------------------------------------------------------------------------------
    def routes(self) -> list[Any]:
        from starlette.routing import Route

        return [
            Route("/api/chat", _Generate(self, "chat"), methods=["POST"]),
            Route("/api/generate", _Generate(self, "generate"), methods=["POST"]),
            Route("/api/tags", _Small(self, self.tags), methods=["GET"]),
            Route("/api/show", _Small(self, self.show), methods=["POST"]),
            Route("/api/ps", _Small(self, self.ps), methods=["GET"]),
            Route("/api/version", _Small(self, self.version), methods=["GET"]),
            Route("/api/embed", _Embed(self, legacy=False), methods=["POST"]),
            Route("/api/embeddings", _Embed(self, legacy=True), methods=["POST"]),
        ]

    async def tags(self, body: bytes) -> dict[str, Any]:
        return {"models": [self._entry(name, await self.facts(name)) for name in self._names()]}

    async def show(self, body: bytes) -> dict[str, Any]:
        req = decode(body, ModelRequest)
        name = req.model if req.model is not None else req.name
        if name is None:
            raise InvalidRequest("model: is required", param="model")
        name = self.served_name(name)
        facts = await self.facts(name)
        rt = self.api.rt
        mapi = self.api.for_model(name)
        lane = rt.service.lane(name) if rt.service is not None else None
        tok = lane.tokenizer if lane is not None else rt.tokenizer
        template = ""
        tools_template = False
        if tok is not None and tok.has_chat_template:
            template = tok.template_source()
            tools_template = "tools" in tok.template_source(tools=[])
        defaults = lane.sampling_defaults if lane is not None else rt.sampling_defaults
        params = "\n".join(f"{k} {v}" for k, v in sorted(defaults.items()))
        info: dict[str, Any] = {"general.architecture": facts.family,
                                "general.parameter_count": facts.parameter_count}
        ctx = self._context_length(name)
        if ctx is not None:
            info[f"{facts.family}.context_length"] = ctx
        pooler = lane.pooler if lane is not None else rt.pooler
        capabilities = ["embedding"] if pooler is not None else \
            ["completion"] + (["tools"] if tools_template and mapi.tool_parser != "none" else [])
        path = lane.entry.path if lane is not None else rt.model_dir
        return {"modelfile": f"# served by pagewire\nFROM {path}\n", "parameters": params,
                "template": template, "details": facts.details(), "model_info": info,
                "capabilities": capabilities, "modified_at": facts.modified_at}

    async def ps(self, body: bytes) -> dict[str, Any]:
        """The loaded models, each with when it unloads if it stays idle (its keep_alive)."""
        on_gpu = self.api.rt.settings.device.startswith("cuda")
        pool = self.api.rt.pool
        out = []
        for name in (pool.lanes if pool is not None else [self.api.rt.model_name]):
            lane = pool.lanes[name] if pool is not None else None
            if lane is not None and not lane.ready:
                continue
            facts = await self.facts(name)
            expires = _NEVER
            if lane is not None and lane.expires_at is not None:
                expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(lane.expires_at))
            out.append({**self._entry(name, facts), "expires_at": expires,
                        "size_vram": facts.size if on_gpu else 0, "context_length": self._context_length(name)})
        return {"models": out}

    async def version(self, body: bytes) -> dict[str, Any]:
        return {"version": OLLAMA_API_VERSION}

    def embed_specs(self, scope: Scope, body: bytes, legacy: bool) -> tuple[str, list[GenerationSpec]]:
        """(the model as the request named it, one spec per input)."""
        req = decode(body, EmbedRequest)
        api = self.context(req.model)
        check_keep_alive(req.keep_alive)
        if legacy:  # /api/embeddings: one `prompt`
            if not req.prompt:
                raise InvalidRequest("prompt: is required (a non-empty string)", param="prompt")
            inputs = embedding_inputs(req.prompt, "prompt", allow_ids=False)
            field = "prompt"
        else:
            if req.input is None:
                raise InvalidRequest("input: is required (a string or a list of strings)", param="input")
            inputs = embedding_inputs(req.input, "input", allow_ids=False)
            field = "input"
        record: dict[str, Any] = {"dimensions": req.dimensions, "truncate": req.truncate, "inputs": len(inputs)}
        num_ctx = req.options.num_ctx if req.options is not None else None
        if num_ctx is not None and num_ctx < 1:
            raise InvalidRequest(f"options.num_ctx: must be a positive integer, got {num_ctx}", param="options.num_ctx")
        # /api/embed truncates unless told not to: the first tokens, as many as the context (or a
        # smaller num_ctx) holds. The older /api/embeddings has no `truncate` and cuts nothing.
        truncate = None if legacy or req.truncate is False else \
            Truncation(keep_end=False, tokens=num_ctx, field=field, clamp=True)
        specs = embedding_specs(inputs, api="ollama", client=peer(scope), model=api.model_name,
                                idem=check_header_key(header(scope, b"idempotency-key")),
                                dimensions=req.dimensions, params_record=record, field=field, truncate=truncate)
        who = principal_of(scope)
        for spec in specs:
            bind(spec, who)
            spec.keep_alive_s = keep_alive_seconds(req.keep_alive)
        return req.model, specs


class _Small:
    """An ASGI app for a small JSON route: read the body (bounded), answer, errors in Ollama's shape."""

    def __init__(self, owner: OllamaApi, handler: Any) -> None:
        self.owner = owner
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = b""
            if scope.get("method") == "POST":
                body = await read_body(scope, receive, self.owner.api.rt.settings.max_request_bytes)
            out = await self.handler(body)
        except PagewireError as e:
            await send_error(send, e)
            return
        except ConnectionResetError:
            return
        await send_json(send, 200, out)


class _Embed:
    """POST /api/embed (`legacy` False) and /api/embeddings."""

    def __init__(self, owner: OllamaApi, legacy: bool) -> None:
        self.owner = owner
        self.legacy = legacy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.owner.api
        start = time.monotonic_ns()

        async def answer(body: bytes) -> tuple[str, list[GenerationSpec], Optional[list[EndEvent]]]:
            model, specs = self.owner.embed_specs(scope, body, self.legacy)
            return model, specs, await run_embeddings(api, receive, specs)

        got = await read_and_admit(api, scope, receive, send, send_error, answer, "an embeddings request")
        if got is None:
            return
        model, specs, ends = got
        if ends is None:
            return  # the client left; what still ran was cancelled
        vectors = [vector_of(e) for e in ends]
        if self.legacy:
            out: dict[str, Any] = {"embedding": vectors[0]}
        else:
            # The model is always loaded here, so load_duration is 0 (as Ollama reports a warm model).
            out = {"model": model, "embeddings": vectors,
                   "total_duration": time.monotonic_ns() - start, "load_duration": 0,
                   "prompt_eval_count": sum(e.usage.prompt_tokens for e in ends)}
        headers = [(b"x-request-id", ",".join(e.request_id for e in ends).encode()),
                   *api.limit_headers(specs[0].key_id, specs[0].model)]
        try:
            await send_json(send, 200, out, headers)
        except OSError:
            pass


class _Generate:
    """POST /api/chat (`kind` chat) and /api/generate."""

    def __init__(self, owner: OllamaApi, kind: str) -> None:
        self.owner = owner
        self.api = owner.api
        self.kind = kind

    def _parse(self, scope: Scope, body: bytes) -> tuple[Any, Optional[GenerationSpec], Any]:
        """(request, spec or None for a load-only request, tool plan)."""
        idem = check_header_key(header(scope, b"idempotency-key"))
        plan = None
        if self.kind == "chat":
            req: Any = decode(body, ChatRequest)
            api = self.owner.context(req.model)
            if not req.messages:
                check_keep_alive(req.keep_alive)
                return req, None, None
            spec, plan = chat_spec(req, peer(scope), api.model_name, api.tool_parser,
                                   api.tool_marker_special, idem)
        else:
            req = decode(body, GenerateRequest)
            api = self.owner.context(req.model)
            if not req.prompt:
                check_keep_alive(req.keep_alive)
                return req, None, None
            spec = generate_spec(req, peer(scope), api.model_name, idem)
        bind(spec, principal_of(scope))
        return req, spec, plan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.api
        clock = time.monotonic_ns
        timing = Timing(clock())

        async def admit(body: bytes) -> tuple[Any, Optional[GenerationSpec], Any, Optional[Admitted]]:
            req, spec, plan = self._parse(scope, body)
            service = api.service
            route = service.route(self.owner.served_name(req.model))
            pool = service.pool
            if spec is None:  # load (or with keep_alive 0 unload) only
                service.check_serving()
                pool.set_keep_alive(route.lane, keep_alive_seconds(req.keep_alive))
                if not unloads(req.keep_alive):
                    pool.want(route.lane)
                return req, None, None, None
            spec.keep_alive_s = keep_alive_seconds(req.keep_alive)
            return req, spec, plan, await service.start(spec)

        got = await read_and_admit(api, scope, receive, send, send_error, admit)
        if got is None:
            return
        req, spec, plan, admitted = got
        if spec is None or admitted is None:  # a load-only request
            await send_json(send, 200, load_body(req.model, "chat" if self.kind == "chat" else "generate",
                                                 req.keep_alive))
            return
        api = api.for_model(spec.model)
        headers = api.limit_headers(spec.key_id, spec.model)
        kind = "chat" if self.kind == "chat" else "generate"
        if req.stream:
            await follow_stream(api, send, receive, admitted, b"application/x-ndjson",
                                NdjsonStream(req.model, kind, plan, timing, clock, api.formatter.token_text),
                                "ollama", headers)
            return

        def first() -> None:
            timing.first_ns = clock()

        end = await wait_finished(api, send, receive, admitted, send_error, first)
        if end is None:
            return  # the client left (the request was cancelled), or the error was answered
        stats = timing.stats(end, clock())
        text_of = api.formatter.token_text
        out = chat_body(req.model, end, plan, stats, text_of) if kind == "chat" else \
            generate_body(req.model, end, stats, text_of)
        try:
            await send_json(send, 200, out, [(b"x-request-id", admitted.request_id.encode()), *headers])
        except OSError:
            pass
