"""Start-up as a newcomer meets it: `serve FILE.gguf --quantization gguf` serves; every start-up
failure (a port in use, an unsupported model, weights that do not load, a Hub id) exits non-zero
with one line naming the cause and no traceback unless --log-level debug; a Hub id is served from
the local Hugging Face cache when it is there, and never downloaded."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

from tests.server.harness import FAST_ENGINE, REPO, ServerProcess, free_port


def _serve(*args: str, env: Optional[dict[str, str]] = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`pagewire serve ARGS` to its exit (these all fail at start-up)."""
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", *args, *FAST_ENGINE],
                          cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    """The process's error: its last stderr line, `pagewire: …`; and no traceback anywhere."""
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("pagewire: "), out.stderr
    return lines[-1]


def test_serve_gguf_with_quantization_gguf(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """The README's edge-user command: it used to fail with "'-' is not a .gguf file"."""
    from tests.gguf_files import write_gguf

    gguf = write_gguf(tmp_path / "tiny-q8.gguf", tiny_model("llama"), "Q8_0")
    srv = ServerProcess(gguf, tmp_path / "g.db", "--quantization", "gguf").start()
    try:
        r = httpx.post(srv.base + "/v1/completions", timeout=60,
                       json={"model": "demo", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()


def test_quantization_gguf_on_a_folder_is_one_line(demo_model: Path, tmp_path: Path) -> None:
    out = _serve(str(demo_model), "--quantization", "gguf", "--db", str(tmp_path / "x.db"))
    assert out.returncode == 2
    assert "quantization: 'gguf' keeps a GGUF file's quantised blocks" in _one_line_error(out)


def test_port_in_use_exits_1_with_one_line(demo_model: Path, tmp_path: Path) -> None:
    """It used to end in `terminate called without an active exception` (SIGABRT, 134)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _serve(str(demo_model), "--port", str(port), "--db", str(tmp_path / "p.db"))
    assert out.returncode == 1, out.stderr
    line = _one_line_error(out)
    assert f"--port {port}" in line and "address already in use" in line
    assert "terminate called" not in out.stderr


def test_metrics_port_in_use_is_named(demo_model: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _serve(str(demo_model), "--port", str(free_port()), "--metrics-port", str(port),
                     "--db", str(tmp_path / "m.db"))
    assert out.returncode == 1
    assert f"--metrics-port {port}" in _one_line_error(out)


def _unsupported(demo_model: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "gpt2-like"
    shutil.copytree(demo_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_unsupported_model_exits_2_with_one_line_before_binding(demo_model: Path, tmp_path: Path) -> None:
    """It used to print a traceback and then answer 503 forever (and 200 on /v1/models)."""
    port = free_port()
    out = _serve(str(_unsupported(demo_model, tmp_path)), "--port", str(port), "--db", str(tmp_path / "u.db"))
    assert out.returncode == 2
    line = _one_line_error(out)
    assert "architecture GPT2LMHeadModel is not supported" in line and "config.json" in line
    with socket.socket() as s:  # nothing was left listening (it never bound)
        s.bind(("127.0.0.1", port))


def test_an_unsupported_pooling_config_exits_2_with_one_line(demo_model: Path, tmp_path: Path) -> None:
    """An embedding folder whose sentence-transformers modules pagewire cannot reproduce is refused
    before binding, naming the file; `--task generate` ignores the pooling files."""
    from tests.tiny_models import with_pooling_config

    d = with_pooling_config(demo_model, tmp_path / "emb", "mean")
    modules = json.loads((d / "modules.json").read_text())
    (d / "modules.json").write_text(json.dumps(modules + [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    out = _serve(str(d), "--port", str(free_port()), "--db", str(tmp_path / "p.db"))
    assert out.returncode == 2
    line = _one_line_error(out)
    assert "modules.json" in line and "sentence_transformers.models.Dense" in line and "not supported" in line
    with ServerProcess(d, tmp_path / "g.db", "--task", "generate") as proc:
        r = httpx.post(proc.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=300)
        assert r.status_code == 200


def test_weights_that_fail_to_load_exit_1_with_one_line(demo_model: Path, tmp_path: Path) -> None:
    """A load failure on the engine thread (after the socket is up) ends the process too."""
    broken = tmp_path / "broken-model"
    shutil.copytree(demo_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = _serve(str(broken), "--port", str(free_port()), "--db", str(tmp_path / "b.db"))
    assert out.returncode == 1, out.stderr
    line = _one_line_error(out)
    assert line.startswith("pagewire: model failed to load: ")
    debug = _serve(str(broken), "--port", str(free_port()), "--db", str(tmp_path / "b.db"), "--log-level", "debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr  # the traceback is for --log-level debug


def test_hub_id_not_cached_says_so_and_does_not_download(tmp_path: Path) -> None:
    """It used to say only `no config.json there`."""
    empty = tmp_path / "hf-cache"
    empty.mkdir()
    # No network is needed to prove none is used: the lookup must fail from the empty cache even
    # with the endpoint pointed at a closed port.
    env = {"HF_HUB_CACHE": str(empty), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    out = _serve("Qwen/Qwen3-0.6B", "--db", str(tmp_path / "h.db"), env=env, timeout=120)
    assert out.returncode == 1 and not out.stdout
    line = _one_line_error(out)
    assert "Qwen/Qwen3-0.6B" in line and "Hugging Face Hub id" in line and "does not download" in line


def _hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """huggingface_hub's cache layout (models--org--name/{refs/main, snapshots/<commit>/…})."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    shutil.copytree(model, snap)
    return snap


def test_hub_id_in_the_local_cache_is_served_by_its_id(demo_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hf-cache"
    snap = _hub_cache(cache, "example-org/tiny-demo", demo_model)
    env = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    plan = subprocess.run([sys.executable, "-m", "server.cli", "plan", "example-org/tiny-demo", "--json"],
                          cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["model"] == "example-org/tiny-demo"
    srv = ServerProcess(Path("example-org/tiny-demo"), tmp_path / "c.db", env=env, served_model_name=None).start()
    try:
        assert httpx.get(srv.base + "/v1/models").json()["data"][0]["id"] == "example-org/tiny-demo"
        r = httpx.post(srv.base + "/v1/completions", timeout=60,
                       json={"model": "example-org/tiny-demo", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    assert snap.is_dir()


@pytest.mark.parametrize("text", ["Qwen/Qwen3-0.6B", "org/name.v2", "a-b/c_d"])
def test_hub_id_shapes(text: str) -> None:
    from server.serving.model_path import looks_like_hub_id

    assert looks_like_hub_id(text)


@pytest.mark.parametrize("text", ["./models/x", "/abs/path", "a/b/c", "../x/y", "x.gguf", "noslash", "a/../b"])
def test_not_hub_id_shapes(text: str) -> None:
    from server.serving.model_path import looks_like_hub_id

    assert not looks_like_hub_id(text)
