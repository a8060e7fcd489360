"""Load progress (issue 30): the stages a model's load reports, with their bytes, and the log line
the model pool writes while a load runs without a terminal."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

import pytest

from server.models import load_progress
from server.models.load_progress import LoadProgress


def test_the_read_stage_counts_every_weight_byte(tiny_model: Callable[..., Path]) -> None:
    from safetensors import safe_open

    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine

    path = tiny_model("llama")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        want = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    p = LoadProgress()
    with load_progress.reporting(p):
        LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=256, max_num_seqs=2, autotune=False, num_threads=1))
    stages = {name: n for name, n, _ in p.finished}
    assert list(stages) == ["read", "kv pool", "autotune"]
    assert stages["read"] == want
    # Outside `reporting` the calls do nothing (the offline LLM, tests).
    load_progress.stage("read", 10)
    load_progress.advance(5)


def test_without_a_terminal_a_load_logs_its_stage(caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from server.serving import model_pool

    monkeypatch.setattr(model_pool, "PROGRESS_LOG_S", 0.01)
    p = LoadProgress()
    p.stage, p.total_bytes, p.done_bytes = "read", 8 << 20, 2 << 20

    async def main() -> None:
        done = asyncio.Event()
        task = asyncio.get_running_loop().create_task(model_pool.report_progress("m", p, done))
        while not any("loading: read 2.0/8.0 MiB" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0)  # yields to the reporter: the line is what is awaited
        done.set()
        await task

    with caplog.at_level(logging.INFO, logger="pagewire"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert p.describe().startswith("read 2.0/8.0 MiB")
