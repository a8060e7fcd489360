"""Several models in one process (issue 30): three tiny models and a LoRA adapter over the first
served at once, loaded on demand within a memory budget, each request exact against its model alone
(transformers' greedy tokens; PEFT's for the adapter).

Clients are the official `openai` library; waits are on events (a stream's first chunk, a
response), never sleeps.
"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from tests.server.harness import ServerProcess, ledger_rows

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

# Loads stay quick on 2 cores without the start-up autotune; every model gets these flags.
FLAGS = ["--autotune", "off"]
PROMPTS = [[1, 17, 93, 250, 7, 41], [1, 300, 12, 12, 5]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def three(tiny_model: Callable[..., Path]) -> dict[str, Path]:
    """Three different tiny models (three architectures, so a mix-up cannot go unseen)."""
    return {"alpha": tiny_model("llama"), "beta": tiny_model("qwen2"), "gamma": tiny_model("qwen3")}


def reference(path: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens for `prompt` (EOS ignored, as the requests ask)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def decode(path: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def model_args(models: dict[str, Path]) -> list[str]:
    return [a for name, p in models.items() for a in ("--model", f"{name}={p}")]


@pytest.fixture(scope="module")
def adapter(three: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter over alpha, the default model (`--lora tuned=...`)."""
    from tests.lora_adapters import make_lora_adapter

    return make_lora_adapter(three["alpha"], tmp_path_factory.mktemp("multi-lora") / "tuned", r=4, alpha=8, seed=2)


@pytest.fixture(scope="module")
def served(three: dict[str, Path], adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    db = tmp_path_factory.mktemp("multi") / "multi.db"
    srv = ServerProcess(None, db, *model_args(three), "--lora", f"tuned={adapter}", *FLAGS, served_model_name=None)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_models_lists_every_model_with_its_state(served: ServerProcess) -> None:
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused")
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"alpha", "beta", "gamma", "tuned"}
    assert listed["tuned"].model_extra["parent"] == "alpha"
    # The first declared is the default model, loaded at start; the others load on demand.
    states = {name: m.model_extra["state"] for name, m in listed.items()}
    assert states["alpha"] == "loaded"
    tags = httpx.get(served.base + "/api/tags").json()["models"]
    assert {t["name"] for t in tags} == {"alpha:latest", "beta:latest", "gamma:latest", "tuned:latest"}
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="delta", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_interleaved_concurrent_requests_are_exact_against_each_model_alone(
        served: ServerProcess, three: dict[str, Path], adapter: Path) -> None:
    from tests.lora_adapters import peft_greedy

    want = {(name, i): decode(path, reference(path, p, MAX_TOKENS))
            for name, path in three.items() for i, p in enumerate(PROMPTS)}
    want.update({("tuned", i): decode(three["alpha"], peft_greedy(three["alpha"], adapter, p, MAX_TOKENS))
                 for i, p in enumerate(PROMPTS)})
    names = [*three, "tuned"]

    async def one(client: Any, name: str, i: int, stream: bool) -> tuple[str, int, str]:
        kw: dict[str, Any] = dict(model=name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0,
                                  extra_body={"ignore_eos": True})
        if not stream:
            r = await client.completions.create(**kw)
            assert r.model == name
            return name, i, r.choices[0].text
        text = ""
        async for chunk in await client.completions.create(stream=True, **kw):
            assert chunk.model == name
            text += "".join(c.text for c in chunk.choices)
        return name, i, text

    async def main() -> list[tuple[str, int, str]]:
        async with openai.AsyncOpenAI(base_url=served.base + "/v1", api_key="unused", timeout=300) as client:
            # Interleaved: every model's requests alternate, half streamed, all in flight at once
            # (beta and gamma load on demand meanwhile; their requests wait, never 404).
            jobs = [one(client, name, i, stream=(k % 2 == 1))
                    for k, (i, name) in enumerate((i, n) for i in range(len(PROMPTS)) for n in names)]
            jobs += [one(client, name, i, stream=True) for name in reversed(names) for i in range(len(PROMPTS))]
            return await asyncio.gather(*jobs)

    got = asyncio.run(main())
    assert len(got) == 16
    for name, i, text in got:
        assert text == want[(name, i)], (name, i)
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused")
    assert all(m.model_extra["state"] == "loaded" for m in client.models.list().data)
    ps = httpx.get(served.base + "/api/ps").json()["models"]
    assert {m["name"] for m in ps} == {"alpha:latest", "beta:latest", "gamma:latest"}


def test_websocket_frames_name_their_model(served: ServerProcess, three: dict[str, Path]) -> None:
    """One socket, one frame per model (the chat page's picker sends `model`), exact as over HTTP."""
    from tests.server.harness import WsClient, tokens_of

    async def main() -> dict[str, list[dict[str, Any]]]:
        async with WsClient(served.ws_url) as ws:
            frames = {name: {"prompt": PROMPTS[0], "model": name, "params": {"max_tokens": MAX_TOKENS,
                                                                              "temperature": 0, "ignore_eos": True}}
                      for name in three}
            frames["nope"] = {"prompt": PROMPTS[0], "model": "delta"}
            return await ws.run(frames)

    got = asyncio.run(main())
    for name, path in three.items():
        assert got[name][-1]["type"] == "done", got[name][-1]
        assert tokens_of(got[name]) == reference(path, PROMPTS[0], MAX_TOKENS), name
    assert got["nope"][-1]["type"] == "error" and got["nope"][-1]["code"] == "model_not_found"


def test_ledger_usage_and_metrics_carry_the_model(served: ServerProcess, three: dict[str, Path]) -> None:
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused")
    for name in three:
        client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=2)
    rows = ledger_rows(served.db)
    per_model: dict[str, int] = {}
    for r in rows.values():
        per_model[r["model"]] = per_model.get(r["model"], 0) + 1
    # The ledger and usage name what each request named (the adapter's rows as `tuned`, when the
    # interleaved test ran before); /metrics counts per loaded model, the adapter's under alpha.
    assert set(three) <= set(per_model) <= {*three, "tuned"} and all(n >= 1 for n in per_model.values())
    usage = httpx.get(served.base + "/v1/usage", params={"group_by": "model"}).json()["data"]
    by_model = {u["model"]: u for u in usage}
    assert set(by_model) == set(per_model)
    assert all(by_model[n]["requests"] == per_model[n] for n in per_model), usage
    per_lane = {n: per_model[n] + (per_model.get("tuned", 0) if n == "alpha" else 0) for n in three}
    metrics = httpx.get(served.base + "/metrics").text
    for name in three:
        m = re.search(rf'^pagewire_model_requests_total{{model="{name}",state="finished"}} (\S+)$', metrics, re.M)
        assert m is not None and float(m.group(1)) == per_lane[name], name
        m = re.search(rf'^pagewire_model_loads_total{{model="{name}"}} (\S+)$', metrics, re.M)
        assert m is not None and float(m.group(1)) == 1.0
        assert re.search(rf'^pagewire_model_load_seconds{{model="{name}"}} [0-9.e-]+$', metrics, re.M)


# -- the memory budget ---------------------------------------------------------------------------


def footprint(path: Path) -> int:
    """A model's share of the budget, computed as the server computes it (server.serving.model_lane)."""
    from server.engine.plan import make_plan, read_model_config
    from server.serving.settings import ServeSettings
    from tests.server.harness import FAST_ENGINE

    kw = {FAST_ENGINE[i][2:].replace("-", "_"): int(FAST_ENGINE[i + 1]) for i in range(0, len(FAST_ENGINE), 2)}
    s = ServeSettings(**kw, autotune=False)
    plan = make_plan("x", read_model_config(path), s.engine_config(str(path)), None, None)
    return plan.weights.total + plan.activations + plan.layout.total_bytes


def states(srv: ServerProcess) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(srv.base + "/v1/models").json()["data"]}


def test_a_budget_for_two_unloads_the_least_recently_used_idle_model_never_a_streaming_one(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    # Three models of one shape (so one footprint), different weights.
    # A context as long as the KV pool, so a's stream runs for thousands of steps.
    models = {name: tiny_model("llama", seed=seed, max_position_embeddings=4096)
              for seed, name in enumerate(("a", "b", "c"))}
    sizes = {footprint(p) for p in models.values()}
    assert len(sizes) == 1
    budget = int(sizes.pop() * 2.5)  # two fit, three do not
    srv = ServerProcess(None, tmp_path / "budget.db", *model_args(models), *FLAGS,
                        "--memory-budget", str(budget), served_model_name=None).start()
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=300)
        assert states(srv) == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
        # a streams a long answer; while it runs, b answers (b is now the more recently used)...
        stream = client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=4000, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)  # the stream is live: a has a running request
        assert first.model == "a"
        client.completions.create(model="b", prompt=PROMPTS[1], max_tokens=2)
        assert states(srv) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        # ...so a is the least recently used, but busy: c's load must unload b, the idle one.
        r = client.completions.create(model="c", prompt=PROMPTS[1], max_tokens=2)
        assert r.choices[0].text is not None
        health = httpx.get(srv.base + "/health").json()
        seen = states(srv)
        # a was still streaming when c loaded (else the order would prove nothing).
        assert health["models"]["a"]["live_requests"] == 1, health
        assert seen == {"a": "loaded", "b": "unloaded", "c": "loaded"}, seen
        stream.close()  # the client leaves: a's request is cancelled (it was never cut by the load)
        metrics = httpx.get(srv.base + "/metrics").text
        assert re.search(r'^pagewire_model_unloads_total{model="b"} 1\.0$', metrics, re.M)
        assert re.search(r'^pagewire_model_unloads_total{model="a"} 0\.0$', metrics, re.M)
        # b again: c, idle and used before a's request ended, is now the least recently used.
        client.completions.create(model="b", prompt=PROMPTS[1], max_tokens=2)
        assert states(srv) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        rows = ledger_rows(srv.db)
        assert sorted(r["model"] for r in rows.values()) == ["a", "b", "b", "c"]
        assert all(r["state"] == "finished" for r in rows.values() if r["model"] != "a")
    finally:
        srv.stop()


def test_ollama_keep_alive_zero_unloads_an_idle_model(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    models = {"a": tiny_model("llama"), "b": tiny_model("llama", seed=1)}
    srv = ServerProcess(None, tmp_path / "ka.db", *model_args(models), *FLAGS, served_model_name=None).start()
    try:
        r = httpx.post(srv.base + "/api/generate", timeout=300,
                       json={"model": "b", "prompt": "hi", "stream": False, "keep_alive": 0,
                             "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        # keep_alive 0: unloaded once idle. The unload runs on the server's loop after the
        # answer; /api/ps is polled until it shows (bounded by the HTTP client's own calls).
        for _ in range(200):
            if {m["name"] for m in httpx.get(srv.base + "/api/ps").json()["models"]} == {"a:latest"}:
                break
        assert {m["name"] for m in httpx.get(srv.base + "/api/ps").json()["models"]} == {"a:latest"}
        assert json.loads(httpx.get(srv.base + "/v1/models").text)["data"][1]["state"] == "unloaded"
        # The next request without keep_alive gets --keep-alive's (forever) again: b stays loaded.
        r = httpx.post(srv.base + "/api/generate", timeout=300,
                       json={"model": "b", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        ps = httpx.get(srv.base + "/api/ps").json()["models"]
        assert {m["name"] for m in ps} == {"a:latest", "b:latest"}
        assert all(m["expires_at"].startswith("2318") for m in ps)  # Ollama's "never"
    finally:
        srv.stop()
