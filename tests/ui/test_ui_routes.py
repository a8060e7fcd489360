"""The page's routes: served at / with a strict CSP, its files under /ui/, and gone with --no-ui."""
from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from server.serving.settings import add_serve_arguments, settings_from_args
from tests.server.harness import ServerProcess


def test_page_and_assets_are_served(ui_server: ServerProcess) -> None:
    r = httpx.get(ui_server.base + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert '<script src="/ui/chat.js"' in r.text and "://" not in r.text  # nothing from another origin
    for name, kind in (("chat.js", "javascript"), ("chat_view.js", "javascript"), ("markdown.js", "javascript"),
                       ("chat.css", "text/css")):
        a = httpx.get(f"{ui_server.base}/ui/{name}")
        assert a.status_code == 200 and kind in a.headers["content-type"], name
    missing = httpx.get(ui_server.base + "/ui/nope.js")
    assert missing.status_code == 404
    # The API keeps its own routes and errors.
    assert httpx.post(ui_server.base + "/", json={}).status_code == 405
    assert httpx.get(ui_server.base + "/v1/models").json()["data"][0]["id"] == "demo"


def test_no_ui_turns_the_page_off(demo_model: Path, tmp_path: Path) -> None:
    with ServerProcess(demo_model, tmp_path / "l.db", "--no-ui") as proc:
        r = httpx.get(proc.base + "/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"
        assert httpx.get(proc.base + "/ui/chat.js").status_code == 404
        assert httpx.get(proc.base + "/health").status_code == 200


def test_ui_setting_from_flag_and_environment() -> None:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert settings_from_args(p.parse_args([]), {}).ui is True
    assert settings_from_args(p.parse_args(["--no-ui"]), {}).ui is False
    assert settings_from_args(p.parse_args([]), {"PAGEWIRE_UI": "0"}).ui is False
    assert settings_from_args(p.parse_args(["--ui"]), {"PAGEWIRE_UI": "0"}).ui is True
