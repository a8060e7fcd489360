"""Ollama's API with the official `ollama` Python client against a live server.

References nobody here wrote: the client parses every response and every stream line, jsonschema
validates constrained answers and tool arguments, the safetensors library counts the model's
parameters, and the OpenAI edge (same spec, same engine) must give the same text for the same
conversation and the same sampling knobs under their OpenAI names, which is what shows that
`options` map onto the sampling fields they claim to.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.server.formats.conftest import FormatServer
from tests.server.harness import hang_up_while_generating, ledger_rows
from tests.server.test_tools_api import SEARCH_PARAMS, WEATHER_PARAMS

USER = [{"role": "user", "content": "What is the weather in Paris this week?"}]
LONG = [{"role": "user", "content": "Tell me a very long story"}]  # greedy: runs to num_predict (see the Anthropic tests)
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH_PARAMS}},
]


@pytest.fixture(scope="module")
def client(fmt_server: FormatServer) -> ollama.Client:
    return ollama.Client(host=fmt_server.base, headers=fmt_server.bearer(), timeout=300)


@pytest.fixture(scope="module")
def oa(fmt_server: FormatServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=fmt_server.base + "/v1", api_key=fmt_server.key, max_retries=0, timeout=300)


def _stream_lines(fmt_server: FormatServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", fmt_server.base + path, json=body, headers=fmt_server.bearer(), timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in r.iter_lines() if line]


def test_chat_whole_stream_and_openai_agree(client: ollama.Client, oa: openai.OpenAI, fmt_server: FormatServer) -> None:
    opts = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model="demo", messages=USER, options=opts)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    text = whole.message.content
    assert text
    chunks = list(client.chat(model="demo:latest", messages=USER, options=opts, stream=True))
    # At least one content line before the done line. How many depends on timing: the outbox
    # coalesces the deltas a busy writer has not sent yet (server/serving/outbox.py), and twelve
    # tokens of the demo model can all arrive before the first line is written.
    assert len(chunks) >= 2 and all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert any(c.message.content for c in chunks[:-1])
    assert "".join(c.message.content or "" for c in chunks) == text
    last = chunks[-1]
    assert last.eval_count == whole.eval_count and last.prompt_eval_count == whole.prompt_eval_count
    assert last.model == "demo:latest" and whole.model == "demo"  # the name the client used
    for r in (whole, last):
        assert r.total_duration == r.prompt_eval_duration + r.eval_duration and r.eval_duration > 0  # type: ignore[operator]

    chat = oa.chat.completions.create(model="demo", messages=USER, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == text
    assert chat.usage is not None and chat.usage.prompt_tokens == whole.prompt_eval_count
    assert chat.usage.completion_tokens == whole.eval_count

    lines = _stream_lines(fmt_server, "/api/chat", {"model": "demo", "messages": USER, "options": opts})
    assert lines[-1]["done"] is True and "created_at" in lines[-1]
    rows = [r for r in ledger_rows(fmt_server.db).values() if r["api"] == "ollama"]
    assert rows and all(r["state"] == "finished" for r in rows)
    assert {r["completion_tokens"] for r in rows} == {whole.eval_count}


def test_generate_templated_and_raw(client: ollama.Client, oa: openai.OpenAI) -> None:
    opts = {"temperature": 0, "num_predict": 10}
    gen = client.generate(model="demo", prompt="Say hello", system="Be kind.", options=opts)
    chat = client.chat(model="demo", options=opts, messages=[{"role": "system", "content": "Be kind."},
                                                              {"role": "user", "content": "Say hello"}])
    assert gen.response == chat.message.content and gen.prompt_eval_count == chat.prompt_eval_count
    streamed = "".join(c.response or "" for c in client.generate(model="demo", prompt="Say hello", system="Be kind.",
                                                                 options=opts, stream=True))
    assert streamed == gen.response

    raw = client.generate(model="demo", prompt="Once upon a time", raw=True, options=opts)
    comp = oa.completions.create(model="demo", prompt="Once upon a time", temperature=0, max_tokens=10)
    assert raw.response == comp.choices[0].text and comp.usage is not None
    assert raw.prompt_eval_count == comp.usage.prompt_tokens


def test_options_map_to_the_sampling_fields(client: ollama.Client, oa: openai.OpenAI) -> None:
    opts = {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.01, "repeat_penalty": 1.3,
            "presence_penalty": 0.2, "frequency_penalty": 0.1, "seed": 3, "num_predict": 16,
            # accepted without effect: load settings and the penalty window, neutral values
            "num_ctx": 4096, "num_thread": 2, "repeat_last_n": 64, "mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
    a = client.chat(model="demo", messages=USER, options=opts)
    b = client.chat(model="demo", messages=USER, options=opts)
    assert a.message.content == b.message.content  # seeded
    ref = oa.chat.completions.create(model="demo", messages=USER, temperature=0.8, top_p=0.9, seed=3,  # type: ignore[arg-type]
                                     presence_penalty=0.2, frequency_penalty=0.1, max_tokens=16,
                                     extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.3})
    assert ref.choices[0].message.content == a.message.content

    greedy = {"temperature": 0, "num_predict": 24}
    text = client.chat(model="demo", messages=USER, options=greedy).message.content or ""
    words = [w for w in text.split() if len(w) >= 3 and w.isalpha()]
    stop = next(w for w in words if text.find(w) >= 4)
    cut = client.chat(model="demo", messages=USER, options={**greedy, "stop": [stop]})
    assert cut.message.content == text[: text.find(stop)] and cut.done_reason == "stop"
    long = client.chat(model="demo", messages=LONG, options={"temperature": 0, "num_predict": 5})
    assert long.done_reason == "length" and long.eval_count == 5


def test_logprobs_match_the_openai_edge(client: ollama.Client, oa: openai.OpenAI) -> None:
    opts = {"temperature": 0, "num_predict": 6}
    r = client.chat(model="demo", messages=USER, options=opts, logprobs=True, top_logprobs=3)
    ref = oa.chat.completions.create(model="demo", messages=USER, temperature=0, max_tokens=6,  # type: ignore[arg-type]
                                     logprobs=True, top_logprobs=3)
    assert r.logprobs is not None and ref.choices[0].logprobs is not None
    mine = [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs or []]) for lp in r.logprobs]
    theirs = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
              for c in ref.choices[0].logprobs.content or []]
    assert len(mine) == 6 and [m[0] for m in mine] == [t[0] for t in theirs]
    for (_, lp, top), (_, ref_lp, ref_top) in zip(mine, theirs):
        assert lp == pytest.approx(ref_lp, abs=1e-4) and [t for t, _ in top] == [t for t, _ in ref_top]
    streamed = [lp for ch in client.chat(model="demo", messages=USER, options=opts, logprobs=True, top_logprobs=3,
                                         stream=True) for lp in (ch.logprobs or [])]
    assert [lp.token for lp in streamed] == [m[0] for m in mine]
    gen = client.generate(model="demo", prompt="Once", raw=True, options=opts, logprobs=True)
    assert gen.logprobs is not None and len(gen.logprobs) == 6 and not gen.logprobs[0].top_logprobs


def test_format_json_and_schema(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    opts = {"temperature": 1.0, "seed": 4, "num_predict": 80}
    whole = client.chat(model="demo", messages=USER, format=schema, options=opts)
    jsonschema.validate(json.loads(whole.message.content or ""), schema)
    streamed = "".join(c.message.content or "" for c in client.chat(model="demo", messages=USER, format=schema,
                                                                    options=opts, stream=True))
    assert streamed == whole.message.content
    gen = client.generate(model="demo", prompt="A JSON object please", format=schema, options=opts)
    jsonschema.validate(json.loads(gen.response or ""), schema)
    # "json": any JSON object (the random model may be cut by num_predict, so give it room)
    free = client.chat(model="demo", messages=USER, format="json", options={"temperature": 0, "num_predict": 400})
    if free.done_reason == "stop":
        assert isinstance(json.loads(free.message.content or ""), dict)
    else:
        assert (free.message.content or "").lstrip().startswith("{")


def _ollama_tools_json(tools: list[dict[str, Any]]) -> Any:
    """The tools as the ollama client puts them on the wire (it re-models them)."""
    from ollama._types import ChatRequest, Tool

    return ChatRequest(model="demo", tools=[Tool.model_validate(t) for t in tools]).model_dump(exclude_none=True)["tools"]


def test_tools_call_and_result(client: ollama.Client, fmt_server: FormatServer) -> None:
    # Auto mode reads the model's own calls (the server parses llama3_json: {"name", "parameters"}).
    # A schema makes the random model write exactly such a call; the client gets it as tool_calls.
    call_schema = {"type": "object", "properties": {"name": {"type": "string", "enum": ["search"]},
                                                    "parameters": SEARCH_PARAMS},
                   "required": ["name", "parameters"], "additionalProperties": False}
    opts = {"temperature": 1.0, "seed": 9, "num_predict": 200}
    whole = client.chat(model="demo", messages=USER, tools=TOOLS, format=call_schema, options=opts)
    calls = whole.message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "search" and whole.done_reason == "stop"
    jsonschema.validate(dict(calls[0].function.arguments), SEARCH_PARAMS)
    assert not whole.message.content
    chunks = list(client.chat(model="demo", messages=USER, tools=TOOLS, format=call_schema, options=opts, stream=True))
    streamed = [c for ch in chunks for c in (ch.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(calls[0].function.name, dict(calls[0].function.arguments))]

    result = json.dumps({"hits": 3})
    convo: list[Any] = [*USER, {"role": "assistant", "content": "",
                                "tool_calls": [{"function": {"name": "search", "arguments": dict(calls[0].function.arguments)}}]},
                        {"role": "tool", "content": result, "tool_name": "search"}]
    second = client.chat(model="demo", messages=convo, tools=TOOLS, options={"temperature": 0, "num_predict": 6})
    assert second.done and second.message.role == "assistant"
    oa_convo = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "search", "arguments": json.dumps(dict(calls[0].function.arguments))}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": result}]
    tok = httpx.post(fmt_server.base + "/tokenize", headers=fmt_server.bearer(),
                     json={"messages": oa_convo, "tools": _ollama_tools_json(TOOLS)}).json()
    assert second.prompt_eval_count == tok["count"]


def test_tags_show_ps_version(client: ollama.Client, fmt_server: FormatServer) -> None:
    from safetensors import safe_open

    model_dir = Path(fmt_server.proc.model_dir)  # type: ignore[arg-type]
    files = sorted(model_dir.glob("*.safetensors"))
    params = 0
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                params += n
    listed = client.list().models
    assert len(listed) == 1 and listed[0].model == "demo:latest"
    m = listed[0]
    assert m.size == sum(f.stat().st_size for f in files) and m.digest and len(m.digest) == 64
    assert m.details is not None and m.details.format == "safetensors" and m.details.family == "llama"
    assert m.details.quantization_level == "F32"

    max_len = httpx.get(fmt_server.base + "/v1/models", headers=fmt_server.bearer()).json()["data"][0]["max_model_len"]
    for name in ("demo", "demo:latest"):
        shown = client.show(name)
        assert shown.modelinfo is not None and shown.modelinfo["general.parameter_count"] == params
        assert shown.modelinfo["llama.context_length"] == max_len
        assert shown.capabilities is not None and "completion" in shown.capabilities and "tools" in shown.capabilities
        assert shown.template and "tools" in shown.template
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3")
    assert e.value.status_code == 404 and "llama3" in e.value.error

    running = client.ps().models
    assert len(running) == 1 and running[0].model == "demo:latest" and running[0].context_length == max_len
    assert running[0].expires_at is not None and running[0].expires_at.year > 2100  # never unloads
    version = httpx.get(fmt_server.base + "/api/version", headers=fmt_server.bearer()).json()["version"]
    assert all(p.isdigit() for p in version.split("."))


def test_embed_is_refused_naming_the_model(client: ollama.Client, fmt_server: FormatServer) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="demo", input=["a", "b"])
    assert e.value.status_code == 400 and e.value.error.startswith("model:") and "not an embedding model" in e.value.error
    r = httpx.post(fmt_server.base + "/api/embed", json={"model": "demo", "input": 5}, headers=fmt_server.bearer())
    assert r.status_code == 400 and r.json()["error"].startswith("input:")
    r = httpx.post(fmt_server.base + "/api/embeddings", json={"model": "demo", "prompt": "x"}, headers=fmt_server.bearer())
    assert r.status_code == 400 and "not an embedding model" in r.json()["error"]


def test_keep_alive_and_load_requests(client: ollama.Client) -> None:
    ok = client.chat(model="demo", messages=USER, keep_alive="5m", options={"num_predict": 2})
    assert ok.done and ok.eval_count == 2
    assert client.chat(model="demo", messages=USER, keep_alive=-1, options={"num_predict": 1}).done
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="demo", messages=USER, keep_alive="soon")
    assert e.value.status_code == 400 and e.value.error.startswith("keep_alive:")
    loaded = client.chat(model="demo", messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    assert client.generate(model="demo", keep_alive=0).done_reason == "unload"
    assert client.generate(model="demo").done_reason == "load"


def test_disconnect_cancels_the_request(fmt_server: FormatServer) -> None:
    body = {"model": "demo", "messages": LONG, "options": {"temperature": 0, "num_predict": 1500}}
    with httpx.stream("POST", fmt_server.base + "/api/chat", json=body, headers=fmt_server.bearer(), timeout=300) as r:
        rid = r.headers["x-request-id"]
        first = json.loads(next(r.iter_lines()))
        assert first["done"] is False
    assert fmt_server.wait_state(rid) == "cancelled"
    assert fmt_server.wait_idle() == 0
    rid = hang_up_while_generating(fmt_server.base, "/api/generate",
                                   {"model": "demo", "prompt": LONG[0]["content"], "stream": False,
                                    "options": body["options"]},
                                   fmt_server.bearer(), fmt_server.db, "ollama-gone")
    assert fmt_server.wait_state(rid) == "cancelled"


def test_quota_429_in_ollamas_shape(fmt_server: FormatServer) -> None:
    tight = ollama.Client(host=fmt_server.base, headers=fmt_server.bearer(fmt_server.tight))
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            out = tight.chat(model="demo", messages=USER, options={"num_predict": 200}, stream=stream)
            if stream:
                list(out)  # type: ignore[arg-type]
        assert e.value.status_code == 429 and "daily" in e.value.error
    r = httpx.post(fmt_server.base + "/api/generate", json={"model": "demo", "prompt": "x", "options": {"num_predict": 99}},
                   headers=fmt_server.bearer(fmt_server.tight))
    assert r.status_code == 429 and isinstance(r.json()["error"], str) and int(r.headers["retry-after"]) > 0


def test_auth_in_ollamas_shape(fmt_server: FormatServer) -> None:
    for path in ("/api/tags", "/api/version", "/api/ps"):
        r = httpx.get(fmt_server.base + path)
        assert r.status_code == 401 and isinstance(r.json()["error"], str), path
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=fmt_server.base).chat(model="demo", messages=USER)
    assert e.value.status_code == 401
    r = httpx.get(fmt_server.base + "/api/pull", headers=fmt_server.bearer())
    assert r.status_code == 404 and isinstance(r.json()["error"], str)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("/api/chat", {"messages": USER}, "model"),
    ("/api/chat", {"model": "demo", "messages": [{"content": "x"}]}, "messages[0].role"),
    ("/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "messages[0].images"),
    ("/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
     "messages[0].tool_calls"),
    ("/api/chat", {"model": "demo", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
                                                 *USER]}, "messages[0].tool_calls[0].function.name"),
    ("/api/chat", {"model": "demo", "messages": USER, "options": {"temperature": -1}}, "options.temperature"),
    ("/api/chat", {"model": "demo", "messages": USER, "options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/chat", {"model": "demo", "messages": USER, "options": {"num_predict": 4000}}, "options.num_predict"),
    ("/api/chat", {"model": "demo", "messages": USER, "options": {"mirostat": 2}}, "options.mirostat"),
    ("/api/chat", {"model": "demo", "messages": USER, "options": {"typical_p": 0.5}}, "options.typical_p"),
    ("/api/chat", {"model": "demo", "messages": USER, "options": {"stop": 5}}, "options.stop"),
    ("/api/chat", {"model": "demo", "messages": USER, "options": {"stop": ["", "x"]}}, "options.stop"),
    ("/api/generate", {"model": "demo", "prompt": "x", "options": {"top_p": 0}}, "options.top_p"),
    ("/api/chat", {"model": "demo", "messages": USER, "format": "xml"}, "format"),
    ("/api/chat", {"model": "demo", "messages": USER, "format": {"type": "wrong"}}, "format"),
    ("/api/chat", {"model": "demo", "messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("/api/chat", {"model": "demo", "messages": USER, "think": True}, "think"),
    ("/api/chat", {"model": "demo", "messages": USER, "stream": "yes"}, "stream"),
    ("/api/generate", {"model": "demo", "prompt": "x", "suffix": "y"}, "suffix"),
    ("/api/generate", {"model": "demo", "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"model": "demo", "prompt": "x", "context": [1, 2]}, "context"),
    ("/api/generate", {"model": "demo", "prompt": "x", "raw": True, "system": "s"}, "system"),
    ("/api/generate", {"model": "demo", "prompt": 7}, "prompt"),
    ("/api/generate", {"model": "demo", "prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/api/chat", {"model": "demo", "messages": USER, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("/api/show", {}, "model"),
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{p}:{f}" for p, _, f in BAD])
def test_bad_input_is_400_naming_the_field(fmt_server: FormatServer, path: str, body: dict[str, Any],
                                           field: str) -> None:
    r = httpx.post(fmt_server.base + path, json=body, headers=fmt_server.bearer(), timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(field + ":"), r.json()


def test_unknown_model_and_oversized_body(fmt_server: FormatServer) -> None:
    r = httpx.post(fmt_server.base + "/api/chat", json={"model": "llama3:8b", "messages": USER},
                   headers=fmt_server.bearer())
    assert r.status_code == 404 and r.json() == {"error": "model 'llama3:8b' not found; this server serves 'demo:latest'"}
    r = httpx.post(fmt_server.base + "/api/chat", content=b"{" + b" " * 70000 + b"}", headers=fmt_server.bearer())
    assert r.status_code == 413 and isinstance(r.json()["error"], str)
