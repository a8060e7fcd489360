"""/metrics for Prometheus once keys exist: the metrics token (--metrics-key-file) reads /metrics
and nothing else; the --metrics-port listener serves /metrics alone, open or behind the token.
Each scrape is what Prometheus sends (its Accept header, a bearer token from a file) over real
HTTP to a `pagewire serve` process, parsed with prometheus_client's own text parser."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import ServerProcess, free_port

# Prometheus 2.x/3.x scrape headers (scrape/scrape.go: acceptHeader, the timeout header).
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "User-Agent": "Prometheus/2.53.0",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
}
TOKEN = "metrics-token-0123456789"


def scrape(url: str, token: Optional[str] = None) -> httpx.Response:
    headers = dict(PROMETHEUS_HEADERS)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.get(url, headers=headers, timeout=30)


def families(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def test_metrics_token_and_metrics_port(demo_model: Path, tmp_path: Path, make_key: Any) -> None:
    db = tmp_path / "m.db"
    _kid, secret = make_key(db, "app")  # a key exists: auth is on, /metrics is admin-only
    token_file = tmp_path / "metrics.token"
    token_file.write_text(TOKEN + "\n")
    metrics_port = free_port()
    srv = ServerProcess(demo_model, db, "--metrics-key-file", str(token_file)).start()
    try:
        main = srv.base + "/metrics"
        assert scrape(main).status_code == 401
        forbidden = scrape(main, secret)
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "permission_denied"
        got = families(scrape(main, TOKEN))
        assert "pagewire_requests_running" in got and "pagewire_time_to_first_token_seconds" in got
        # The token reads /metrics only.
        for path in ("/v1/models", "/v1/usage"):
            r = httpx.get(srv.base + path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = httpx.post(srv.base + "/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"model": "demo", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 401
    finally:
        srv.stop()

    # The metrics listener, open (no token configured): Prometheus needs nothing but the address.
    srv = ServerProcess(demo_model, db, "--metrics-port", str(metrics_port)).start()
    try:
        listener = f"http://127.0.0.1:{metrics_port}"
        r = httpx.post(srv.base + "/v1/completions", headers={"Authorization": f"Bearer {secret}"},
                       json={"model": "demo", "prompt": "count me", "max_tokens": 3})
        assert r.status_code == 200, r.text
        got = families(scrape(listener + "/metrics"))
        samples = [s for f in got.values() for s in f.samples if s.name.startswith("pagewire_")]
        assert samples
        assert scrape(srv.base + "/metrics").status_code == 401  # the API port keeps its rule
        # Only /metrics on that port: the API is not reachable through it, keyed or not.
        r = httpx.get(listener + "/v1/models", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"
        assert httpx.post(listener + "/v1/completions", json={"prompt": "x"}).status_code == 404
        assert httpx.post(listener + "/metrics").status_code == 405
        assert httpx.get(listener + "/health").status_code == 404
    finally:
        srv.stop()

    # The listener behind the token.
    srv = ServerProcess(demo_model, db, "--metrics-port", str(metrics_port), "--metrics-key-file",
                        str(token_file)).start()
    try:
        listener = f"http://127.0.0.1:{metrics_port}/metrics"
        assert scrape(listener).status_code == 401
        assert scrape(listener, secret).status_code == 401
        families(scrape(listener, TOKEN))
    finally:
        srv.stop()
