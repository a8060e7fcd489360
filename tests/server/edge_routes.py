"""Run as `python -m tests.server.edge_routes MODEL_DIR DB`: builds the served app the way
`pagewire serve` does (server.serve.compose → build_app), sends one request to each of its routes
and prints, as JSON, each route's status and whether torch was imported.

The engine thread is the one part of a server that loads torch, so it is not started here: the
Runtime, ledger, gateway, tokenizer, admission and service all start as in `serve`, and the app
stays in the state a server is in while its weights load. Every route answers from that state
(generation with 503 `starting`); none of them may import torch on the way.
Kept free of torch itself (no conftest, no test helpers that import it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str, db: str) -> None:
    from starlette.testclient import TestClient

    from server.serve import compose
    from server.serving.bridge import EngineBridge
    from server.serving.settings import ServeSettings

    EngineBridge.start = lambda self: None  # type: ignore[method-assign]  # weights "still loading"
    settings = ServeSettings(db=db, max_num_seqs=4, kv_cache_tokens=1024, num_threads=1)
    _, _, app = compose(settings, Path(model_dir), "demo")
    seen: dict[str, object] = {"torch_after_build_app": "torch" in sys.modules}
    with TestClient(app) as c:
        gen = {"model": "demo", "max_tokens": 2}
        answers = {
            "GET /health": c.get("/health"),
            "GET /v1/models": c.get("/v1/models"),
            "POST /v1/completions": c.post("/v1/completions", json={**gen, "prompt": "hi"}),
            "POST /v1/chat/completions": c.post("/v1/chat/completions", json={
                **gen, "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"}}),
            "POST /v1/embeddings": c.post("/v1/embeddings", json={"model": "demo", "input": ["hi", "there"],
                                                                   "encoding_format": "base64"}),
            "POST /tokenize": c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}),
            "POST /detokenize": c.post("/detokenize", json={"tokens": [1, 2, 3]}),
            "GET /metrics": c.get("/metrics"),
            "GET /v1/usage": c.get("/v1/usage", params={"group_by": "day"}),
            "GET /v1/requests/{id}": c.get("/v1/requests/req-unknown"),
        }
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "demo", "prompt": "hi", "max_tokens": 2}})
        up = c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", line.encode() + b"\n")})
        answers["POST /v1/files"] = up
        fid = up.json().get("id", "none")
        answers["GET /v1/files/{id}"] = c.get(f"/v1/files/{fid}")
        answers["GET /v1/files/{id}/content"] = c.get(f"/v1/files/{fid}/content")
        made = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                           "completion_window": "24h"})
        answers["POST /v1/batches"] = made
        bid = made.json().get("id", "none")
        answers["GET /v1/batches"] = c.get("/v1/batches")
        answers["GET /v1/batches/{id}"] = c.get(f"/v1/batches/{bid}")
        answers["POST /v1/batches/{id}/cancel"] = c.post(f"/v1/batches/{bid}/cancel")
        answers["GET /"] = c.get("/")
        answers["GET /ui/{file}"] = c.get("/ui/chat.js")
        seen["statuses"] = {route: r.status_code for route, r in answers.items()}
        seen["codes"] = {route: r.json().get("error", {}).get("code") for route, r in answers.items()
                         if r.headers.get("content-type", "").startswith("application/json")
                         and isinstance(r.json(), dict)}
        with c.websocket_connect("/v1/ws") as ws:
            ws.send_json({"type": "generate", "id": "g", "prompt": "hi", "params": {"max_tokens": 2}})
            seen["ws_frame"] = ws.receive_json()
    seen["torch"] = "torch" in sys.modules
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
