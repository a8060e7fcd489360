"""The server with speculative decoding on: the WebSocket tests (multiplexing, drop/reconnect/resume,
resume from the ledger, usage) rerun against it, plus multi-token delta frames, the metrics, and
the CLI's error for a bad --speculative-config.

Speculation is forced on for every step and sequence (no batch or acceptance switch), so each
engine step may emit several tokens per request: delta frames carry them together, `seq` stays
per frame, and resume and usage must stay exact.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.server.harness import ServerProcess, WsClient, tokens_of
from tests.server.test_websocket import (  # noqa: F401  (collected here again, against this module's server)
    test_drop_reconnect_resume_has_no_gap_or_duplicate,
    test_resume_after_completion_reads_the_ledger,
    test_sixteen_multiplexed_requests_equal_each_alone,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 0, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    db = tmp_path_factory.mktemp("ledger-spec") / "spec.db"
    proc = ServerProcess(demo_model, db, "--stream-retention", "1.0", "--speculative-config", json.dumps(SPEC))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def test_delta_frames_carry_several_tokens_and_metrics_count_them(server: ServerProcess) -> None:
    async def main() -> list[dict]:
        async with WsClient(server.ws_url) as ws:
            # (the demo model repeats itself on this prompt, so proposals get accepted)
            got = await ws.run({"s": {"kind": "completion", "prompt": "Resume me",
                                      "params": {"max_tokens": 64, "temperature": 0, "ignore_eos": True}}})
        return got["s"]

    frames = asyncio.run(main())
    deltas = [f for f in frames if f["type"] == "delta"]
    assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == len(tokens_of(deltas)) == 64
    assert max(len(f["token_ids"]) for f in deltas) > 1, "no step emitted more than one token"
    seqs = [f["seq"] for f in deltas]
    assert seqs == sorted(set(seqs))
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("pagewire_spec_decode") and " " in line}
    assert values["pagewire_spec_decode_accepted_tokens_total"] > 0
    assert values["pagewire_spec_decode_proposed_tokens_total"] >= values["pagewire_spec_decode_accepted_tokens_total"]
    assert values['pagewire_spec_decode_acceptance_rate_by_position{position="0"}'] > 0
    assert values["pagewire_spec_decode_mean_accepted_length"] > 1.0


def test_bad_speculative_config_is_a_clean_cli_error() -> None:
    for value, field in (('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                         ("not json", "speculative_config")):
        p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--speculative-config", value],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        assert "--speculative-config" in p.stderr and field in p.stderr and "Traceback" not in p.stderr
