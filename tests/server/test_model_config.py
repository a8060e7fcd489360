"""Declaring models (issue 30): the config file and its precedence (flag > env > file > default),
`--print-config`, the model catalog (`--model NAME=PATH`, `--models-dir`), and Hub ids resolved
through huggingface_hub's own cache layout, laid out here by the test (nothing is downloaded)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from server.serving.config_file import ConfigFileError, read_config_file
from server.serving.durations import parse_duration
from server.serving.model_catalog import build_catalog, scan_models_dir
from server.serving.model_path import ModelPathError, looks_like_hub_id, resolve_model_path
from server.serving.settings import add_serve_arguments, resolve_values

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _model_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def test_config_file_values_and_their_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "pagewire.toml"
    cfg.write_text('port = 9100\nhost = "0.0.0.0"\nmax_model_len = 2048\nmemory_budget = "2GiB"\n'
                   'keep_alive = "5m"\nenable_prefix_caching = false\nmodel_dir = "/models/default"\n'
                   '[[models]]\nname = "small"\npath = "/models/small"\n'
                   '[[models]]\nname = "coder"\npath = "/models/coder"\n'
                   '[[adapters]]\nname = "sql"\npath = "/adapters/sql"\n')
    file_values = read_config_file(cfg)
    values, source = resolve_values(_parse(["--port", "9200"]), {"PAGEWIRE_HOST": "127.0.0.2"}, file_values)
    assert (values["port"], source["port"]) == (9200, "flag")
    assert (values["host"], source["host"]) == ("127.0.0.2", "env")
    assert (values["max_model_len"], source["max_model_len"]) == (2048, "file")
    assert values["memory_budget"] == 2 * 2**30 and values["keep_alive"] == 300.0
    assert values["enable_prefix_caching"] is False
    assert values["models"] == ("small=/models/small", "coder=/models/coder")
    assert values["lora"] == (("sql", "/adapters/sql"),)  # as --lora sql=/adapters/sql parses
    assert resolve_values(_parse(["--lora", "a=/x", "--lora", "b=/y"]), {}, file_values)[0]["lora"] == \
        (("a", "/x"), ("b", "/y"))  # a flag replaces the file's list
    assert (values["model_dir"], source["model_dir"]) == ("/models/default", "file")
    assert "max_num_seqs" not in source  # the default


@pytest.mark.parametrize("text, where", [
    ("prot = 1\n", "prot: not a serve option"),
    ("port = \"eighty\"\n", "port:"),
    ("[[models]]\nname = \"x\"\n", "models[0]: needs a `name` and a `path`"),
    ("[[adapters]]\nname = \"a b\"\npath = \"/x\"\n", "adapters:"),
    ("port = [\n", "not valid TOML"),
])
def test_a_bad_config_file_names_the_file_and_key(tmp_path: Path, text: str, where: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigFileError) as e:
        read_config_file(cfg)
    assert str(cfg) in str(e.value) and where in str(e.value)


def test_print_config_shows_each_value_and_its_source(tmp_path: Path) -> None:
    cfg = tmp_path / "pagewire.toml"
    cfg.write_text('port = 9100\nmax_num_seqs = 4\n[[models]]\nname = "small"\npath = "/m/small"\n'
                   '[[adapters]]\nname = "sql"\npath = "/a/sql"\n')
    env = {**os.environ, "PAGEWIRE_MAX_NUM_SEQS": "6"}
    env.pop("PAGEWIRE_PORT", None)
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--config", str(cfg), "--print-config",
                          "--host", "127.0.0.9"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert 'host = "127.0.0.9"  # flag' in lines
    assert "max_num_seqs = 6  # env" in lines
    assert "port = 9100  # file" in lines
    assert "block_size = 16  # default" in lines
    assert "[[models]]  # file" in lines and 'name = "small"' in lines and 'path = "/m/small"' in lines
    assert "[[adapters]]  # file" in lines and 'name = "sql"' in lines and 'path = "/a/sql"' in lines


def test_durations() -> None:
    assert parse_duration("90") == 90.0 and parse_duration("5m") == 300.0 and parse_duration("1h30m") == 5400.0
    assert parse_duration("-1") == -1.0 and parse_duration("500ms") == 0.5
    with pytest.raises(ValueError):
        parse_duration("5 minutes")


def test_catalog_from_flags_and_a_models_folder(tmp_path: Path) -> None:
    a = _model_folder(tmp_path / "a")
    folder = tmp_path / "models"
    _model_folder(folder / "chat")
    (folder / "notes.txt").parent.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("not a model")
    entries = build_catalog(None, (f"first={a}",), str(folder))
    assert [(e.name, e.path) for e in entries] == [("first", a), ("chat", folder / "chat")]
    assert [e.name for e in scan_models_dir(str(folder))] == ["chat"]
    with pytest.raises(ModelPathError, match="'chat' is declared twice"):
        build_catalog(None, (f"chat={a}",), str(folder))
    with pytest.raises(ModelPathError, match="--model x: .*no config.json"):
        build_catalog(None, (f"x={tmp_path / 'missing'}",), None)


def _hub_cache(root: Path, repo_id: str) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/…}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    return snap


def test_hub_ids_resolve_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    snap = _hub_cache(cache, "example-org/tiny")
    (snap / "config.json").write_text("{}")
    gguf_snap = _hub_cache(cache, "example-org/tiny-GGUF")
    (gguf_snap / "tiny-Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert looks_like_hub_id("example-org/tiny-GGUF:tiny-Q8_0.gguf")
    assert resolve_model_path("example-org/tiny") == snap
    assert resolve_model_path("example-org/tiny-GGUF:tiny-Q8_0.gguf") == gguf_snap / "tiny-Q8_0.gguf"


@pytest.mark.parametrize("allow", [False, True])
def test_an_uncached_hub_id_offline_is_a_plain_error_naming_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, allow: bool) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # even with --allow-download: offline wins
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no download could succeed
    for text in ("example-org/absent", "example-org/absent-GGUF:absent.gguf"):
        with pytest.raises(ModelPathError) as e:
            resolve_model_path(text, allow_download=allow)
        msg = str(e.value)
        assert text in msg and str(cache) in msg and "not in the local cache" in msg
        assert ("HF_HUB_OFFLINE=1 forbids downloading" if allow else "--allow-download") in msg



def test_plan_shows_how_several_models_fit_a_budget(tiny_model: Callable[..., Path]) -> None:
    import json

    from server.engine.plan import make_plan, read_model_config
    from server.serving.settings import ServeSettings

    a, b = tiny_model("llama"), tiny_model("qwen2")
    each = {}
    for name, p in (("a", a), ("b", b)):
        plan = make_plan(name, read_model_config(p), ServeSettings(kv_cache_tokens=4096).engine_config(str(p)), None, None)
        each[name] = plan.weights.total + plan.activations + plan.layout.total_bytes
    budget = max(each.values()) + min(each.values()) // 2  # one at a time
    cmd = [sys.executable, "-m", "server.cli", "plan", "--model", f"a={a}", "--model", f"b={b}",
           "--kv-cache-tokens", "4096", "--memory-budget", str(budget)]
    out = subprocess.run([*cmd, "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert {m["name"]: m["footprint_bytes"] for m in got["models"]} == each
    assert got["all_fit"] is False and all(m["fits_alone"] for m in got["models"])
    text = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    assert "not all at once: 1 stay loaded together" in text, text
