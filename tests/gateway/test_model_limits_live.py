"""A key's per-model limits on a live server with two tiny models (issue 30), through the official
`openai` client: the model's TPM refuses that model with OpenAI's 429 body and x-ratelimit-*
headers naming the model's limit, while the other model (limited only key-wide) and a LoRA adapter
over the refused one (a model name of its own) still serve, and the refusals took nothing from the
key-wide bucket; and a model's daily quota read back from the
ledger after a restart. The in-process server's quota clock is injected, so no test sleeps."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.gateway.conftest import FakeClock
from tests.server.harness import ServerProcess, ledger_rows

openai = pytest.importorskip("openai")

PROMPT = [1, 17, 93]  # token ids: exactly 3 prompt tokens


@pytest.fixture(scope="module")
def two(tiny_model: Callable[..., Path]) -> dict[str, Path]:
    """Two different tiny models (two architectures): `a` (the default) and `b`."""
    return {"a": tiny_model("llama"), "b": tiny_model("qwen2")}


@pytest.fixture(scope="module")
def adapter(two: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter over `a` (served as `tuned`)."""
    from tests.lora_adapters import make_lora_adapter

    return make_lora_adapter(two["a"], tmp_path_factory.mktemp("limits-lora") / "tuned", r=4, alpha=8, seed=2)


async def _ws_generate(port: int, secret: str, model: str) -> dict[str, Any]:
    """The frame that ends one WebSocket generate of 50 tokens (done or error)."""
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{port}/v1/ws", proxy=None,
                       additional_headers={"Authorization": f"Bearer {secret}"}) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "w", "kind": "completion", "prompt": PROMPT,
                                  "model": model, "params": {"max_tokens": 47, "ignore_eos": True}}))
        while True:
            f: dict[str, Any] = json.loads(await ws.recv())
            if f["type"] in ("done", "error"):
                return f


def _tokens(resp: Any) -> tuple[str, str]:
    return resp.headers["x-ratelimit-limit-tokens"], resp.headers["x-ratelimit-remaining-tokens"]


def test_a_models_tpm_refuses_that_model_while_the_other_still_serves(
        in_process: Any, make_key: Any, tmp_path: Path, two: dict[str, Path], adapter: Path) -> None:
    db = tmp_path / "l.db"
    # `tuned`, a LoRA adapter over a, is a model name of its own: a's limit does not cover it.
    key_id, secret = make_key(db, "m", tpm=10_000, model_limits={"a": {"tpm": 60}, "tuned": {"rpm": 1}})
    srv = in_process(db, two, autotune=False, lora=(("tuned", str(adapter)),))
    clock = FakeClock()
    assert srv.gateway.quotas is not None
    srv.gateway.quotas.clock = clock
    c = openai.OpenAI(base_url=srv.base + "/v1", api_key=secret, max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(prompt=PROMPT, max_tokens=47, extra_body={"ignore_eos": True})
    ok = c.completions.with_raw_response.create(model="a", **kw)
    # 50 reserved: a's own bucket (60) binds before the key-wide one (10000), so its figures are sent.
    assert _tokens(ok) == ("60", "10")
    r = ok.parse()
    assert r.model == "a" and r.usage is not None and r.usage.total_tokens == 50
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="a", **kw)
    err = e.value
    assert err.status_code == 429
    body = err.body
    assert isinstance(body, dict) and body["code"] == "rate_limit_exceeded" and body["type"] == "rate_limit_error"
    assert body["param"] == "model"
    assert "rate limit reached for this key on model 'a': 60 tokens per minute" in body["message"]
    h = err.response.headers
    # 40 more tokens at 60 per minute: 40 s.
    assert _tokens(err.response) == ("60", "10") and h["x-ratelimit-reset-tokens"] == "50s"
    assert h["retry-after"] == "40" and h["retry-after-ms"] == "40000"
    # The WebSocket's `error` frame: the same code, param and wait.
    frame = asyncio.run(_ws_generate(srv.port, secret, "a"))
    assert (frame["type"], frame["code"], frame["param"], frame["retry_after_ms"]) == (
        "error", "rate_limit_exceeded", "model", 40000), frame
    # The chat API of the same model is refused the same way; and a request larger than a's whole
    # TPM is told it can never fit (x-should-retry: false), though the key-wide limit would allow it.
    chat = dict(model="a", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.RateLimitError, match="rate limit reached for this key on model 'a'"):
        c.chat.completions.create(**chat, max_tokens=20)  # type: ignore[call-overload]
    with pytest.raises(openai.RateLimitError, match="limit of 60 tokens per minute for model 'a'") as never:
        c.chat.completions.create(**chat, max_tokens=47)  # type: ignore[call-overload]
    assert never.value.response.headers["x-should-retry"] == "false"
    # Model b has no limit of its own: served, its headers are the key-wide bucket's, which the
    # refusals did not touch: 10000 - a's 50 - b's own 50.
    okb = c.completions.with_raw_response.create(model="b", **kw)
    assert _tokens(okb) == ("10000", "9900") and okb.parse().model == "b"
    # The adapter over a is limited by its own name's limits and the key-wide ones, not by a's.
    tuned = c.completions.with_raw_response.create(model="tuned", **kw)
    assert _tokens(tuned) == ("10000", "9850") and tuned.parse().model == "tuned"
    assert (tuned.headers["x-ratelimit-limit-requests"], tuned.headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    with pytest.raises(openai.RateLimitError, match="rate limit reached for this key on model 'tuned': 1 requests"):
        c.completions.create(model="tuned", **kw)
    # Once the advertised wait has passed, a is served again (the 50 it needed are all there were).
    clock.t += 40
    again = c.completions.with_raw_response.create(model="a", **kw)
    assert _tokens(again) == ("60", "0")
    # The refused requests left no ledger row; the served ones name the model they used.
    rows = [row for row in ledger_rows(db).values() if row["key_id"] == key_id]
    assert sorted(row["model"] for row in rows) == ["a", "a", "b", "tuned"]
    assert all(row["state"] == "finished" for row in rows)
    st = srv.gateway.quotas._models[(key_id, "a")]
    assert st.reserved == 0 and srv.gateway.quotas._keys[key_id].reserved == 0


def test_a_models_daily_quota_survives_a_restart(two: dict[str, Path], tmp_path: Path) -> None:
    """The key (made by the `keys` CLI with `--model-limit a:daily=100`) spends 43 tokens on a;
    a restarted server reads that back from the ledger, filtered by model: 57 left on a, while b
    (no limit of its own) takes a request larger than a's whole quota."""
    from tests.gateway.test_isolation_live import _create

    db = tmp_path / "d.db"
    key_id, secret = _create(db, "d", "--model-limit", "a:daily=100")
    args = ["--model", f"a={two['a']}", "--model", f"b={two['b']}", "--autotune", "off"]

    def client(srv: ServerProcess) -> Any:
        return openai.OpenAI(base_url=srv.base + "/v1", api_key=secret, max_retries=0, timeout=120)

    srv = ServerProcess(None, db, *args, served_model_name=None).start()
    try:
        r = client(srv).completions.create(model="a", prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.total_tokens == 43
    finally:
        srv.stop()
    srv2 = ServerProcess(None, db, *args, served_model_name=None).start()
    try:
        c = client(srv2)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="a", prompt=PROMPT, max_tokens=55)  # 58 > 57
        body = e.value.body
        assert isinstance(body, dict) and body["code"] == "daily_quota_exceeded" and body["param"] == "model"
        assert "daily token quota reached for this key on model 'a': 57 of 100 tokens left today" in body["message"]
        h = e.value.response.headers
        assert (h["x-ratelimit-limit-tokens-day"], h["x-ratelimit-remaining-tokens-day"]) == ("100", "57")
        assert int(h["retry-after"]) > 0
        big = c.completions.create(model="b", prompt=PROMPT, max_tokens=150, extra_body={"ignore_eos": True})
        assert big.usage is not None and big.usage.total_tokens == 153
        fits = c.completions.create(model="a", prompt=PROMPT, max_tokens=54, extra_body={"ignore_eos": True})
        assert fits.usage is not None and fits.usage.total_tokens == 57
        with pytest.raises(openai.RateLimitError, match="0 of 100"):
            c.completions.create(model="a", prompt=PROMPT, max_tokens=1)
    finally:
        srv2.stop()
