"""docs/chat-ui.md describes the page that ships: every browser-storage key chat.js uses is named
there (the API-key field was once documented as missing while the page had one)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_storage_key_of_the_page_is_documented() -> None:
    js = (REPO / "server/api/static/chat.js").read_text()
    doc = (REPO / "docs/chat-ui.md").read_text()
    keys = set(re.findall(r'"(pagewire\.[a-z0-9.]+)"', js))
    assert {"pagewire.apikey"} <= keys
    assert not [k for k in keys if f"`{k}`" not in doc]
    assert "no API keys yet" not in doc
