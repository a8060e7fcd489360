"""LoRA adapters through a live server (`--lora NAME=PATH`) with the official openai client: a
request's `model` names the base model or an adapter over it; concurrent base and adapter requests
(batched together by the engine) each equal transformers + PEFT's greedy text; /v1/models lists the
adapters with their parent; the ledger records the adapter's name; an unknown name is a 404."""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import openai
import pytest

from server.text.tokenizer import Tokenizer
from tests.lora_adapters import make_lora_adapter, peft_greedy
from tests.server.harness import ServerProcess, ledger_rows

MAX_NEW = 12


@pytest.fixture(scope="module")
def lora_server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lora-server")
    model = tiny_model("llama")
    adapters = {"all": make_lora_adapter(model, tmp / "all", r=4, alpha=8, seed=1),
                "attn": make_lora_adapter(model, tmp / "attn", targets=["q_proj", "v_proj", "o_proj"], r=8,
                                          alpha=8, seed=2)}
    db = tmp / "ledger.db"
    proc = ServerProcess(model, db, *[a for n, p in adapters.items() for a in ("--lora", f"{n}={p}")],
                         served_model_name="base")
    proc.start()
    try:
        yield {"proc": proc, "model": model, "adapters": adapters, "db": db}
    finally:
        proc.stop()


def test_models_lists_the_adapters(lora_server: dict[str, Any]) -> None:
    data = httpx.get(lora_server["proc"].base + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("base", None), ("all", "base"), ("attn", "base")]


def test_concurrent_base_and_adapter_requests_match_peft(lora_server: dict[str, Any]) -> None:
    model: Path = lora_server["model"]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(3)
    names: list[str] = ["base", "all", "attn", "all", "base", "attn"]
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(8, 30))] for _ in names]
    client = openai.AsyncOpenAI(base_url=lora_server["proc"].base + "/v1", api_key="unused", max_retries=0,
                                timeout=120)

    async def run() -> list[Any]:
        return await asyncio.gather(*[client.completions.create(model=n, prompt=p, max_tokens=MAX_NEW, temperature=0)
                                      for n, p in zip(names, prompts)])

    outs = asyncio.run(run())
    tok = Tokenizer.from_dir(model)
    for name, prompt, out in zip(names, prompts, outs):
        adapter: Optional[Path] = lora_server["adapters"].get(name)
        want = tok.decode(peft_greedy(model, adapter, prompt, MAX_NEW))
        assert out.choices[0].text == want, name
    rows = ledger_rows(lora_server["db"])
    assert sorted(r["model"] for r in rows.values() if r["api"] == "http") == sorted(names)


def test_chat_over_an_adapter_and_unknown_names(lora_server: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=lora_server["proc"].base + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hello there"}]
    base = client.chat.completions.create(model="base", messages=messages, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                          extra_body={"ignore_eos": True})
    tuned = client.chat.completions.create(model="all", messages=messages, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                           extra_body={"ignore_eos": True})
    assert tuned.usage is not None and tuned.usage.completion_tokens == 8
    assert tuned.choices[0].message.content != base.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found"
    assert "model: 'nope' does not exist; this server serves 'base', 'all', 'attn'" in str(e.value)
    # An API that runs the base model only says so, naming `model`.
    r = httpx.post(lora_server["proc"].base + "/v1/embeddings", json={"model": "all", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "is a LoRA adapter" in r.json()["error"]["message"]


def test_adapters_beside_another_model(tiny_model: Any, tmp_path: Path) -> None:
    """`--lora` goes over the default model while a second model is served beside it: the adapter's
    name runs the default model with the adapter (PEFT's text) over HTTP, Ollama's API and the
    WebSocket; the other model runs without one; an adapter named like a model is refused at start."""
    from tests.server.harness import WsClient

    base, other = tiny_model("llama"), tiny_model("qwen2")
    adapter = make_lora_adapter(base, tmp_path / "sql", r=4, alpha=8, seed=5)
    db = tmp_path / "lora-multi.db"
    flags = ["--autotune", "off", "--model", f"other={other}", "--lora", f"sql={adapter}"]
    prompt = [1, 40, 77, 300, 12, 9, 150]
    with ServerProcess(base, db, *flags, served_model_name="base") as srv:
        data = httpx.get(srv.base + "/v1/models").json()["data"]
        assert {(m["id"], m.get("parent")) for m in data} == {("base", None), ("other", None), ("sql", "base")}
        want = Tokenizer.from_dir(base).decode(peft_greedy(base, adapter, prompt, MAX_NEW))
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model="sql", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert got.choices[0].text == want
        # Ollama's API routes the adapter's name too: its text is the OpenAI route's for the adapter,
        # not the base model's.
        text = "select the rows"
        opts = {"temperature": 0, "num_predict": MAX_NEW}
        r = httpx.post(srv.base + "/api/generate", json={"model": "sql", "prompt": text, "raw": True, "stream": False,
                                                         "options": opts}, timeout=120)
        assert r.status_code == 200, r.text
        same = client.completions.create(model="sql", prompt=text, max_tokens=MAX_NEW, temperature=0)
        plain = client.completions.create(model="base", prompt=text, max_tokens=MAX_NEW, temperature=0)
        assert r.json()["response"] == same.choices[0].text != plain.choices[0].text

        async def ws() -> dict[str, list[dict[str, Any]]]:
            params = {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
            async with WsClient(srv.ws_url) as c:
                return await c.run({"a": {"model": "sql", "prompt": prompt, "params": params},
                                    "b": {"model": "other", "prompt": prompt, "params": params}})

        frames = asyncio.run(ws())
        ids = {k: [t for f in v if f["type"] == "delta" for t in f["token_ids"]] for k, v in frames.items()}
        assert frames["a"][-1]["type"] == frames["b"][-1]["type"] == "done", frames
        assert ids["a"] == peft_greedy(base, adapter, prompt, MAX_NEW)
        assert ids["b"] == peft_greedy(other, None, prompt, MAX_NEW)  # the other model, without the adapter
    models = {r["model"] for r in ledger_rows(db).values()}
    assert models == {"sql", "other", "base"}  # each row names what its request named
    clash = ServerProcess(base, tmp_path / "clash.db", "--model", f"sql={other}", "--lora", f"sql={adapter}")
    with pytest.raises(RuntimeError, match="adapter name 'sql' is also a served model's name"):
        clash.start(timeout=120)
