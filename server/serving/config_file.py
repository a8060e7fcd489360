"""`pagewire serve --config pagewire.toml`: serve options from a TOML file.

Every `serve` option is a top-level key under its long name with underscores (`host`, `port`,
`db`, `max_model_len`, `memory_budget`, …); `model_dir` is the default model. Models are
`[[models]]` tables with `name` and `path`, LoRA adapters `[[adapters]]` tables likewise (they
become the `lora` option where the server has it). A value may be the TOML type (a number, a
boolean) or the string the flag would take ("20GiB", "5m"). Precedence: flag > env > file >
default (server.serving.settings.resolve_values); `--print-config` shows each value's source.

An unknown key, a malformed value or a table without `name`/`path` is an error naming the file
and the key. Read with the standard library's tomllib (Python 3.11+).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """The config file cannot be used; the message names the file and the key."""


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _entries(path: Path, table: str, items: Any) -> tuple[str, ...]:
    if not isinstance(items, list):
        raise ConfigFileError(f"{path}: [[{table}]]: expected an array of tables with name and path")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or \
                not isinstance(item.get("path"), str) or not item["name"] or not item["path"]:
            raise ConfigFileError(f"{path}: {table}[{i}]: needs a `name` and a `path` (strings)")
        extra = set(item) - {"name", "path"}
        if extra:
            raise ConfigFileError(f"{path}: {table}[{i}]: unknown key(s) {', '.join(sorted(extra))} "
                                  "(expected name and path)")
        out.append(f"{item['name']}={item['path']}")
    return tuple(out)


def read_config_file(path: Path) -> dict[str, Any]:
    """The file's values by option name, parsed as their flags would be."""
    import importlib

    try:
        tomllib: Any = importlib.import_module("tomllib")  # Python 3.11+ (mypy checks for 3.10)
    except ImportError:  # Python 3.10
        raise ConfigFileError(f"{path}: reading a config file needs Python 3.11 or later (tomllib)") from None
    from server.serving.settings import OPTIONS

    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigFileError(f"--config {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"--config {path}: not valid TOML: {e}") from None
    by_name = {o.name: o for o in OPTIONS}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "models":
            values["models"] = _entries(path, "models", value)
            continue
        if key == "adapters":
            if "lora" not in by_name:
                raise ConfigFileError(f"{path}: adapters: this server has no LoRA support (--lora)")
            try:  # (name, folder) pairs, as --lora parses them
                values["lora"] = tuple(by_name["lora"].parse(e) for e in _entries(path, "adapters", value))
            except ValueError as e:
                raise ConfigFileError(f"{path}: adapters: {e}") from None
            continue
        if key == "model_dir":
            values["model_dir"] = _as_text(value)
            continue
        o = by_name.get(key)
        if o is None:
            raise ConfigFileError(f"{path}: {key}: not a serve option (keys are the long option names with "
                                  "underscores, e.g. max_model_len)")
        try:
            if o.repeated:
                items = value if isinstance(value, list) else [value]
                values[key] = tuple(o.parse(_as_text(v)) for v in items)
            elif isinstance(value, (dict, list)) and key == "speculative_config":
                import json

                values[key] = o.parse(json.dumps(value))
            else:
                values[key] = o.parse(_as_text(value))
        except ValueError as e:
            raise ConfigFileError(f"{path}: {key}: {e}") from None
    return values


def render_config(values: dict[str, Any], source: dict[str, str]) -> str:
    """`--print-config`: every option, its value and where it came from (flag, env, file, default),
    as TOML a config file could hold."""
    from server.serving.settings import OPTIONS, ServeSettings

    settings = ServeSettings(**values)
    lines = ["# pagewire serve: effective configuration (precedence: flag > env > file > default)"]

    def emit(name: str, value: Any) -> None:
        where = source.get(name, "default")
        if value is None:
            lines.append(f"# {name} = (unset)  # {where}")
            return
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{name} = {text}  # {where}")

    emit("model_dir", settings.model_dir)
    tables: list[tuple[str, tuple[Any, ...], str]] = []
    for o in OPTIONS:
        value = getattr(settings, o.name)
        if o.repeated:
            tables.append(("adapters" if o.name == "lora" else o.name, tuple(value or ()),
                           source.get(o.name, "default")))
            continue
        if o.name == "speculative_config" and value is not None:
            value = getattr(value, "source_text", None) or str(value)
        emit(o.name, value)
    for table, entries, where in tables:
        for entry in entries:
            name, p = entry if isinstance(entry, tuple) else entry.split("=", 1)  # lora's are (name, path)
            lines += ["", f"[[{table}]]  # {where}", f'name = "{name}"', f'path = "{p}"']
    return "\n".join(lines)
