"""`pagewire plan` against the real thing: its weight bytes equal a loaded model's, and its KV figures
equal what the engine allocates and what `pagewire serve` logs at start-up for the same settings."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from server.cli import main
from server.engine.config import ConfigError, EngineConfig
from server.engine.plan import make_plan, parse_bytes, read_model_config
from tests.server.harness import REPO, ServerProcess


def _loaded_weight_bytes(model: Any) -> int:
    from server.kernels.quant import QuantizedExperts, QuantizedWeight
    from server.kernels.quant_parts import QuantizedParts

    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, (QuantizedWeight, QuantizedExperts, QuantizedParts)) and id(v) not in seen:
                seen.add(id(v))
                total += v.data.numel() * v.data.element_size()
    return total


@pytest.mark.parametrize("arch,dtype,quant,tied", [
    ("llama", "float32", "none", False),
    ("llama", "bfloat16", "none", True),
    ("qwen2", "float32", "none", False),
    ("qwen3", "float32", "int8", True),
    ("llama", "float32", "int4", True),
])
def test_weight_bytes_equal_the_loaded_model(tiny_model: Callable[..., Path], arch: str, dtype: str,
                                             quant: str, tied: bool) -> None:
    from server.models.loader import load_model

    path = tiny_model(arch, dtype, tie_word_embeddings=tied)
    model, mc = load_model(path, "auto")
    if quant != "none":
        model.quantize_weights(quant)
    plan = make_plan("m", read_model_config(path), EngineConfig(str(path), quantization=quant,
                                                                kv_cache_tokens=1024), None, None)
    assert plan.dtype == dtype
    assert plan.weights.total == _loaded_weight_bytes(model)


@pytest.mark.parametrize("memory,extra", [("64MiB", {}), ("48MiB", {"max_model_len": 256, "block_size": 8}),
                                          ("40MB", {"dtype": "bfloat16"})])
def test_plan_equals_the_engines_pool(tiny_model: Callable[..., Path], caplog: pytest.LogCaptureFixture,
                                      memory: str, extra: dict[str, Any]) -> None:
    """The pool plan derives from --memory is exactly the one an engine started with its flags allocates."""
    from server.engine.engine import LLMEngine

    path = tiny_model("llama", "float32")
    base = EngineConfig(str(path), max_num_seqs=4, max_num_batched_tokens=64, **extra)
    plan = make_plan("m", read_model_config(path), base, parse_bytes(memory), bandwidth_gbs=10.0)
    assert plan.kv_budget_bytes == parse_bytes(memory) - plan.weights.total - plan.activations
    assert plan.layout.total_bytes <= plan.kv_budget_bytes < plan.layout.total_bytes + \
        (plan.layout.block_size + 1) * plan.layout.bytes_per_token
    cfg = EngineConfig(str(path), max_num_seqs=4, max_num_batched_tokens=64,
                       **{**extra, "kv_cache_tokens": plan.layout.total_tokens})
    with caplog.at_level(logging.INFO, logger="pagewire.engine"):
        engine = LLMEngine(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines == [plan.layout.log_line()]
    assert engine.kv_cache.num_blocks == plan.layout.num_blocks
    assert engine.max_model_len == plan.layout.max_model_len
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    assert allocated == plan.layout.total_bytes
    assert allocated // plan.layout.total_tokens == plan.layout.bytes_per_token
    # Sequences that fit: at max_model_len, what the log states; the roofline falls with length.
    last = plan.rows[-1]
    assert last.seq_len == plan.layout.max_model_len
    assert last.fits == plan.layout.num_blocks // -(-last.seq_len // plan.layout.block_size)
    assert all(r.roofline_b1 is not None and r.roofline_bn is not None and r.roofline_bn >= r.roofline_b1
               for r in plan.rows)


def test_plan_equals_the_serve_start_up_log(demo_model: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Black box: `pagewire plan --json` and `pagewire serve`'s log line, same flags, same model."""
    flags = ["--kv-cache-memory-gb", "0.01", "--block-size", "8", "--max-num-seqs", "4"]
    out = subprocess.run([sys.executable, "-m", "server.cli", "plan", str(demo_model), "--json", *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    planned = json.loads(out)
    # The harness's own --kv-cache-tokens would win over --kv-cache-memory-gb: drop it here.
    from tests.server import harness

    monkeypatch.setattr(harness, "FAST_ENGINE", ["--num-threads", "1"])
    srv = ServerProcess(demo_model, tmp_path / "l.db", "--log-level", "info", *flags).start()
    try:
        deadline = time.monotonic() + 60
        logged: list[str] = []
        while not logged and time.monotonic() < deadline:
            logged = [ln[ln.index("KV cache:"):] for ln in srv.read_log().splitlines() if "KV cache:" in ln]
            time.sleep(0.05)  # poll interval only; the deadline bounds the wait
    finally:
        srv.stop()
    assert logged == [planned["kv_log_line"]]


def test_plan_cli_prints_the_napkin_math(demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(demo_model), "--memory", "256MiB", "--max-model-len", "512"]) == 0
    out = capsys.readouterr().out
    for needle in ("weights:", "activations:", "KV budget:", "KV per token:", "KV cache:", "serve with:",
                   "python -m bench.bandwidth"):
        assert needle in out


def test_plan_errors_name_the_setting(demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(demo_model), "--memory", "24 parsecs"]) == 2
    assert "--memory" in capsys.readouterr().err
    assert main(["plan", str(demo_model), "--memory", "1MiB"]) == 2
    assert "memory:" in capsys.readouterr().err
    assert main(["plan", str(demo_model), "--memory", "1GiB", "--bandwidth-gbs", "-3"]) == 2
    assert "--bandwidth-gbs" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_model_len"):
        mc = read_model_config(demo_model)
        make_plan("m", mc, EngineConfig(str(demo_model), max_model_len=mc.max_position_embeddings + 1),
                  parse_bytes("1GiB"), None)


def test_parse_bytes() -> None:
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("512mib") == 512 * 2**20
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_plan_equals_the_engines_pool_with_kv_groups(tiny_model: Callable[..., Path],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Interleaved sliding and full layers: plan counts blocks per KV group exactly as the engine
    allocates and admits them, and a long sequence costs less than with every layer global."""
    from server.engine.engine import LLMEngine

    path = tiny_model("qwen2", "float32", use_sliding_window=True, sliding_window=16, num_hidden_layers=4,
                      layer_types=["sliding_attention", "full_attention"] * 2)
    base = EngineConfig(str(path), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    plan = make_plan("m", read_model_config(path), base, parse_bytes("64MiB"), bandwidth_gbs=10.0)
    lay = plan.layout
    assert lay.groups.windows == (16, 0) and lay.groups.group_size == 2
    assert lay.total_bytes <= plan.kv_budget_bytes
    cfg = EngineConfig(str(path), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                       kv_cache_tokens=lay.total_tokens)
    with caplog.at_level(logging.INFO, logger="pagewire.engine"):
        engine = LLMEngine(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines == [lay.log_line()] and "1 sliding 16, 1 full" in lines[0]
    assert engine.kv_cache.num_blocks == lay.num_blocks and engine.kv_cache.group_windows == (16, 0)
    tensors = {id(t): t for pair in engine.runner.kv_caches for t in pair}  # layers share a slot's pair
    assert len(tensors) == 2 * 2
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == lay.total_bytes
    last = plan.rows[-1]
    assert last.fits == lay.num_blocks // lay.seq_blocks(last.seq_len)
    assert last.kv_bytes == lay.seq_blocks(512) * lay.bytes_per_block
    assert 0.5 < last.vs_all_global < 0.6  # the full half of the layers, plus the window's blocks


def test_a_hybrids_memory_plan_holds_its_state_slots(tiny_model: Callable[..., Path]) -> None:
    """A Qwen3.5 (Gated DeltaNet layers beside attention layers) planned into --memory: the KV
    blocks and the state slots together stay inside what weights and activations leave, a sequence
    holds the attention layers' KV plus one slot, and the plan says so."""
    path = tiny_model("qwen3_5", "float32")
    base = EngineConfig(str(path), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    plan = make_plan("m", read_model_config(path), base, parse_bytes("64MiB"), bandwidth_gbs=10.0)
    lay = plan.layout
    assert lay.state_slot_bytes > 0 and lay.state_slots == 4
    assert lay.total_bytes <= plan.kv_budget_bytes  # the slots included (kv_layout: "in the total")
    last = plan.rows[-1]
    assert last.kv_bytes == lay.seq_blocks(512) * lay.bytes_per_block + lay.state_slot_bytes
    assert last.vs_all_global < 0.6  # 2 of 4 layers keep KV (tests.tiny_models' qwen3_5)
    assert "2 attention layers (of 4)" in plan.state_note and "gated_deltanet" in plan.state_note
