"""Over-long embedding inputs, as each API defines them, with the official `ollama` and `openai`
clients against a live server whose context is 32 tokens (so at most 31 input tokens).

Ollama's /api/embed truncates by default (the input's first tokens; `options.num_ctx` lowers the
bound) and refuses with `truncate: false`; OpenAI's /v1/embeddings refuses (a 400 naming `input`)
unless vLLM's `truncate_prompt_tokens` asks for the last k tokens (-1: as many as fit). Each
truncated vector is checked against transformers' AutoModel on exactly the token ids transformers'
own tokenizer keeps with `truncation=True, max_length=k` from that side (the served model is the
tiny Qwen3 embedding model of test_embeddings_api; its tokenizer puts a BOS first, which both
keep), and the usage and ledger count the kept tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import ollama
import openai
import pytest

from server.text.tokenizer import Tokenizer
from tests.server.formats.conftest import _create_key
from tests.server.harness import ServerProcess, ledger_rows
from tests.server.test_embeddings_api import close, reference
from tests.tiny_models import with_pooling_config

CONTEXT = 32
LONGEST = CONTEXT - 1  # every request leaves one position
LONG = "Embeddings of a long text keep only what fits in the context window of the model. " * 4


@dataclass
class Served:
    proc: ServerProcess
    model_dir: Path
    key: str

    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="module")
def srv(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("embed-truncation")
    model = with_pooling_config(tiny_model("qwen3"), tmp / "model", "last", base_model=True)
    db = tmp / "ledger.db"
    key = _create_key(db, "embed")
    # Deterministic mode: the tests compare a text embedded in a batch with the same text alone, bit
    # for bit, which only batch-invariant kernels promise (`auto` leaves fp32 off on AVX-512 CPUs,
    # where the start-up autotune may then give the two batch sizes different GEMM paths).
    proc = ServerProcess(model, db, "--served-model-name", "emb", "--max-model-len", str(CONTEXT),
                         "--deterministic", "on", served_model_name=None)
    proc.start()
    try:
        yield Served(proc, model, key)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def ids(srv: Served) -> list[int]:
    out = Tokenizer.from_dir(srv.model_dir).encode(LONG)
    assert len(out) > CONTEXT
    return out


def hf_kept(model_dir: Path, text: str, k: int, side: str) -> list[int]:
    """The ids transformers' tokenizer keeps of `text` truncated to `k` tokens from `side`."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir, truncation_side=side)(text, truncation=True,
                                                                               max_length=k)["input_ids"])


def test_ollama_truncates_to_the_first_tokens_by_default(srv: Served, ids: list[int]) -> None:
    client = ollama.Client(host=srv.proc.base, headers=srv.bearer(), timeout=300)
    r = client.embed(model="emb", input=[LONG, "short"])
    assert r.prompt_eval_count == LONGEST + len(Tokenizer.from_dir(srv.model_dir).encode("short"))
    first = hf_kept(srv.model_dir, LONG, LONGEST, "right")
    assert first[:1] == ids[:1] and len(first) == LONGEST  # the BOS, then the text's first tokens
    assert close(list(r.embeddings[0]), reference(srv.model_dir, first))
    # `truncate: true` said aloud is the same; options.num_ctx lowers the bound (and never raises it).
    same = client.embed(model="emb", input=LONG, truncate=True)
    assert list(same.embeddings[0]) == list(r.embeddings[0])
    small = client.embed(model="emb", input=LONG, options={"num_ctx": 10})
    assert small.prompt_eval_count == 10 and close(list(small.embeddings[0]),
                                                     reference(srv.model_dir, hf_kept(srv.model_dir, LONG, 10, "right")))
    big = client.embed(model="emb", input=LONG, options={"num_ctx": 4096})
    assert big.prompt_eval_count == LONGEST
    # The ledger row counts the kept tokens.
    raw = httpx.post(srv.proc.base + "/api/embed", json={"model": "emb", "input": LONG}, headers=srv.bearer(),
                     timeout=300)
    assert ledger_rows(srv.proc.db)[raw.headers["x-request-id"]]["prompt_tokens"] == LONGEST


def test_ollama_refuses_with_truncate_false(srv: Served) -> None:
    client = ollama.Client(host=srv.proc.base, headers=srv.bearer(), timeout=300)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="emb", input=["fits", LONG], truncate=False)
    assert e.value.status_code == 400 and e.value.error.startswith("input[1]:")
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="emb", input=LONG, options={"num_ctx": 0})
    assert e.value.status_code == 400 and e.value.error.startswith("options.num_ctx:")


def test_openai_refuses_unless_truncate_prompt_tokens(srv: Served, ids: list[int]) -> None:
    oa = openai.OpenAI(base_url=srv.proc.base + "/v1", api_key=srv.key, max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError) as e:
        oa.embeddings.create(model="emb", input=LONG)
    assert e.value.body["param"] == "input"  # type: ignore[index]
    # vLLM's left truncation: the last k tokens.
    r = oa.embeddings.create(model="emb", input=LONG, encoding_format="float", extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8
    assert close(r.data[0].embedding, reference(srv.model_dir, hf_kept(srv.model_dir, LONG, 8, "left")))
    short = Tokenizer.from_dir(srv.model_dir).encode("short")
    r = oa.embeddings.create(model="emb", input=[LONG, "short"], encoding_format="float",
                             extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == LONGEST + len(short)
    assert close(r.data[0].embedding, reference(srv.model_dir, hf_kept(srv.model_dir, LONG, LONGEST, "left")))
    assert close(r.data[1].embedding, reference(srv.model_dir, short))  # it fit: unchanged
    # Token ids are all the input's own: the last 3 are kept.
    r = oa.embeddings.create(model="emb", input=ids, encoding_format="float", extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and close(r.data[0].embedding, reference(srv.model_dir, ids[-3:]))
    for bad in (CONTEXT, 0, -2):
        with pytest.raises(openai.BadRequestError) as e:
            oa.embeddings.create(model="emb", input="x", extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens", bad  # type: ignore[index]
