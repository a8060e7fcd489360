"""HTTP routes of the batch tier: /v1/files (upload, metadata, content) and /v1/batches (create, get, list, cancel).

`BatchRoutes` builds the BatchManager once the Runtime has started (it needs the ledger and the
service) and stops it before the Runtime drains. Request bodies of a line are parsed exactly as
the interactive endpoints parse theirs (`openai_format.chat_spec` / `completion_specs`,
`embeddings_format` for /v1/embeddings lines), and a finished line's response body is the
interactive endpoint's (`Formatter`, `embeddings_format.openai_body`), so a batch line and a
direct request give the same answer.

Ownership (like OpenAI's): files and batches belong to the API key that created them. A key
creates, lists, reads and cancels only its own, and reads only its own output and error files;
another key's id gets the 404 an unknown id gets. The admin key sees all of them; with
authentication off, everyone does. A batch's lines run as requests of its key (billed to it,
within its limits).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.context import ApiContext
from server.api.decode import decode
from server.api.embeddings_format import EmbeddingRequest, openai_body, request_specs
from server.api.http_io import error_payload, retry_headers
from server.api.openai_format import chat_spec, completion_specs
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.gateway.auth import ADMIN_ID, Principal, principal_of
from server.serving.batch import BatchManager
from server.serving.errors import InvalidApiKey, InvalidRequest, PagewireError, TooLarge, Unavailable
from server.serving.files import FileLimits, FileStore
from server.serving.jobs import GenerationSpec
from server.serving.streams import EndEvent


def _error(exc: PagewireError) -> JSONResponse:
    return JSONResponse(error_payload(exc), status_code=exc.status,
                        headers={k.decode(): v.decode() for k, v in retry_headers(exc)})


class BatchRoutes:
    def __init__(self, api: ApiContext, limits: Optional[FileLimits] = None) -> None:
        self.api = api
        self.limits = limits or FileLimits()
        self.manager: Optional[BatchManager] = None
        self.files: Optional[FileStore] = None

    async def start(self) -> None:
        rt = self.api.rt
        assert rt.ledger is not None
        folder = rt.ledger.path.parent / "files" if rt.ledger.path is not None else None  # None: in the database
        self.files = FileStore(rt.ledger, folder, self.limits)
        self.manager = BatchManager(rt.ledger, self.files, self.api.service, self._spec, self._render,
                                    error_payload, concurrency=max(1, rt.settings.max_num_seqs // 2))
        await self.manager.start()
        if rt.ledger.shared:  # other replicas create batches, and may die holding lines
            rt.ledger.on_tick.append(self.manager.pick_up)  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self.manager is not None:
            await self.manager.stop()

    # -- what a line is and what it answers --------------------------------------------------------
    def _spec(self, kind: str, body: bytes, client: str, key: Optional[str], owner: Optional[str]) -> GenerationSpec:
        self._check_owner(owner)
        if kind == "embedding":
            spec = self._embedding_spec(body, client, key)
        elif kind == "chat":
            chat: ChatCompletionRequest = decode(body, ChatCompletionRequest)
            spec = chat_spec(chat, "batch", client, self.api.for_model(chat.model).model_name, key)
        else:
            req: CompletionRequest = decode(body, CompletionRequest)
            specs = completion_specs(req, "batch", client, self.api.for_model(req.model).model_name, key, 1)
            if len(specs) != 1:
                raise InvalidRequest("prompt: a batch line takes one prompt; put each prompt on its own line",
                                     param="prompt")
            spec = specs[0]
        spec.key_id = owner  # billed to, and quota-checked against, the batch's key
        return spec

    def _embedding_spec(self, body: bytes, client: str, key: Optional[str]) -> GenerationSpec:
        """An /v1/embeddings line, parsed as the interactive route parses it; one input a line (as one
        prompt a completions line), so each line is one engine request and one ledger row."""
        req: EmbeddingRequest = decode(body, EmbeddingRequest)
        specs, _ = request_specs(req, api="batch", client=client, model=self.api.for_model(req.model).model_name,
                                 idem=key)
        if len(specs) != 1:
            raise InvalidRequest(f"input: a batch line takes one input, got {len(specs)}; put each input on its "
                                 "own line", param="input")
        return specs[0]

    def _check_owner(self, owner: Optional[str]) -> None:
        """A line of a key that was revoked or expired since its batch was created does not run."""
        auth = self.api.gateway.auth
        if owner is None or owner == ADMIN_ID or auth is None:
            return
        auth.refresh()
        key = auth.get(owner)
        status = key.status() if key is not None else "deleted"
        if status != "active":
            raise InvalidApiKey(f"API key {owner} is {status}; the rest of its batch does not run")

    def _render(self, kind: str, body: bytes, end: EndEvent) -> dict[str, Any]:
        if kind == "embedding":
            req: EmbeddingRequest = decode(body, EmbeddingRequest)  # parsed before: it decodes
            return openai_body(self.api.for_model(req.model).model_name, [end], req.encoding_format)
        line: Any = decode(body, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        fmt = self.api.for_model(line.model).formatter
        return fmt.chat_response(end) if kind == "chat" else fmt.completion_response(end)

    # -- routes ---------------------------------------------------------------------------------
    def _parts(self, request: Request) -> tuple[BatchManager, FileStore, Optional[Principal]]:
        """The manager, the file store and the caller (None: authentication is off)."""
        if self.manager is None or self.files is None:
            raise Unavailable("server is starting", code="starting", retry_after_s=2)
        return self.manager, self.files, principal_of(request.scope)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files/{file_id}", self.file, methods=["GET"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.list, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    async def upload(self, request: Request) -> Response:
        try:
            _, files, who = self._parts(request)
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.limits.max_bytes + 2**20:
                raise TooLarge(f"file: the upload is {length} bytes, over the limit of {self.limits.max_bytes}")
            if not request.headers.get("content-type", "").startswith("multipart/form-data"):
                raise InvalidRequest("file: send the file as multipart/form-data with fields 'file' and 'purpose'",
                                     param="file")
            async with request.form(max_files=1, max_fields=8) as form:
                purpose = form.get("purpose")
                upload = form.get("file")
                if not isinstance(purpose, str):
                    raise InvalidRequest("purpose: required form field", param="purpose")
                if not isinstance(upload, UploadFile):
                    raise InvalidRequest("file: required form field (a file)", param="file")
                data = await upload.read(self.limits.max_bytes + 1)
                rec = await files.upload(purpose, upload.filename or "upload.jsonl", data,
                                         key_id=who.key_id if who is not None else None)
        except PagewireError as e:
            return _error(e)
        except Exception as e:  # multipart framing errors from the parser: the client's fault
            if isinstance(e, (KeyError, ValueError)) or type(e).__name__ == "MultiPartException":
                return _error(InvalidRequest(f"file: malformed multipart body ({e})", param="file"))
            raise
        return JSONResponse(rec.to_json())

    async def file(self, request: Request) -> Response:
        try:
            _, files, who = self._parts(request)
            rec = await files.get(request.path_params["file_id"], who=who)
        except PagewireError as e:
            return _error(e)
        return JSONResponse(rec.to_json())

    async def file_content(self, request: Request) -> Response:
        try:
            _, files, who = self._parts(request)
            data = await files.content(request.path_params["file_id"], who)
        except PagewireError as e:
            return _error(e)
        return Response(data, media_type="application/jsonl")

    async def create(self, request: Request) -> Response:
        try:
            manager, _, who = self._parts(request)
            body = await request.body()
            if len(body) > self.api.rt.settings.max_request_bytes:
                raise TooLarge("request body exceeds the limit")
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"body: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise InvalidRequest("body: must be a JSON object")
            fields: dict[str, str] = {}
            for name in ("input_file_id", "endpoint", "completion_window"):
                v = obj.get(name, "24h" if name == "completion_window" else None)
                if not isinstance(v, str):
                    raise InvalidRequest(f"{name}: required, a string", param=name)
                fields[name] = v
            metadata = obj.get("metadata")
            if metadata is not None and not (isinstance(metadata, dict) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
                raise InvalidRequest("metadata: must be an object of strings", param="metadata")
            b = await manager.create(fields["input_file_id"], fields["endpoint"], fields["completion_window"],
                                     metadata, who)
        except PagewireError as e:
            return _error(e)
        return JSONResponse(b.to_json())

    async def get(self, request: Request) -> Response:
        try:
            manager, _, who = self._parts(request)
            b = await manager.get(request.path_params["batch_id"], who)
        except PagewireError as e:
            return _error(e)
        return JSONResponse(b.to_json())

    async def list(self, request: Request) -> Response:
        try:
            manager, _, who = self._parts(request)
            raw = request.query_params.get("limit", "20")
            if not raw.isdigit() or not 1 <= int(raw) <= 100:
                raise InvalidRequest(f"limit: must be an integer in [1, 100], got {raw!r}", param="limit")
            rows = await manager.list_batches(int(raw) + 1, request.query_params.get("after"), who)
        except PagewireError as e:
            return _error(e)
        data = [b.to_json() for b in rows[:int(raw)]]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > int(raw)})

    async def cancel(self, request: Request) -> Response:
        try:
            manager, _, who = self._parts(request)
            b = await manager.cancel(request.path_params["batch_id"], who)
        except PagewireError as e:
            return _error(e)
        return JSONResponse(b.to_json())
