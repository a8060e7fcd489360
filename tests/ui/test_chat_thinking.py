"""The chat page with a reasoning model (tests/thinking_model.py, its parser picked from the chat
template): the thinking is shown folded under "Thinking", the answer below it, and a click opens
the thinking (and keeps it open while the page repaints). Both texts are the server's own
non-streamed greedy answer's `reasoning_content` and `content`."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import httpx
import pytest

from tests.server.harness import ServerProcess
from tests.thinking_model import make_thinking_model
from tests.ui.page import ChatPage


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_thinking_model(tmp_path_factory.mktemp("ui-thinking") / "qwen3-think")["path"]
    with ServerProcess(model, tmp_path_factory.mktemp("ui-thinking-ledger") / "t.db") as proc:
        yield proc


def test_thinking_is_folded_and_opens_on_click(thinking_server: ServerProcess,
                                               open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(thinking_server.base)
    page.set_params(max_tokens="24")
    page.send("What is the capital of France?")
    page.wait_state("done")
    ref: dict[str, Any] = httpx.post(thinking_server.base + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
        "temperature": 0, "top_p": 1}).json()["choices"][0]["message"]
    assert ref["reasoning_content"] and ref["content"]
    answer = page.last_answer()
    assert answer["reasoning"] == ref["reasoning_content"] and answer["content"] == ref["content"]

    art = page.last_article()
    details = art.find_element("css selector", "details.thinking")
    assert details.get_attribute("open") is None  # folded
    summary = details.find_element("css selector", "summary")
    assert summary.text == "Thinking"
    assert page.shown_text(art) == page.rendered_text_of(ref["content"])  # the answer, apart
    summary.click()
    page.wait(lambda d: page.last_article().find_element("css selector", "details.thinking")
              .get_attribute("open") is not None, "the thinking to open")
    shown = page.d.execute_script(
        "const d = [...document.querySelectorAll('article.msg.assistant')].pop().querySelector('details.thinking');"
        "return [...d.childNodes].filter(n => n.tagName !== 'SUMMARY').map(n => n.textContent).join('');")
    assert shown == page.rendered_text_of(ref["reasoning_content"])
    # The open state is the reader's, for this page only: after a reload it is folded again.
    page.reload()
    art = page.last_article()
    assert art.find_element("css selector", "details.thinking").get_attribute("open") is None  # fresh page: folded
