"""Shared fixtures: tiny random-weight Hugging Face model folders, created locally (never downloaded).

`tiny_model(arch, dtype, **overrides)` returns a folder with a transformers-saved model
(safetensors) plus the demo BPE tokenizer trained locally with `tokenizers`. Folders are cached
per session, keyed by their arguments.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import settings

# CI runs property tests with a fixed derandomised seed so a run is reproducible; locally they
# explore fresh random cases each time (and print the failing example if one turns up).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's intra-op threads get its share of the cores.

    `make test` runs two workers on two cores. With torch's default (one thread per core) each
    worker's OpenMP regions ran two threads on cores the other worker also wanted: every barrier
    then waited for a descheduled thread, which cost a whole scheduler slice per region (a 32-token
    prefill measured 3.1 s alone and 19.8 s beside one busy process, bench/RESULTS.md). Set before
    torch is imported (collection imports it), so torch and the extension's OpenMP read it. Tests
    that check thread-count invariance set their thread counts themselves (test_determinism,
    test_attention_batch_invariance, test_thread_invariance)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda` tests skip (with the reason) when no GPU is visible; `sqlite_only` ones when the
    ledger backend under test is PostgreSQL (tests.server.harness.LEDGER_BACKEND)."""
    if os.environ.get("PAGEWIRE_TEST_LEDGER") == "postgresql":
        on_pg = pytest.mark.skip(reason="checks the SQLite ledger file itself (PAGEWIRE_TEST_LEDGER=postgresql)")
        for item in items:
            if "sqlite_only" in item.keywords:
                item.add_marker(on_pg)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from server.models.demo_model import build_tokenizer
    from tests.tiny_models import make_tiny_model

    cache: dict[str, Path] = {}

    def make(arch: str = "llama", dtype: str = "float32", **overrides: Any) -> Path:
        key = json.dumps([arch, dtype, overrides], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            info = build_tokenizer(out, vocab_size=overrides.pop("tokenizer_vocab_size", 512))
            cfg = dict(bos_token_id=info.bos_token_id, eos_token_id=list(info.eos_token_ids))
            cfg.update(overrides)
            make_tiny_model(out, arch, dtype, vocab_size=info.vocab_size, **cfg)
            # save_pretrained may rewrite generation_config.json; keep the tokenizer's eos ids.
            (out / "generation_config.json").write_text(
                json.dumps({"bos_token_id": info.bos_token_id, "eos_token_id": list(info.eos_token_ids)})
            )
            cache[key] = out
        return cache[key]

    return make
