"""Serving benchmark: an async load generator that measures request throughput, output tokens/s,
TTFT, ITL and end-to-end latency of OpenAI-compatible servers.

Point it at one or more servers (pagewire, vLLM, llama.cpp's llama-server, ...); they are measured
one after another with the same workload, and a comparison table is printed at the end.

Transport (--mode): `sse` streams /v1/completions (or /v1/chat/completions with --endpoint chat)
over HTTP; `ws` multiplexes every request over one connection to pagewire's WebSocket API at
/v1/ws (frames `generate` -> `accepted`, `delta`*, `done` | `error`; see docs/websocket.md).

Load: --concurrency N keeps at most N requests in flight; --request-rate R sends requests at
Poisson arrivals of mean rate R/s (combined with --concurrency, it also caps the in-flight count).

Workload: prompts of --input-len tokens and --output-len output tokens (ignore_eos, greedy), fixed
or, with --random-range-ratio r, uniform in [len*(1-r), len*(1+r)]. Prompts are random words
calibrated to the target token count with the server's /tokenize (vLLM's and llama.cpp's shapes
are both understood; without one, ~1.3 tokens per word is assumed), or random token-id arrays
(--prompt-format token-ids; /v1/completions and pagewire's WebSocket accept them).

Metrics, over the requests that completed:
  * TTFT: from sending the request to the arrival of the first non-empty content delta.
  * ITL: gaps between arrivals of consecutive non-empty content deltas of one request (one gap
    per streamed chunk, pooled over all requests; a chunk may carry several tokens when the server
    coalesces). max ITL is the longest stall any stream saw.
  * TPOT: per request, (E2E - TTFT) / (output tokens - 1).
  * E2E: from sending the request to its last byte.
  * output tokens: the server's usage.completion_tokens when reported, else counted from deltas.
  Throughputs divide by the wall time from the first request sent to the last one finished.

--model PATH (a Hugging Face folder, a .gguf file, or "default" for SmolLM2-135M-Instruct) starts
`pagewire serve PATH` on a free port for the run (extra options with --serve-arg), reports how
long it took to become healthy (model load, GGUF dequantisation included), benchmarks it, and stops
it. Without a path, --model is the model name to send.

Example (the default real model at concurrency 8):
    .venv/bin/python bench/serving.py --model default --serve-arg=--dtype=bfloat16 --mode sse \
        --input-len 128 --output-len 128 --concurrency 8 --num-requests 16

Example (the issue's target workload against a local pagewire):
    .venv/bin/python bench/serving.py --base-url http://127.0.0.1:8000 --mode sse \
        --input-len 256 --output-len 128 --concurrency 8 --num-requests 16
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import httpx

# Common English words: the raw material of text prompts (their token counts are calibrated).
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter mother "
    "answer found study still learn should river garden market winter train bread mountain library clock tea"
).split()
FIRST_REGULAR_TOKEN = 16  # token-id prompts stay clear of special tokens
DEFAULT_TOKENS_PER_WORD = 1.3

Prompt = Union[str, list[int]]


@dataclass
class RequestSpec:
    prompt: Prompt
    prompt_len: int  # tokens, as measured by the server's /tokenize (or estimated)
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    requested_output_len: int = 0
    output_tokens: int = 0
    token_count_source: str = ""  # "usage" | "token_ids" | "chunks"
    start: float = 0.0  # perf_counter at send
    ttft: float = math.nan
    e2e: float = math.nan
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty content delta

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def root_url(base_url: str) -> str:
    """Server root from a base URL given with or without a trailing /v1."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# -- workload -----------------------------------------------------------------------------------
def workload_lengths(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(input_len, output_len) per request, from --seed only (identical for every server)."""
    rng = random.Random(args.seed)
    r = args.random_range_ratio

    def draw(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - r)), math.ceil(n * (1 + r)))) if r > 0 else n

    return [(draw(args.input_len), draw(args.output_len)) for _ in range(args.num_requests + args.num_warmups)]


class TokenCounter:
    """Counts prompt tokens with the server's /tokenize, trying vLLM's (and pagewire's) request shape, then llama.cpp's."""

    def __init__(self, client: httpx.AsyncClient, root: str, model: str) -> None:
        self.client, self.root, self.model = client, root, model
        self.style: Optional[str] = None  # "vllm" | "llama.cpp" | "estimate", found on first use

    async def count(self, text: str) -> int:
        styles = [self.style] if self.style else ["vllm", "llama.cpp"]
        for style in styles:
            if style == "estimate":
                break
            body = {"model": self.model, "prompt": text} if style == "vllm" else {"content": text}
            try:
                resp = await self.client.post(f"{self.root}/tokenize", json=body)
                if resp.status_code == 200:
                    data = resp.json()
                    n = data.get("count", len(data.get("tokens", [])) if "tokens" in data else None)
                    if isinstance(n, int):
                        self.style = style
                        return n
            except (httpx.HTTPError, ValueError):
                pass
        self.style = "estimate"
        return round(len(text.split()) * DEFAULT_TOKENS_PER_WORD)


async def make_text_prompt(counter: TokenCounter, rng: random.Random, target: int) -> tuple[str, int]:
    """Random words adjusted until the server counts `target` tokens (or the closest reachable)."""
    words = rng.choices(WORDS, k=max(1, round(target / DEFAULT_TOKENS_PER_WORD)))
    best: tuple[int, list[str], int] = (10**9, words, 0)
    for _ in range(16):
        n = await counter.count(" ".join(words))
        if abs(n - target) < best[0]:
            best = (abs(n - target), list(words), n)
        if n == target or counter.style == "estimate":
            break
        per_word = max(n / len(words), 0.5)
        step = max(1, int(abs(target - n) / per_word))
        if n < target:
            words += rng.choices(WORDS, k=step)
        elif len(words) > 1:
            del words[-min(step, len(words) - 1):]
        else:
            break
    return " ".join(best[1]), best[2]


async def make_requests(args: argparse.Namespace, client: httpx.AsyncClient, root: str, model: str
                        ) -> tuple[list[RequestSpec], str]:
    """The workload's prompts for one server; returns them and how prompt lengths were measured."""
    rng = random.Random(args.seed + 1)
    specs: list[RequestSpec] = []
    if args.prompt_format == "token-ids":
        for in_len, out_len in workload_lengths(args):
            ids = [rng.randrange(FIRST_REGULAR_TOKEN, args.vocab_size) for _ in range(in_len)]
            specs.append(RequestSpec(ids, in_len, out_len))
        return specs, "exact (token ids)"
    counter = TokenCounter(client, root, model)
    for in_len, out_len in workload_lengths(args):
        text, n = await make_text_prompt(counter, rng, in_len)
        specs.append(RequestSpec(text, n, out_len))
    how = {"vllm": "/tokenize", "llama.cpp": "/tokenize (llama.cpp)", "estimate": "estimated, no /tokenize"}
    return specs, how.get(counter.style or "estimate", "?")


# -- transports ---------------------------------------------------------------------------------
def sampling_fields(args: argparse.Namespace, spec: RequestSpec) -> dict[str, Any]:
    return {"max_tokens": spec.output_len, "temperature": args.temperature, "ignore_eos": args.ignore_eos}


async def sse_request(args: argparse.Namespace, client: httpx.AsyncClient, root: str, model: str,
                      spec: RequestSpec) -> RequestResult:
    res = RequestResult(prompt_len=spec.prompt_len, requested_output_len=spec.output_len)
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            **sampling_fields(args, spec)}
    if args.endpoint == "chat":
        url = f"{root}/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        url = f"{root}/v1/completions"
        body["prompt"] = spec.prompt
    usage_tokens: Optional[int] = None
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return res
                if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                    usage_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") if args.endpoint != "chat" else (choice.get("delta") or {}).get("content")
                    if text:
                        res.chunk_times.append(now)
                        break
        end = time.perf_counter()
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    return finish(res, end, usage_tokens, None)


def finish(res: RequestResult, end: float, usage_tokens: Optional[int], counted_ids: Optional[int]) -> RequestResult:
    if not res.chunk_times:
        res.error = "no content was streamed"
        return res
    res.ok = True
    res.ttft = res.chunk_times[0] - res.start
    res.e2e = end - res.start
    if usage_tokens is not None:
        res.output_tokens, res.token_count_source = usage_tokens, "usage"
    elif counted_ids is not None:
        res.output_tokens, res.token_count_source = counted_ids, "token_ids"
    else:
        res.output_tokens, res.token_count_source = len(res.chunk_times), "chunks"
    return res


class WsMux:
    """Many requests over one WebSocket. A reader task timestamps each frame on arrival and routes it by `id`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.queues: dict[str, asyncio.Queue[tuple[float, dict[str, Any]]]] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                now = time.perf_counter()
                frame = json.loads(raw)
                q = self.queues.get(frame.get("id"))
                targets = [q] if q is not None else (list(self.queues.values()) if frame.get("type") == "error" else [])
                for target in targets:  # an error frame without a known id fails every waiter
                    target.put_nowait((now, frame))
        finally:
            closed = {"type": "error", "code": "connection_closed", "message": "WebSocket closed"}
            for q in self.queues.values():
                q.put_nowait((time.perf_counter(), closed))

    async def request(self, args: argparse.Namespace, rid: str, spec: RequestSpec) -> RequestResult:
        res = RequestResult(prompt_len=spec.prompt_len, requested_output_len=spec.output_len)
        # Register before sending: the reply may arrive before `send` returns to us.
        q = self.queues[rid] = asyncio.Queue()
        frame = {"type": "generate", "id": rid, "kind": "completion" if args.endpoint != "chat" else "chat",
                 "params": sampling_fields(args, spec)}
        if args.endpoint == "chat":
            frame["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            frame["prompt"] = spec.prompt
        res.start = time.perf_counter()
        try:
            await self.ws.send(json.dumps(frame))
            ids = 0
            while True:
                now, msg = await asyncio.wait_for(q.get(), args.request_timeout)
                kind = msg.get("type")
                if kind == "delta":
                    ids += len(msg.get("token_ids") or [])
                    if msg.get("text"):
                        res.chunk_times.append(now)
                elif kind == "done":
                    usage = (msg.get("usage") or {}).get("completion_tokens")
                    return finish(res, now, usage, ids)
                elif kind == "error":
                    res.error = f"{msg.get('code')}: {msg.get('message')}"
                    return res
        except Exception as exc:  # timeout, or the socket closed under us (websockets.ConnectionClosed)
            res.error = f"{type(exc).__name__}: {exc}"
            return res
        finally:
            self.queues.pop(rid, None)

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(Exception):
            await self.reader


class CpuWatch:
    """Splits the machine's busy CPU during a run into server, this client, and everything else.

    The server's process is found by the port it listens on, so this only works for a server on
    this machine; otherwise the server's share is counted under "other".
    """

    def __init__(self, root: str) -> None:
        from urllib.parse import urlsplit

        import psutil

        self.psutil = psutil
        self.server: Optional[Any] = None
        port = urlsplit(root).port or (443 if root.startswith("https") else 80)
        with contextlib.suppress(Exception):
            for conn in psutil.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                    self.server = psutil.Process(conn.pid)
                    break
        self.me = psutil.Process()

    def _sample(self) -> tuple[float, float, float, float]:
        t = self.psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        server = 0.0
        if self.server is not None:
            with contextlib.suppress(Exception):
                c = self.server.cpu_times()
                server = c.user + c.system
        c = self.me.cpu_times()
        return time.perf_counter(), busy, server, c.user + c.system

    def start(self) -> None:
        self.t0 = self._sample()

    def stop(self) -> dict[str, Any]:
        t1 = self._sample()
        wall, busy, server, client = (b - a for a, b in zip(self.t0, t1))
        capacity = wall * (self.psutil.cpu_count() or 1) / 100.0
        return {"server_pid": self.server.pid if self.server is not None else None,
                "server_cpu_pct": server / capacity if self.server is not None else None,
                "client_cpu_pct": client / capacity,
                "other_cpu_pct": max(0.0, busy - server - client) / capacity,
                "load_avg_end": list(os.getloadavg())}


# -- load ---------------------------------------------------------------------------------------
async def run_load(args: argparse.Namespace, send: Any, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    """Send every spec under the chosen load; returns results in spec order and the wall time."""
    from tqdm.asyncio import tqdm

    rng = random.Random(args.seed + 2)
    sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    bar = tqdm(total=len(specs), desc="requests", disable=args.no_progress, file=sys.stderr)

    async def one(i: int) -> RequestResult:
        async with sem if sem is not None else contextlib.nullcontext():
            res = await send(i, specs[i])
        bar.update(1)
        return res

    t0 = time.perf_counter()
    tasks = []
    for i in range(len(specs)):
        if args.request_rate != math.inf and i > 0:
            await asyncio.sleep(rng.expovariate(args.request_rate))
        tasks.append(asyncio.create_task(one(i)))
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    bar.close()
    return list(results), elapsed


async def bench_server(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    root = root_url(base_url)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        model = args.model
        if model is None:
            resp = await client.get(f"{root}/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        log(f"{root}: model {model!r}; preparing {args.num_requests} prompts")
        specs, prompt_len_source = await make_requests(args, client, root, model)
        warmups, specs = specs[:args.num_warmups], specs[args.num_warmups:]
        mux: Optional[WsMux] = None
        if args.mode == "ws":
            import websockets

            ws_url = root.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/v1/ws"
            mux = WsMux(await websockets.connect(ws_url, max_size=None, ping_interval=None,
                                                 additional_headers=headers or None))

            async def send(i: int, spec: RequestSpec) -> RequestResult:
                return await mux.request(args, f"r{i}", spec)
        else:
            async def send(i: int, spec: RequestSpec) -> RequestResult:
                return await sse_request(args, client, root, model, spec)
        try:
            for k, spec in enumerate(warmups):
                res = await send(-1 - k, spec)
                log(f"warm-up request: {'ok' if res.ok else 'FAILED ' + res.error} ({res.e2e:.2f} s)")
            log(f"{root}: {args.mode} benchmark, {load_label(args)}")
            watch = CpuWatch(root)
            watch.start()
            results, elapsed = await run_load(args, send, specs)
            cpu = watch.stop()
        finally:
            if mux is not None:
                await mux.close()
    return {"base_url": base_url, "model": model, "mode": args.mode, "endpoint": args.endpoint,
            "prompt_len_source": prompt_len_source, "summary": {**summarize(results, elapsed), "cpu": cpu},
            "requests": [dict(asdict(r), itls=r.itls) for r in results]}


# -- report -------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: list[float], scale: float = 1.0) -> dict[str, float]:
    v = [x * scale for x in values]
    return {"mean": sum(v) / len(v) if v else math.nan, "p50": percentile(v, 50), "p99": percentile(v, 99),
            "max": max(v) if v else math.nan}


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "duration_s": elapsed,
        "prompt_tokens": sum(r.prompt_len for r in ok), "output_tokens": out_tokens,
        "requested_output_tokens": sum(r.requested_output_len for r in ok),
        "request_throughput": len(ok) / elapsed, "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + sum(r.prompt_len for r in ok)) / elapsed,
        "ttft_ms": stats([r.ttft for r in ok], 1e3),
        "itl_ms": stats([x for r in ok for x in r.itls], 1e3),
        "tpot_ms": stats([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1], 1e3),
        "e2e_s": stats([r.e2e for r in ok]),
        "token_count_sources": sorted({r.token_count_source for r in ok}),
    }


def load_label(args: argparse.Namespace) -> str:
    rate = "all at once" if args.request_rate == math.inf else f"Poisson {args.request_rate}/s"
    conc = f"concurrency {args.concurrency}" if args.concurrency else "unbounded concurrency"
    lens = f"input {args.input_len}, output {args.output_len}"
    if args.random_range_ratio:
        lens += f" (±{args.random_range_ratio:.0%})"
    return f"{args.num_requests} requests, {conc}, {rate}, {lens}, ignore_eos={args.ignore_eos}"


METRIC_ROWS = [
    ("completed / failed", lambda s: f"{s['completed']} / {s['failed']}"),
    ("duration s", lambda s: f"{s['duration_s']:.1f}"),
    ("request throughput req/s", lambda s: f"{s['request_throughput']:.2f}"),
    ("output tok/s", lambda s: f"{s['output_tok_s']:.1f}"),
    ("total tok/s (prompt + output)", lambda s: f"{s['total_tok_s']:.1f}"),
    ("CPU % of machine: server / client / other processes", lambda s: " / ".join(
        "?" if s["cpu"][k] is None else f"{s['cpu'][k]:.0f}" for k in ("server_cpu_pct", "client_cpu_pct", "other_cpu_pct"))),
] + [
    (f"{name} {stat} {unit}", (lambda key, stat, digits: lambda s: f"{s[key][stat]:.{digits}f}")(key, stat, digits))
    for name, key, unit, digits in (("TTFT", "ttft_ms", "ms", 0), ("ITL", "itl_ms", "ms", 1),
                                    ("TPOT", "tpot_ms", "ms", 1), ("E2E", "e2e_s", "s", 2))
    for stat in ("mean", "p50", "p99", "max") if not (stat == "max" and key in ("tpot_ms",))
]


def report_table(servers: list[dict[str, Any]]) -> str:
    head = "| metric | " + " | ".join(f"{s['base_url']} ({s['mode']})" for s in servers) + " |"
    lines = [head, "|---" * (len(servers) + 1) + "|"]
    for label, fmt in METRIC_ROWS:
        cells = [fmt(s["summary"]) if "summary" in s else "–" for s in servers]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", default=[],
                   help="server root, e.g. http://127.0.0.1:8000 (repeatable or comma-separated)")
    p.add_argument("--mode", choices=["sse", "ws"], default="sse")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first of /v1/models); or a model folder, .gguf file "
                        "or 'default' to start a pagewire server on it for this run")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `pagewire serve` argument with --model PATH (repeatable, e.g. --serve-arg=--dtype=bfloat16)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--num-warmups", type=int, default=1, help="untimed requests sent one by one before the run")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default 8 without --request-rate)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate, requests/s")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--prompt-format", choices=["text", "token-ids"], default="text")
    p.add_argument("--vocab-size", type=int, default=32000, help="id range for --prompt-format token-ids")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    args.base_url = [u.strip() for item in args.base_url for u in item.split(",") if u.strip()]
    launching = args.model is not None and (args.model == "default" or Path(args.model).exists())
    if not args.base_url and not launching:
        args.base_url = ["http://127.0.0.1:8000"]
    if args.concurrency is None and args.request_rate == math.inf:
        args.concurrency = 8
    if args.prompt_format == "token-ids" and args.endpoint == "chat":
        p.error("--prompt-format token-ids needs --endpoint completions")
    if not 0 <= args.random_range_ratio < 1:
        p.error("--random-range-ratio must be in [0, 1)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, __file__, *argv])
    print(f"command: {command}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"workload: {load_label(args)}, prompts as {args.prompt_format}, {args.mode} {args.endpoint}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"note: prompts derive from --seed {args.seed}; a server with prefix caching serves a repeated prompt "
          "from cache, so use a new --seed for each run against the same server process")
    servers: list[dict[str, Any]] = []
    launched = launch_model_server(args)
    try:
        _bench_all(args, servers)
    finally:
        if launched is not None:
            launched.terminate()
            launched.wait(60)
    return _report(args, command, servers)


def launch_model_server(args: argparse.Namespace) -> Any:
    """With --model naming a path (or 'default'), start `pagewire serve` on it and add its URL."""
    import socket
    import subprocess

    if args.model is None or (args.model != "default" and not Path(args.model).exists()):
        return None
    model = [] if args.model == "default" else [args.model]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "server.cli", "serve", *model, "--port", str(port), *args.serve_arg]
    log(f"starting: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"pagewire serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    print(f"pagewire serve {args.model}: healthy after {time.perf_counter() - t0:.1f} s (process start + model load)")
    args.base_url.append(url)
    args.model = None
    return proc


def _bench_all(args: argparse.Namespace, servers: list[dict[str, Any]]) -> None:
    for url in args.base_url:
        try:
            servers.append(asyncio.run(bench_server(args, url)))
        except Exception as exc:  # one unreachable server must not lose the others' results
            log(f"{url}: FAILED: {type(exc).__name__}: {exc}")
            servers.append({"base_url": url, "mode": args.mode, "error": f"{type(exc).__name__}: {exc}"})


def _report(args: argparse.Namespace, command: str, servers: list[dict[str, Any]]) -> int:
    for s in servers:
        if "summary" not in s:
            continue
        sm = s["summary"]
        print(f"\n{s['base_url']} model={s['model']!r} prompt lengths: {s['prompt_len_source']}, "
              f"output tokens from: {', '.join(sm['token_count_sources']) or '–'}")
        if sm["output_tokens"] != sm["requested_output_tokens"]:
            print(f"  note: {sm['output_tokens']} output tokens for {sm['requested_output_tokens']} requested")
        for err, n in sm["errors"].items():
            print(f"  {n} failed: {err}")
    print()
    print(report_table(servers))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": command, "args": {k: str(v) for k, v in vars(args).items()}, "servers": servers}
        args.json_out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if servers and all(s.get("summary", {}).get("completed") for s in servers) else 1


if __name__ == "__main__":
    sys.exit(main())
