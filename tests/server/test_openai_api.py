"""The official openai SDK against a live server: chat and completions, streamed and not, n=2,
stop, logprobs, usage, the vLLM extras, and the small endpoints."""
from __future__ import annotations

import os
import re

import httpx
import openai
import pytest

from tests.server.harness import ServerProcess


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Tell me about the lighthouse."}]


def test_chat_streamed_equals_whole_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion"
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_streamed_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="demo", prompt="The train leaves", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    stream = client.completions.create(model="demo", prompt="The train leaves", max_tokens=10, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


def test_completion_prompt_tokens_match_tokenize(server: ServerProcess, client: openai.OpenAI) -> None:
    tok = httpx.post(server.base + "/tokenize", json={"prompt": "The train leaves"}).json()
    out = client.completions.create(model="demo", prompt="The train leaves", max_tokens=2)
    assert out.usage.prompt_tokens == tok["count"] == len(tok["tokens"])
    back = httpx.post(server.base + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == "The train leaves"


def test_n2_returns_two_choices_streamed_and_not(client: openai.OpenAI) -> None:
    out = client.completions.create(model="demo", prompt="Bread", max_tokens=6, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, n=2, stream=True,
                                          stream_options={"include_usage": True})
    texts: dict[int, str] = {0: "", 1: ""}
    usage = None
    for c in chat:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
        usage = c.usage or usage
    assert set(texts) == {0, 1} and usage is not None and usage.completion_tokens == 10


def test_stop_string_ends_text_before_it(client: openai.OpenAI) -> None:
    full = client.completions.create(model="demo", prompt="Gardens teach", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"need a non-blank stop string from {full!r}"
    out = client.completions.create(model="demo", prompt="Gardens teach", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(model="demo", prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_logprobs_shape_streamed_and_not(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [c for c in client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        stream=True) if c.choices and c.choices[0].logprobs]
    got = [e.logprob for c in streamed for e in c.choices[0].logprobs.content]
    assert got == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_vllm_extras_ignore_eos_min_tokens_priority(client: openai.OpenAI) -> None:
    out = client.completions.create(model="demo", prompt="x", max_tokens=7, temperature=0.8, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.2, seed=3, user="alice",
                                    extra_body={"ignore_eos": True, "min_tokens": 7, "priority": 2,
                                                "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


def test_max_completion_tokens_is_honoured(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_completion_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_models_health_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    text = httpx.get(server.base + "/metrics").text
    for name in ("pagewire_time_to_first_token_seconds_bucket", "pagewire_inter_token_latency_seconds_bucket",
                 "pagewire_e2e_request_latency_seconds_bucket", "pagewire_request_queue_time_seconds_bucket",
                 "pagewire_requests_running", "pagewire_requests_waiting", "pagewire_kv_cache_usage_ratio",
                 "pagewire_prompt_tokens_total", "pagewire_generation_tokens_total",
                 "pagewire_prefix_cache_hit_tokens_total", "pagewire_preemptions_total",
                 "pagewire_cpu_threads", "pagewire_cpu_thread_switches_total",
                 'python_gc_collections_total{generation="2"}'):
        assert name in text, name
    # The loaded model's objects were moved out of the collector's full collections (heap.settle).
    # The steps' thread count: the server's threads (or fewer, while a crowd is on the cores), or 0
    # where the count is fixed (one thread).
    threads = re.search(r"^pagewire_cpu_threads (\S+)$", text, re.M)
    assert threads is not None and 0 <= float(threads.group(1)) <= (os.cpu_count() or 1), threads
    frozen = re.search(r"^pagewire_gc_frozen_objects (\S+)$", text, re.M)
    assert frozen is not None and float(frozen.group(1)) > 10_000, frozen


def test_unknown_model_is_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_embeddings_from_a_generation_model_are_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="demo", input=["a", "b"])
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "model" and body["code"] == "not_embedding_model"
    assert body["message"].startswith("model: 'demo' is a text-generation model")


def test_http_idempotency_key_returns_the_original(server: ServerProcess) -> None:
    body = {"model": "demo", "prompt": "Once", "max_tokens": 6, "temperature": 1.0}
    headers = {"Idempotency-Key": "http-key-1"}
    a = httpx.post(server.base + "/v1/completions", json=body, headers=headers, timeout=60).json()
    b = httpx.post(server.base + "/v1/completions", json=body, headers=headers, timeout=60).json()
    assert a["id"] == b["id"] and a["choices"][0]["text"] == b["choices"][0]["text"]
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True},
                      headers=headers, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    import json

    assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines) == a["choices"][0]["text"]


def _wait_state(server: ServerProcess, rid: str, timeout: float = 300.0) -> str:
    """Poll the ledger until the row is terminal (the deadline only guards against a hang)."""
    import time

    from tests.server.harness import ledger_rows

    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = ledger_rows(server.db).get(rid, {}).get("state", "")
        if state not in ("", "queued", "running"):
            return state
        time.sleep(0.05)
    return state


def _running(server: ServerProcess) -> float:
    for line in httpx.get(server.base + "/metrics").text.splitlines():
        if line.startswith("pagewire_requests_running "):
            return float(line.split()[1])
    raise AssertionError("no pagewire_requests_running")


def test_client_disconnect_aborts_the_request_in_the_engine(server: ServerProcess) -> None:
    body = {"model": "demo", "prompt": "Forever", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    # The response is closed mid-stream: the engine drops the request at its next step.
    assert _wait_state(server, rid) == "cancelled"
    import time

    deadline = time.monotonic() + 300
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(server) == 0


def test_non_streamed_client_hang_up_cancels_too(server: ServerProcess) -> None:
    from tests.server.harness import hang_up_while_generating

    body = {"model": "demo", "prompt": "Forever again", "max_tokens": 1500, "ignore_eos": True}
    rid = hang_up_while_generating(server.base, "/v1/completions", body, {}, server.db, "gone-1")
    assert _wait_state(server, rid) == "cancelled"


def test_request_deadline_ends_it_with_504(server: ServerProcess) -> None:
    r = httpx.post(server.base + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": "Slow", "max_tokens": 1500, "ignore_eos": True, "timeout": 0.5})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"


def test_batched_prompts_equal_single_requests_streamed_and_not(client: openai.OpenAI) -> None:
    prompts = ["The train leaves", "Bread", "Tell me about the lighthouse"]
    singles = [client.completions.create(model="demo", prompt=p, max_tokens=8, temperature=0, n=2)
               for p in prompts]
    batch = client.completions.create(model="demo", prompt=prompts, max_tokens=8, temperature=0, n=2)
    # OpenAI numbers choices prompt_index * n + sample_index; usage is summed over prompts.
    assert sorted(c.index for c in batch.choices) == list(range(6))
    by_index = {c.index: c.text for c in batch.choices}
    for i, single in enumerate(singles):
        for c in single.choices:
            assert by_index[i * 2 + c.index] == c.text
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)

    stream = list(client.completions.create(model="demo", prompt=prompts, max_tokens=8, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == by_index
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == batch.usage.completion_tokens
    assert len({chunk.id for chunk in stream}) == 1  # one response id for the whole batch


def test_batched_token_id_prompts_and_bad_batches(server: ServerProcess, client: openai.OpenAI) -> None:
    ids = [httpx.post(server.base + "/tokenize", json={"prompt": p}).json()["tokens"] for p in ("Bread", "Rain")]
    out = client.completions.create(model="demo", prompt=ids, max_tokens=4, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    for bad in (["Bread", [1, 2]], [], ["x"] * 65):
        r = httpx.post(server.base + "/v1/completions", json={"model": "demo", "prompt": bad, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_refused_prompt_in_a_batch_is_named(server: ServerProcess) -> None:
    r = httpx.post(server.base + "/v1/completions", json={
        "model": "demo", "prompt": [[5, 6, 7], [5] * 3000], "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["message"].startswith("prompt[1] of 2:") and "3000" in err["message"]
