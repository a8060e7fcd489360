"""Embeddings over HTTP, the WebSocket and the batch tier, with the official `openai` and `ollama`
clients (and a plain WebSocket client) against a live server.

The served model is a tiny random-weight Qwen3 saved as a sentence-transformers embedding model
(last-token pooling, Normalize; a base-model checkpoint without `model.` prefixes or lm_head:
tests.tiny_models.with_pooling_config), detected as one with `--task auto`. The vectors are checked
against transformers' AutoModel (last hidden state of the last token, L2-normalised) to a max abs
difference of 1e-4, and each input's ledger row, usage and quota use are checked too. Auth is on:
`key` has no limits, `tight` a daily quota of exactly one 12-token input.
"""
from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import ollama
import openai
import pytest
import torch

from server.text.tokenizer import Tokenizer
from tests.server.formats.conftest import _create_key
from tests.server.harness import ServerProcess, ledger_rows
from tests.tiny_models import with_pooling_config

TOL = 1e-4
TIGHT_DAILY = 12


@dataclass
class EmbedServer:
    proc: ServerProcess
    model_dir: Path
    key: str
    tight: str

    @property
    def base(self) -> str:
        return self.proc.base

    def bearer(self, secret: str = "") -> dict[str, str]:
        return {"Authorization": f"Bearer {secret or self.key}"}


@pytest.fixture(scope="module")
def emb(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbedServer]:
    tmp = tmp_path_factory.mktemp("embed-server")
    model = with_pooling_config(tiny_model("qwen3"), tmp / "model", "last", base_model=True)
    db = tmp / "ledger.db"
    key = _create_key(db, "embed")
    tight = _create_key(db, "tight", "--daily-tokens", str(TIGHT_DAILY))
    # Deterministic mode: a prefix-cache hit then gives the same vector bit for bit.
    proc = ServerProcess(model, db, "--served-model-name", "emb", "--deterministic", "on", served_model_name=None)
    proc.start()
    try:
        yield EmbedServer(proc, model, key, tight)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def oa(emb: EmbedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=emb.base + "/v1", api_key=emb.key, max_retries=0, timeout=300)


_HF: dict[str, Any] = {}


def reference(model_dir: Path, ids: list[int], dims: int | None = None) -> torch.Tensor:
    from transformers import AutoModel

    if str(model_dir) not in _HF:
        _HF[str(model_dir)] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        last = _HF[str(model_dir)](input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last[:dims] if dims else last, dim=0)


def close(vec: list[float], ref: torch.Tensor) -> bool:
    return len(vec) == ref.numel() and (torch.tensor(vec) - ref).abs().max().item() <= TOL


TEXTS = ["The capital of France is Paris.", "hi", "Embeddings pool the prompt's final hidden states into one vector."]


def test_openai_client_strings_base64_and_float(emb: EmbedServer, oa: openai.OpenAI) -> None:
    tok = Tokenizer.from_dir(emb.model_dir)
    ids = [tok.encode(t) for t in TEXTS]
    # The openai client asks for base64 unless told otherwise and decodes it with numpy.
    r = oa.embeddings.create(model="emb", input=TEXTS)
    assert r.object == "list" and r.model == "emb" and [d.index for d in r.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in r.data)
    for d, i in zip(r.data, ids):
        assert close(d.embedding, reference(emb.model_dir, i))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    # float, by hand: the same vectors; and base64 is exactly their little-endian float32 bytes.
    body = {"model": "emb", "input": TEXTS, "encoding_format": "float"}
    floats = httpx.post(emb.base + "/v1/embeddings", json=body, headers=emb.bearer(), timeout=300).json()
    raw = httpx.post(emb.base + "/v1/embeddings", json={**body, "encoding_format": "base64"},
                     headers=emb.bearer(), timeout=300)
    for f, b, d in zip(floats["data"], raw.json()["data"], r.data):
        as_f32 = list(struct.unpack(f"<{len(f['embedding'])}f", base64.b64decode(b["embedding"])))
        assert as_f32 == [struct.unpack("<f", struct.pack("<f", x))[0] for x in f["embedding"]]
        assert d.embedding == as_f32
    # One ledger row per input: kind embedding, usage = its input tokens, nothing generated.
    rows = ledger_rows(emb.proc.db)
    mine = [rows[rid] for rid in raw.headers["x-request-id"].split(",")]
    assert [(r["kind"], r["state"], r["prompt_tokens"], r["completion_tokens"]) for r in mine] == \
        [("embedding", "finished", len(i), 0) for i in ids]


def test_token_ids_dimensions_and_prefix_cache(emb: EmbedServer, oa: openai.OpenAI) -> None:
    import random

    rng = random.Random(9)
    a = [rng.randrange(4, 500) for _ in range(40)]
    b = [rng.randrange(4, 500) for _ in range(7)]
    one = oa.embeddings.create(model="emb", input=a, encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, reference(emb.model_dir, a))
    many = oa.embeddings.create(model="emb", input=[a, b], encoding_format="float")
    assert close(many.data[1].embedding, reference(emb.model_dir, b)) and many.usage.prompt_tokens == 47
    # The second `a` hit the prefix cache (last-token pooling recomputes only the last token) and
    # gave the same vector.
    assert many.data[0].embedding == one.data[0].embedding
    rid = httpx.post(emb.base + "/v1/embeddings", json={"model": "emb", "input": a}, headers=emb.bearer(),
                     timeout=300).headers["x-request-id"]
    assert ledger_rows(emb.proc.db)[rid]["cached_tokens"] == 32
    # Matryoshka: the leading 16 values, normalised again.
    short = oa.embeddings.create(model="emb", input=a, dimensions=16, encoding_format="float").data[0].embedding
    assert close(short, reference(emb.model_dir, a, 16)) and abs(sum(x * x for x in short) - 1.0) < 1e-5


def test_idempotency_key_returns_the_same_vectors(emb: EmbedServer) -> None:
    body = {"model": "emb", "input": ["first", "second"], "encoding_format": "float"}
    headers = {**emb.bearer(), "Idempotency-Key": "embed-retry-1"}
    first = httpx.post(emb.base + "/v1/embeddings", json=body, headers=headers, timeout=300)
    again = httpx.post(emb.base + "/v1/embeddings", json={**body, "encoding_format": "base64"}, headers=headers,
                       timeout=300)
    assert first.status_code == again.status_code == 200
    assert first.headers["x-request-id"] == again.headers["x-request-id"]  # the same two requests
    for f, b in zip(first.json()["data"], again.json()["data"]):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == \
            [struct.unpack("<f", struct.pack("<f", x))[0] for x in f["embedding"]]
    other = httpx.post(emb.base + "/v1/embeddings", json={**body, "input": ["other", "second"]}, headers=headers,
                       timeout=300)
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key"


@pytest.mark.parametrize("body, field", [
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": ["a", [5, 6]]}, "input"),
    ({"input": [5, 99999]}, "input"),
    ({"input": [[5, 6], [7, -1]]}, "input[1]"),
    ({"input": {"text": "a"}}, "input"),
    ({}, "input"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(emb: EmbedServer, body: dict[str, Any], field: str) -> None:
    r = httpx.post(emb.base + "/v1/embeddings", json=body, headers=emb.bearer(), timeout=300)
    err = r.json()["error"]
    assert r.status_code in (400, 404), r.text
    assert err["message"].startswith(field), err
    if field != "model":
        assert r.status_code == 400


def test_generation_requests_to_an_embedding_model_are_400s_naming_it(emb: EmbedServer, oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model" and "'emb' is an embedding model" in e.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model="emb", prompt="hi")
    r = httpx.post(emb.base + "/api/chat", json={"model": "emb", "messages": [{"role": "user", "content": "hi"}],
                                                  "stream": False}, headers=emb.bearer(), timeout=300)
    assert r.status_code == 400 and r.json()["error"].startswith("model: 'emb' is an embedding model")


def test_ollama_client_embed_and_legacy_embeddings(emb: EmbedServer, oa: openai.OpenAI) -> None:
    client = ollama.Client(host=emb.base, headers=emb.bearer(), timeout=300)
    tok = Tokenizer.from_dir(emb.model_dir)
    r = client.embed(model="emb", input=TEXTS[:2])
    assert r.model == "emb" and len(r.embeddings) == 2
    assert r.prompt_eval_count == sum(len(tok.encode(t)) for t in TEXTS[:2])
    assert r.total_duration is not None and r.total_duration > 0 and r.load_duration == 0
    for vec, t in zip(r.embeddings, TEXTS[:2]):
        assert close(list(vec), reference(emb.model_dir, tok.encode(t)))
    assert list(client.embed(model="emb:latest", input=TEXTS[0], dimensions=8).embeddings[0]) == \
        oa.embeddings.create(model="emb", input=TEXTS[0], dimensions=8, encoding_format="float").data[0].embedding
    legacy = client.embeddings(model="emb", prompt=TEXTS[0])
    assert list(legacy.embedding) == list(r.embeddings[0])
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="emb", input=[])
    assert e.value.status_code == 400 and e.value.error.startswith("input:")
    bad = httpx.post(emb.base + "/api/embed", json={"model": "emb", "input": [[5, 6]]}, headers=emb.bearer())
    assert bad.status_code == 400 and bad.json()["error"].startswith("input[0]:")
    bad = httpx.post(emb.base + "/api/embed", json={"model": "emb", "input": "x", "dimensions": 100},
                     headers=emb.bearer())
    assert bad.status_code == 400 and bad.json()["error"].startswith("dimensions:")
    bad = httpx.post(emb.base + "/api/embeddings", json={"model": "emb"}, headers=emb.bearer())
    assert bad.status_code == 400 and bad.json()["error"].startswith("prompt:")


def test_quota_reserves_and_settles_the_input_tokens(emb: EmbedServer) -> None:
    """`tight` may spend exactly 12 tokens a day: one 12-token input fits (its reservation is the
    input alone, nothing for output), and the next is a 429 in OpenAI's shape."""
    tight = openai.OpenAI(base_url=emb.base + "/v1", api_key=emb.tight, max_retries=0, timeout=300)
    ids = list(range(10, 10 + TIGHT_DAILY))
    ok = tight.embeddings.create(model="emb", input=ids, encoding_format="float")
    assert ok.usage.prompt_tokens == TIGHT_DAILY
    with pytest.raises(openai.RateLimitError) as e:
        tight.embeddings.create(model="emb", input=[5])
    assert e.value.status_code == 429 and e.value.body["type"]  # type: ignore[index]
    usage = httpx.get(emb.base + "/v1/usage", headers=emb.bearer(emb.tight)).json()
    assert usage["data"][0]["prompt_tokens"] == TIGHT_DAILY and usage["data"][0]["completion_tokens"] == 0


def test_a_retry_whose_vector_was_not_kept_is_a_409_not_a_500() -> None:
    """With --ledger-text none (or prompt) the ledger keeps no output, so an idempotent retry
    answered from the ledger has no vector to return: a 409 naming the key, never a 500."""
    from server.api.embeddings_format import encode_vector, vector_of
    from server.serving.errors import Conflict
    from server.serving.lifecycle import EndReason
    from server.serving.streams import EndEvent, Usage

    kept = EndEvent("req-a", EndReason.FINISHED, ["stop"], Usage(3, 0), 1, output={"embedding": [0.5, -1.25]})
    assert vector_of(kept) == [0.5, -1.25]
    assert base64.b64decode(str(encode_vector([0.5, -1.25], "base64"))) == struct.pack("<2f", 0.5, -1.25)
    gone = EndEvent("req-b", EndReason.FINISHED, ["stop"], Usage(3, 0), 1, output={})
    with pytest.raises(Conflict) as e:
        vector_of(gone)
    assert e.value.status == 409 and e.value.param == "Idempotency-Key" and e.value.code == "output_not_kept"


def test_websocket_embedding_requests(emb: EmbedServer, oa: openai.OpenAI) -> None:
    """`generate` frames of kind "embedding", multiplexed on one socket: accepted, an empty delta,
    then a `done` carrying the vector, equal to /v1/embeddings' and to transformers'; bad frames are errors naming
    the field."""
    import asyncio

    from tests.server.harness import WsClient

    tok = Tokenizer.from_dir(emb.model_dir)
    ids = [5, 17, 99, 230, 7]

    async def main() -> dict[str, list[dict[str, Any]]]:
        async with WsClient(emb.proc.ws_url, emb.bearer()) as ws:
            return await ws.run({
                "a": {"kind": "embedding", "prompt": TEXTS[0]},
                "b": {"kind": "embedding", "prompt": ids, "dimensions": 8},
                "c": {"kind": "embedding", "prompt": TEXTS[2], "params": {"user": "someone"}},
                "no-prompt": {"kind": "embedding", "messages": [{"role": "user", "content": "x"}]},
                "sampling": {"kind": "embedding", "prompt": "x", "params": {"temperature": 0.5}},
                "dims": {"kind": "embedding", "prompt": "x", "dimensions": 0},
                "chat": {"kind": "chat", "messages": [{"role": "user", "content": "x"}]},
            })

    got = asyncio.run(main())
    for cid, text in (("a", TEXTS[0]), ("c", TEXTS[2])):
        frames = got[cid]
        # Nothing is generated: one empty delta ends the sample, then `done` carries the vector.
        assert [f["type"] for f in frames] == ["accepted", "delta", "done"], frames
        assert (frames[1]["text"], frames[1]["token_ids"], frames[1]["finish_reason"]) == ("", [], "stop")
        done = frames[-1]
        assert done["usage"]["prompt_tokens"] == len(tok.encode(text)) and done["usage"]["completion_tokens"] == 0
        assert close(done["embedding"], reference(emb.model_dir, tok.encode(text)))
        http = oa.embeddings.create(model="emb", input=text, encoding_format="float").data[0].embedding
        assert done["embedding"] == http
    assert close(got["b"][-1]["embedding"], reference(emb.model_dir, ids, 8))
    rows = ledger_rows(emb.proc.db)
    row = rows[got["a"][-1]["request_id"]]
    assert (row["kind"], row["api"], row["state"]) == ("embedding", "ws", "finished")
    for cid, field in (("no-prompt", "messages"), ("sampling", "params"), ("dims", "dimensions"), ("chat", "model")):
        err = got[cid][-1]
        assert err["type"] == "error" and err["param"] == field, err


def test_batch_of_embedding_lines_with_the_openai_client(emb: EmbedServer, oa: openai.OpenAI) -> None:
    """An OpenAI Batch API file of `url: /v1/embeddings` lines: each line's response body is what
    /v1/embeddings answers (float and base64), a line with several inputs or a bad field goes to
    the error file, and the lines run as the key's requests."""
    import json
    import time

    def line(cid: str, **body: Any) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                           "body": {"model": "emb", **body}})

    lines = [line("a", input=TEXTS[0], encoding_format="float"), line("b", input=[TEXTS[1]], encoding_format="base64"),
             line("ids", input=[9, 8, 7], dimensions=4, encoding_format="float"),
             line("many", input=TEXTS[:2]), line("dims", input="x", dimensions=0)]
    f = oa.files.create(file=("emb.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 300
    while b.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, b
        time.sleep(0.1)
        b = oa.batches.retrieve(b.id)
    assert b.status == "completed" and b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (5, 3, 2)
    assert b.output_file_id and b.error_file_id
    out = {o["custom_id"]: o["response"] for o in map(json.loads, oa.files.content(b.output_file_id).text.splitlines())}
    direct = oa.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    assert out["a"]["status_code"] == 200 and out["a"]["body"] == direct.model_dump(exclude_unset=True)
    raw = base64.b64decode(out["b"]["body"]["data"][0]["embedding"])
    tok = Tokenizer.from_dir(emb.model_dir)
    assert close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), reference(emb.model_dir, tok.encode(TEXTS[1])))
    assert close(out["ids"]["body"]["data"][0]["embedding"], reference(emb.model_dir, [9, 8, 7], 4))
    assert out["ids"]["body"]["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    errors = {e["custom_id"]: e["response"] for e in map(json.loads, oa.files.content(b.error_file_id).text.splitlines())}
    assert errors["many"]["status_code"] == 400 and errors["many"]["body"]["error"]["param"] == "input"
    assert errors["dims"]["status_code"] == 400 and errors["dims"]["body"]["error"]["param"] == "dimensions"
    rows = [r for r in ledger_rows(emb.proc.db).values() if (r["idempotency_key"] or "").startswith(f"batch-{b.id}-")]
    assert len(rows) == 3 and all(r["kind"] == "embedding" and r["api"] == "batch" and r["state"] == "finished"
                                  for r in rows)
