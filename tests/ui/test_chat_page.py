"""The chat page in a real headless Chromium against a live server (demo model).

These share one server per module; tests that must restart or reconfigure it live in
test_chat_failures.py. The browser always talks through a CuttableProxy, so a test can hold
the answer at a known point and drop the connection the way a network does.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from tests.server.harness import ServerProcess, ledger_rows
from tests.ui.page import ChatPage, greedy_chat
from tests.ui.proxy import CuttableProxy

SYSTEM = "You answer briefly."


def test_streamed_answer_equals_greedy_reference_multi_turn(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(proxy.base)
    page.set_params(max_tokens="40")
    page.by_css("#system").send_keys(SYSTEM)
    page.send("Hello there")
    page.wait_state("done")

    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    ref = greedy_chat(ui_server.base, history, 40)
    answer = page.last_answer()
    assert answer["content"] == ref["text"]
    assert answer["stats"]["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    # What is on screen is the page's markdown rendering of exactly that text.
    assert page.shown_text(page.last_article()) == page.rendered_text_of(ref["text"])
    stats = page.last_article().find_element("css selector", ".stats").text
    assert "TTFT" in stats and "tok/s" in stats
    assert f"{ref['usage']['prompt_tokens']} prompt + {ref['usage']['completion_tokens']} tokens" in stats

    # Second turn: the server applies the chat template to the whole history.
    page.send("And then?")
    page.wait_state("done")
    history += [{"role": "assistant", "content": ref["text"]}, {"role": "user", "content": "And then?"}]
    ref2 = greedy_chat(ui_server.base, history, 40)
    assert page.last_answer()["content"] == ref2["text"]

    # Regenerate a greedy answer: the same text again, and the conversation keeps its length.
    page.click_action("Regenerate this answer")
    page.wait_state("done")
    conv = page.conversation()
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conv["messages"][-1]["content"] == ref2["text"]

    # Edit the first message and resend: everything after it is replaced.
    page.click_action("Edit and resend this message", 0)
    area = page.by_css('textarea[aria-label="Edit message"]')
    area.clear()
    from selenium.webdriver.common.keys import Keys

    area.send_keys("Tell me about cats", Keys.ENTER)
    page.wait(lambda d: len(page.conversation()["messages"]) == 2, "the edited conversation")
    page.wait_state("done")
    ref3 = greedy_chat(ui_server.base, [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": "Tell me about cats"}], 40)
    conv = page.conversation()
    assert conv["messages"][0]["content"] == "Tell me about cats"
    assert conv["messages"][1]["content"] == ref3["text"]
