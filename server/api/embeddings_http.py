"""POST /v1/embeddings (OpenAI's shape), and the path every embeddings route shares.

An embeddings request goes the way a batched completion goes: bounded body read (413) → msgspec
Struct (400 naming the field) → one GenerationSpec per input (server.api.embeddings_format),
bound to the caller's key → `admit_all` (each input's quota reservation of its input tokens and
its ledger row committed, all or none) → wait for every input's end → one JSON body. The engine
runs each input prefill-only and returns the pooled vector instead of sampling
(server.models.pooling). A request to a generation model is the service's 400 naming `model`.
A vanished client detaches, which cancels what still runs.
"""
from __future__ import annotations

from typing import Any, Optional

from server.api.admission import read_and_admit
from server.api.context import ApiContext
from server.api.decode import decode
from server.api.embeddings_format import EmbeddingRequest, openai_body, request_specs
from server.api.follow import wait_ends
from server.api.http_io import Receive, Scope, Send, header, peer, send_error, send_json
from server.api.openai_responses import admit_all, end_error
from server.gateway.auth import bind, principal_of
from server.serving.idempotency import check_header_key
from server.serving.jobs import GenerationSpec
from server.serving.streams import EndEvent


async def run_embeddings(api: ApiContext, receive: Receive, specs: list[GenerationSpec]) -> Optional[list[EndEvent]]:
    """Admit every input's request and wait for all of them: their EndEvents in input order, or
    None when the client left. Raises PagewireError for a refusal or an input that did not finish."""
    admitted = await admit_all(api, specs)
    ends = await wait_ends(api, receive, admitted)
    if ends is None:
        return None
    failed = next((e for e in ends if not e.finished), None)
    if failed is not None:
        raise end_error(failed)
    return ends


class EmbeddingsEndpoint:
    """POST /v1/embeddings."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api

    def _parse(self, scope: Scope, body: bytes) -> tuple[list[GenerationSpec], str]:
        api = self.api
        idem = check_header_key(header(scope, b"idempotency-key"))
        req = decode(body, EmbeddingRequest)
        api = api.for_model(req.model)
        specs, fmt = request_specs(req, api="http", client=req.user or peer(scope), model=api.model_name,
                                   idem=idem)
        who = principal_of(scope)
        for spec in specs:
            bind(spec, who)
        return specs, fmt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def answer(body: bytes) -> tuple[list[GenerationSpec], Optional[list[EndEvent]], Any]:
            specs, fmt = self._parse(scope, body)
            ends = await run_embeddings(self.api, receive, specs)
            return specs, ends, openai_body(specs[0].model, ends, fmt) if ends is not None else None

        got = await read_and_admit(self.api, scope, receive, send, send_error, answer, "an embeddings request")
        if got is None:
            return
        specs, ends, out = got
        if ends is None:
            return  # the client left; what still ran was cancelled
        headers = [(b"x-request-id", ",".join(e.request_id for e in ends).encode()),
                   *self.api.limit_headers(specs[0].key_id, specs[0].model)]
        try:
            await send_json(send, 200, out, headers)
        except OSError:
            pass
