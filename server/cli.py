"""The `pagewire` command: `serve` runs the server; `requests list|show` reads the ledger;
`keys …` and `usage` are the gateway's (server.gateway.cli); `plan` sizes a deployment
(server.engine.plan); `batch submit` sends a batch file to a running server.

Everything here is torch-free until `serve` actually starts the engine (or builds the demo model),
so `pagewire requests …` and `pagewire --help` are instant.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from server.serving.db_url import DbSpecError, DbTarget
from server.serving.settings import ServeSettings, add_serve_arguments, default_db_path, settings_from_args

DEMO_BANNER = """\
============================================================================
 pagewire is serving its built-in DEMO model (--demo-model): a tiny Llama with
 RANDOM weights. Its output is gibberish by design. Drop --demo-model to serve
 SmolLM2-135M-Instruct, or pass a model:
     pagewire serve /path/to/model            (Hugging Face folder)
     pagewire serve /path/to/model.gguf       (GGUF file)
============================================================================"""

DEFAULT_BANNER = """\
============================================================================
 pagewire is serving its default model: {name}
 Licence: {licence}. Source: {source}
 Weights: {path}
 Pass a Hugging Face folder or a .gguf file to serve another model.
============================================================================"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagewire", description="One-process LLM inference server.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API) and WebSocket",
                           description="Every option can also be set by its PAGEWIRE_* environment variable.")
    add_serve_arguments(serve)
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="a TOML file of serve options (long names with underscores; [[models]] tables with "
                            "name and path); flags and PAGEWIRE_* variables override it [env PAGEWIRE_CONFIG]")
    serve.add_argument("--print-config", action="store_true",
                       help="print every option's effective value and where it came from, then exit")
    req = sub.add_parser("requests", help="inspect the request ledger")
    req_sub = req.add_subparsers(dest="action", required=True)
    lst = req_sub.add_parser("list", help="most recent requests first")
    lst.add_argument("--db", default=None, help="ledger file [env PAGEWIRE_DB]")
    lst.add_argument("--state", default=None,
                     choices=["queued", "running", "finished", "cancelled", "failed", "interrupted"])
    lst.add_argument("--limit", type=int, default=50)
    lst.add_argument("--key", default=None, help="only this API key's requests (a key id, pw-…)")
    lst.add_argument("--json", action="store_true", help="one JSON object per line")
    show = req_sub.add_parser("show", help="everything recorded about one request")
    show.add_argument("request_id")
    show.add_argument("--db", default=None, help="ledger file [env PAGEWIRE_DB]")
    from server.gateway.cli import add_parsers

    add_parsers(sub, "ledger file [env PAGEWIRE_DB]")

    plan = sub.add_parser("plan", help="capacity planning: weights, KV budget, sequences that fit, decode roofline",
                          description="Reads the model's config only (no weights). The engine options are "
                                      "serve's, so the KV figures equal serve's start-up log for the same settings.")
    add_plan_arguments(plan)
    from server.api.batch_cli import add_batch_arguments

    add_batch_arguments(sub.add_parser("batch", help="submit, show or cancel a batch on a running server"))
    return p


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from server.serving.settings import OPTIONS

    p.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face model folder or .gguf file (default: serve's default model)")
    p.add_argument("--memory", default=None,
                   help="memory for weights + activations + KV cache, e.g. 24GiB or 16GB; the KV pool is what "
                        "is left (default: size the pool from --kv-cache-tokens / --kv-cache-memory-gb as serve does)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="memory read bandwidth in GB/s for the roofline")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--model", dest="models", action="append", default=None, metavar="NAME=PATH",
                   help="another model served beside MODEL_DIR (repeat it): show how they fit --memory-budget")
    p.add_argument("--models-dir", dest="models_dir", default=None, help="every model in this folder, likewise")
    p.add_argument("--memory-budget", dest="memory_budget", default=None,
                   help="the budget several models share (serve's --memory-budget), e.g. 20GiB")
    p.add_argument("--allow-download", dest="allow_download", action="store_true", default=None,
                   help=argparse.SUPPRESS)
    for o in OPTIONS:
        if o.engine or o.name in ("demo_model", "cache_dir"):
            if o.name == "demo_model":
                p.add_argument(o.flag, dest=o.name, action=argparse.BooleanOptionalAction, default=None, help=o.help)
            else:
                p.add_argument(o.flag, dest=o.name, type=o.parse, default=None, help=o.help, metavar=o.name.upper())


def _plan(ns: argparse.Namespace) -> int:
    from server.engine.config import ConfigError
    from server.engine.plan import make_plan, parse_bytes, read_model_config, render
    from server.models.config import ModelLoadError

    try:
        settings = settings_from_args(ns)
        memory = parse_bytes(ns.memory) if ns.memory is not None else None
    except ValueError as e:
        print(f"pagewire: {'--memory: ' if 'size' in str(e) else ''}{e}", file=sys.stderr)
        return 2
    if ns.bandwidth_gbs is not None and ns.bandwidth_gbs <= 0:
        print(f"pagewire: --bandwidth-gbs: must be positive, got {ns.bandwidth_gbs}", file=sys.stderr)
        return 2
    if ns.models or ns.models_dir:
        return _plan_models(ns, settings)
    model_dir, name, _banner = _resolve_model(settings)
    try:
        config = settings.engine_config(str(model_dir))
        plan = make_plan(name, read_model_config(model_dir), config, memory, ns.bandwidth_gbs)
    except (ConfigError, ModelLoadError) as e:
        print(f"pagewire: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json()) if ns.json else render(plan))
    return 0


def _plan_models(ns: argparse.Namespace, settings: ServeSettings) -> int:
    """`pagewire plan` with several models: each one's footprint and how they fit the budget."""
    from server.engine.config import ConfigError
    from server.engine.plan import make_plan, parse_bytes, read_model_config
    from server.engine.plan_fit import ModelFit, fit_json, render_fit
    from server.models.config import ModelLoadError

    try:
        budget = parse_bytes(ns.memory_budget) if ns.memory_budget is not None else None
    except ValueError as e:
        print(f"pagewire: --memory-budget: {e}", file=sys.stderr)
        return 2
    settings.models = tuple(ns.models or ())
    settings.models_dir = ns.models_dir
    _, _, _, entries = _catalog(settings)
    fits = []
    try:
        for entry in entries:
            fits.append(ModelFit(entry.name, make_plan(entry.name, read_model_config(entry.path),
                                                       settings.engine_config(str(entry.path)), None, None)))
    except (ConfigError, ModelLoadError) as err:
        print(f"pagewire: {err}", file=sys.stderr)
        return 2
    print(json.dumps(fit_json(fits, budget)) if ns.json else render_fit(fits, budget))
    return 0


def _resolve_model(settings: ServeSettings) -> tuple[Path, str, Optional[str]]:
    """(model path, served name, banner to print or None)."""
    if settings.model_dir:
        from server.serving.model_path import ModelPathError, resolve_model_path

        try:
            d = resolve_model_path(settings.model_dir, settings.allow_download)
        except ModelPathError as e:
            raise SystemExit(f"pagewire: {e}") from None
        if d.is_file():
            default_name = d.stem
        elif d != Path(settings.model_dir).expanduser():  # a Hub id found in the local cache: named by its id
            default_name = settings.model_dir
        else:
            default_name = d.name
        return d, settings.served_model_name or default_name, None
    if settings.demo_model:
        from server.models.demo_model import ensure_demo_model  # lazy: builds with torch on first run

        d = ensure_demo_model(Path(settings.cache_dir).expanduser() if settings.cache_dir else None)
        return d, settings.served_model_name or "pagewire-demo", DEMO_BANNER
    from server.models.default_model import find_default_model, missing_default_model_message

    default = find_default_model()
    if default is None:
        raise SystemExit(f"pagewire: {missing_default_model_message()}")
    banner = DEFAULT_BANNER.format(name=default.name, licence=default.licence, source=default.source,
                                   path=default.path)
    return default.path, settings.served_model_name or default.name, banner


def _serve_settings(ns: argparse.Namespace) -> tuple[ServeSettings, Optional[str]]:
    """The settings (flag > env > --config file > default) and, with --print-config, their listing."""
    import os

    from server.serving.config_file import read_config_file, render_config
    from server.serving.settings import resolve_values

    path = getattr(ns, "config", None) or os.environ.get("PAGEWIRE_CONFIG")
    file_values = read_config_file(Path(path).expanduser()) if path else {}
    values, source = resolve_values(ns, None, file_values)
    listing = render_config(values, source) if getattr(ns, "print_config", False) else None
    return ServeSettings(**values), listing


def _catalog(settings: ServeSettings) -> tuple[Path, str, Optional[str], list[Any]]:
    """(default model path, its name, banner, every served model: server.serving.model_catalog)."""
    from server.serving.model_catalog import ModelEntry, build_catalog
    from server.serving.model_path import ModelPathError

    others = bool(settings.models or settings.models_dir)
    default: Optional[ModelEntry] = None
    banner: Optional[str] = None
    if settings.model_dir or not others:
        model_dir, name, banner = _resolve_model(settings)
        default = ModelEntry(name, model_dir, "MODEL")
    try:
        entries = build_catalog(default, settings.models, settings.models_dir, settings.allow_download)
    except ModelPathError as e:
        raise SystemExit(f"pagewire: {e}") from None
    return entries[0].path, entries[0].name, banner, entries


def _check_adapters(settings: ServeSettings, entries: list[Any]) -> None:
    """--lora: each adapter's folder and adapter_config.json (torch-free; the tensors are checked
    against the model when it loads), a default model (`entries[0]`, which the adapters go over)
    that can take them, and names that clash with no served model's. ValueError naming the problem."""
    from server.models.lora_config import check_base_model, read_lora_config
    from server.models.registry import read_model_config
    from server.serving.model_names import ModelNames

    if not settings.lora:
        return
    check_base_model(read_model_config(entries[0].path))
    for _, path in settings.lora:
        read_lora_config(path)
    ModelNames(entries[0].name, [n for n, _ in settings.lora])
    clash = [n for n, _ in settings.lora if n in [e.name for e in entries[1:]]]
    if clash:
        raise ValueError(f"--lora: adapter name {clash[0]!r} is also a served model's name; pick another")


def _serve(ns: argparse.Namespace) -> int:
    from server.serving.model_path import check_model

    try:
        settings, listing = _serve_settings(ns)
    except ValueError as e:
        print(f"pagewire: {e}", file=sys.stderr)
        return 2
    if listing is not None:
        print(listing)
        return 0
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir, name, banner, entries = _catalog(settings)
    try:
        # The engine knobs are checked against the real model path (`--quantization gguf` needs
        # to see that it is a .gguf file), and the model's config is read (no weights) so an
        # unsupported one is refused here, before the port is bound or the engine starts.
        for entry in entries:
            settings.engine_config(str(entry.path), adapters=entry is entries[0])
            check_model(entry.path, settings.task)
        _check_adapters(settings, entries)
    except ValueError as e:  # ModelPathError, ConfigError, LoraError
        print(f"pagewire: {e}", file=sys.stderr)
        return 2
    if settings.speculative_config is not None:  # a draft model must share the model's vocabulary
        from server.engine.draft_proposer import check_draft_model

        try:
            check_draft_model(settings.speculative_config, str(model_dir))
        except ValueError as e:
            print(f"pagewire: --speculative-config: {e}", file=sys.stderr)
            return 2
    if banner:
        print(banner, file=sys.stderr, flush=True)
    from server.gateway.auth import AuthConfigError
    from server.serve import run
    from server.serving.ledger import LedgerError
    from server.serving.listen import StartupError

    try:
        run(settings, model_dir, name, entries)
    except (LedgerError, StartupError) as e:  # another server holds this ledger; port in use; model failed
        print(f"pagewire: {e}", file=sys.stderr)
        return 1
    except AuthConfigError as e:  # e.g. a public bind with no keys
        print(f"pagewire: {e}", file=sys.stderr)
        return 2
    return 0


def _fmt_time(t: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _db_target(ns: argparse.Namespace) -> "DbTarget":
    """What --db (else PAGEWIRE_DB, else the default file) names; DbSpecError for a bad value."""
    import os

    from server.serving.db_url import parse_db

    return parse_db(ns.db or os.environ.get("PAGEWIRE_DB"), default_db_path())


def _db(ns: argparse.Namespace) -> Path:
    t = _db_target(ns)
    if t.path is None:
        raise DbSpecError(f"--db {t.display()}: this command needs a SQLite ledger file")
    return t.path


def _requests(ns: argparse.Namespace) -> int:
    from server.serving.ledger import LedgerError
    from server.serving.ledger_sync import open_readonly

    try:
        t = _db_target(ns)
        if t.url is not None:
            from server.serving.ledger_pg_sync import connect_sync

            conn: Any = connect_sync(t.url)
        else:
            conn = open_readonly(_db(ns))
    except LedgerError as e:
        print(f"pagewire: {e}", file=sys.stderr)
        return 1
    try:
        return _print_requests(ns, conn)
    finally:
        conn.close()


def _print_requests(ns: argparse.Namespace, conn: Any) -> int:
    from server.api.requests_view import record_json, record_summary
    from server.serving.ledger_sync import get_record, list_records

    if ns.action == "list":
        rows = list_records(conn, ns.limit, ns.state, ns.key)
        if ns.json:
            for r in rows:
                print(json.dumps(record_summary(r)))
            return 0
        print(f"{'REQUEST ID':<28} {'STATE':<11} {'KIND':<10} {'API':<5} {'KEY':<15} {'CREATED':<19} "
              f"{'PROMPT':>6} {'OUTPUT':>6} {'REASON':<10}")
        for r in rows:
            print(f"{r.request_id:<28} {r.state:<11} {r.kind:<10} {r.api:<5} {r.key_id or '-':<15} "
                  f"{_fmt_time(r.created_at):<19} {r.prompt_tokens:>6} {r.completion_tokens:>6} "
                  f"{r.finish_reason or '-':<10}")
        return 0
    rec = get_record(conn, ns.request_id)
    if rec is None:
        print(f"pagewire: request_id: no request {ns.request_id!r} in {_db_target(ns)}", file=sys.stderr)
        return 1
    print(json.dumps(record_json(rec), indent=2, ensure_ascii=False))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.command in ("requests", "keys", "usage"):
        try:
            _db_target(ns)
        except DbSpecError as e:  # before anything is opened or created
            print(f"pagewire: {e}", file=sys.stderr)
            return 2
    if ns.command == "serve":
        return _serve(ns)
    if ns.command in ("keys", "usage"):
        from server.gateway.cli import run_keys, run_usage

        return (run_keys if ns.command == "keys" else run_usage)(ns, _db_target(ns))
    if ns.command == "plan":
        return _plan(ns)
    if ns.command == "batch":
        from server.api.batch_cli import run_batch

        return run_batch(ns)
    return _requests(ns)


if __name__ == "__main__":
    sys.exit(main())
