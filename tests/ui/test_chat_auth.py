"""The chat page against a server that requires API keys: without a key (or with a wrong one) the
page says so plainly and does not spin reconnecting; with a valid key, typed under Settings and
kept in localStorage, it connects (the key travels as a WebSocket subprotocol), answers, and
still has the key after a reload."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.gateway.test_isolation_live import _create
from tests.server.harness import ServerProcess, ledger_rows
from tests.ui.page import ChatPage


@pytest.fixture
def keyed_server(real_model: Path, tmp_path: Path) -> Iterator[tuple[ServerProcess, str, str]]:
    db = tmp_path / "keyed.db"
    key_id, secret = _create(db, "browser")
    with ServerProcess(real_model, db) as proc:
        yield proc, key_id, secret


def test_page_asks_for_a_key_then_works_with_it(keyed_server: tuple[ServerProcess, str, str], browser: Any) -> None:
    srv, key_id, secret = keyed_server
    page = ChatPage(browser, srv.base)
    browser.get(srv.base + "/")
    page.wait(lambda d: "needs an API key" in page.conn_text(), "the page to say a key is needed")
    assert "invalid_api_key" not in page.conn_text() and "Settings" in page.conn_text()

    page.set_field("api-key", secret[:-3] + "zzz")
    page.wait(lambda d: "API key refused" in page.conn_text(), "the page to say the key was refused")
    assert "incorrect API key" in page.conn_text()

    page.set_field("api-key", secret)
    page.wait(lambda d: page.conn_text() == "connected", "the page to connect with the key")
    assert browser.execute_script("return localStorage.getItem('pagewire.apikey')") == secret
    page.wait(lambda d: page.by_css("#model").text.startswith("demo"), "the model name (/v1/models with the key)")

    page.set_params(max_tokens="8")
    page.send("Hello")
    page.wait_state("done")
    rid = page.last_answer()["gen"]["request_id"]
    assert ledger_rows(srv.db)[rid]["key_id"] == key_id

    page.reload()  # ChatPage.reload waits for "connected": the key came back from localStorage
    assert page.by_css("#api-key").get_attribute("value") == secret
