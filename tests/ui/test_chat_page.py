"""The chat page in a real headless Chromium against a live server on the real default model.

These share one server per module; tests that must restart or reconfigure it live in
test_chat_failures.py. The browser always talks through a CuttableProxy, so a test can hold
the answer at a known point and drop the connection the way a network does.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from tests.server.harness import ServerProcess, ledger_rows
from tests.ui.page import ChatPage, greedy_chat
from tests.ui.proxy import CuttableProxy

SYSTEM = "You answer briefly."
# SmolLM2 answers this with a story of several hundred tokens (greedy), so an answer asked for
# with a larger max_tokens is still streaming when a test stops, cuts or reloads it.
STORY = "Tell me a story"
DRAGON = "Write a very long story about a dragon who learns to cook."


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


def test_stop_mid_stream_cancels_the_request(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(proxy.base)
    page.set_params(max_tokens="1500")
    proxy.hold_after(4)  # accepted + 3 deltas reach the page, the rest is held
    page.send(STORY)
    page.wait_seq(3)
    assert page.last_state() == "streaming"
    assert page.by_css("#stop").is_displayed() and not page.by_css("#send").is_displayed()
    page.escape()  # Esc stops, as the Stop button does
    page.wait(lambda d: page.last_answer()["gen"].get("cancel"), "the cancel to be sent")
    proxy.release()
    page.wait_state("cancelled")
    answer = page.last_answer()
    row = ledger_rows(ui_server.db)[answer["gen"]["request_id"]]
    assert row["state"] == "cancelled"
    assert 3 <= row["completion_tokens"] < 1500
    assert answer["stats"]["usage"]["completion_tokens"] == row["completion_tokens"]
    # The held deltas arrived before the done, so the page shows what the ledger stored.
    assert answer["content"] == row["output_text"]


def test_cut_mid_stream_resumes_without_gap_or_duplicate(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage],
        tmp_path: Path) -> None:
    page = open_page(proxy.base)
    page.set_params(max_tokens="120")
    proxy.hold_after(31)  # accepted + 30 deltas
    page.send(STORY)
    page.wait_seq(30)
    before = page.last_answer()["content"]
    shot = Path(os.environ.get("PAGEWIRE_UI_SCREENSHOT", tmp_path / "chat.png"))
    page.d.save_screenshot(str(shot))  # mid-answer, typing cursor showing (docs/chat.png)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.last_article().find_elements("css selector", ".cursor")
    proxy.cut()  # the network drops: everything held is lost
    page.wait_state("done")

    ref = greedy_chat(ui_server.base, [{"role": "user", "content": STORY}], 120)
    answer = page.last_answer()
    assert before and len(before) < len(ref["text"]) and ref["text"].startswith(before)
    assert answer["content"] == ref["text"]
    assert answer["gen"]["resumes"] >= 1
    assert page.shown_text(page.last_article()) == page.rendered_text_of(ref["text"])


def test_two_answers_at_once_on_one_socket_both_resume_after_a_cut(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(proxy.base)
    # 160 tokens: both answers are still streaming when the page has seen three deltas of the
    # second (the first has 150+ tokens to go), and two answers plus two references of 300 tokens
    # were this suite's slowest test.
    page.set_params(max_tokens="160")
    page.send(DRAGON)
    page.wait_seq(3)
    first_id = page.store()["current"]
    page.by_css("#new-chat").click()
    page.send(STORY)
    page.wait_seq(3)
    proxy.hold_after(0)  # freeze what the page sees: both answers are mid-stream
    convs = page.store()["convs"]
    assert [c["messages"][-1]["gen"]["state"] for c in convs.values()] == ["streaming", "streaming"]
    proxy.cut()
    page.wait_state("done")
    page.wait(lambda d: page.store()["convs"][first_id]["messages"][-1]["gen"]["state"] == "done",
              "the other conversation's answer to finish in the background")
    for conv in page.store()["convs"].values():
        prompt = conv["messages"][0]["content"]
        ref = greedy_chat(ui_server.base, [{"role": "user", "content": prompt}], 160)
        assert conv["messages"][1]["content"] == ref["text"], prompt
        assert conv["messages"][1]["gen"]["resumes"] >= 1


def test_reload_mid_answer_picks_the_answer_up_where_it_was(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(proxy.base)
    page.set_params(max_tokens="100")
    proxy.hold_after(11)
    page.send(DRAGON)
    page.wait_seq(10)
    page.reload()  # the stored answer (text up to seq 10, request id) is resumed by the new page
    page.wait_state("done")
    ref = greedy_chat(ui_server.base, [{"role": "user", "content": DRAGON}], 100)
    answer = page.last_answer()
    assert answer["content"] == ref["text"] and answer["gen"]["resumes"] == 1
    assert page.shown_text(page.last_article()) == page.rendered_text_of(ref["text"])


def test_cut_after_the_answer_finished_gets_the_rest_from_the_server(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(proxy.base)
    page.set_params(max_tokens="60")
    proxy.hold_after(4)
    page.send(STORY)
    page.wait_seq(3)
    rid = page.last_answer()["gen"]["request_id"]
    # The request finishes on the server while the page sees nothing more.
    page.wait(lambda d: ledger_rows(ui_server.db)[rid]["state"] == "finished", "the ledger row to finish")
    assert page.last_state() == "streaming"
    proxy.cut()
    page.wait_state("done")
    ref = greedy_chat(ui_server.base, [{"role": "user", "content": STORY}], 60)
    assert page.last_answer()["content"] == ref["text"]
    assert page.last_answer()["content"] == ledger_rows(ui_server.db)[rid]["output_text"]


HOSTILE = (
    "# Title\n\nSome **bold**, *em*, `x<y>` and [a link](https://example.com/a?b=1).\n\n"
    "<script>window.__pwned = 1</script>\n"
    "<img src=x onerror=\"window.__pwned = 2\"> [click](javascript:window.__pwned=3)\n\n"
    "- one <b>two</b>\n- three\n\n"
    "```html\n<script>window.__pwned = 4</script>\n<p onclick=\"x()\">hi</p>\n```\n"
)


def _assert_inert(page: ChatPage, root_js: str) -> None:
    bad = page.d.execute_script(f"""
        const root = {root_js};
        const out = [];
        for (const e of root.querySelectorAll('*')) {{
          if (!['ARTICLE','H3','P','STRONG','EM','CODE','A','UL','OL','LI','BR','DIV','SPAN','PRE','BUTTON','BLOCKQUOTE','HR']
               .includes(e.tagName)) out.push('tag ' + e.tagName);
          for (const a of e.attributes) if (/^on/i.test(a.name)) out.push('attr ' + a.name);
          if (e.tagName === 'A' && !/^https?:/.test(e.getAttribute('href'))) out.push('href ' + e.getAttribute('href'));
        }}
        return out;""")
    assert bad == []
    assert page.d.execute_script("return window.__pwned") is None


def test_model_output_is_rendered_inert(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(proxy.base)
    # 1. The page's markdown function on hostile text.
    page.d.execute_script("window.__box = document.createElement('div');"
                          "window.__box.append(PagewireMarkdown.render(arguments[0]));"
                          "document.body.append(window.__box);", HOSTILE)
    _assert_inert(page, "window.__box")
    text = page.d.execute_script("return window.__box.textContent")
    assert "<script>window.__pwned = 1</script>" in text and 'onerror="window.__pwned = 2"' in text
    tags = page.d.execute_script("return [...window.__box.querySelectorAll('h3,strong,em,code,a,li,pre')]"
                                 ".map(e => e.tagName + ':' + e.textContent)")
    assert "H3:Title" in tags and "STRONG:bold" in tags and "EM:em" in tags and "CODE:x<y>" in tags
    assert "A:a link" in tags and "LI:one <b>two</b>" in tags
    assert any(t.startswith("PRE:<script>") for t in tags)
    assert page.d.execute_script("return window.__box.querySelector('a').href") == "https://example.com/a?b=1"

    # 2. A real answer whose stored text is hostile, through the page's own message rendering
    #    (as after a reload), then a real stream in the same conversation.
    page.set_params(max_tokens="12")
    page.send("Hi")
    page.wait_state("done")
    # Edit the stored conversation from another document of the same origin, so the page's
    # own save-on-leave cannot overwrite it; then open the page again.
    page.d.get(page.base + "/health")
    page.d.execute_script("""
        const s = JSON.parse(localStorage.getItem('pagewire.chat.v1'));
        const c = s.convs[s.current];
        c.messages[1].content = arguments[0];
        c.messages.push({role: 'user', content: arguments[0]});
        localStorage.setItem('pagewire.chat.v1', JSON.stringify(s));""", HOSTILE)
    page.open()
    assert len(page.all_css("article.msg")) == 3
    page.send("More")
    page.wait_state("done")
    _assert_inert(page, "document.getElementById('messages')")
    assert len(page.all_css("#messages pre")) == 1  # the assistant's fence; the user's text stays plain
    # The code block's Copy button copies its text.
    page.by_css("#messages .code .copy").click()
    page.wait(lambda d: page.by_css("#messages .code .copy").text == "Copied", "the copy confirmation")


def test_two_conversations_survive_a_reload(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    page = open_page(proxy.base)
    page.set_params(max_tokens="8")
    page.send("First conversation")
    page.wait_state("done")
    first = page.conversation()
    page.by_css("#new-chat").click()
    page.by_css("#system").send_keys("Be kind.")
    page.send("Second conversation")
    page.wait_state("done")
    second = page.conversation()
    from selenium.webdriver.support.ui import Select

    Select(page.by_css("#theme")).select_by_value("dark")

    page.reload()
    titles = [b.text for b in page.all_css("#conv-list .open")]
    assert titles == ["Second conversation", "First conversation"]
    assert page.d.execute_script("return document.documentElement.dataset.theme") == "dark"
    assert page.by_css("#system").get_attribute("value") == "Be kind."
    assert page.conversation()["messages"] == second["messages"]
    page.all_css("#conv-list .open")[1].click()
    page.wait(lambda d: page.by_css("#conv-title").text == "First conversation", "the first conversation")
    shown = [a.find_element("css selector", ".body").text for a in page.all_css("article.msg")]
    assert shown[0] == "First conversation"
    assert page.shown_text(page.last_article()) == page.rendered_text_of(first["messages"][1]["content"])
    assert page.by_css("#system").get_attribute("value") == ""


def test_keyboard_and_phone_width(
        ui_server: ServerProcess, proxy: CuttableProxy, open_page: Callable[[str], ChatPage]) -> None:
    from selenium.webdriver.common.keys import Keys

    page = open_page(proxy.base)
    page.set_params(max_tokens="300")
    page.d.set_window_size(390, 844)
    page.wait(lambda d: page.by_css("#menu").is_displayed(), "the phone layout")
    sidebar_x = "return document.getElementById('sidebar').getBoundingClientRect().right"
    page.wait(lambda d: page.d.execute_script(sidebar_x) <= 0, "the sidebar to slide off-canvas")
    assert not page.by_css("#new-chat").is_displayed()
    assert page.by_css("#input").is_displayed() and page.by_css("#send").is_displayed()
    assert page.d.execute_script("return document.documentElement.scrollWidth") <= 390
    page.by_css("#menu").click()
    page.wait(lambda d: page.d.execute_script(sidebar_x) > 200, "the sidebar to open")
    assert page.by_css("#menu").get_attribute("aria-expanded") == "true"
    page.by_css("#close-menu").click()
    page.wait(lambda d: page.d.execute_script(sidebar_x) <= 0, "the sidebar to close")

    # Shift+Enter is a newline, Enter sends.
    box = page.by_css("#input")
    box.click()
    box.send_keys(STORY, Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "about a dragon.")
    assert box.get_attribute("value") == STORY + "\nabout a dragon."
    assert not page.all_css("article.msg")
    box.send_keys(Keys.ENTER)
    page.wait_state("done")
    assert page.conversation()["messages"][0]["content"] == STORY + "\nabout a dragon."
    # A long answer scrolls inside the message list: the composer stays on screen, and the list
    # followed the answer to its end.
    fits = page.d.execute_script("""
        const m = document.getElementById('messages');
        return [document.getElementById('composer').getBoundingClientRect().bottom <= innerHeight + 1,
                m.scrollHeight > m.clientHeight, m.scrollHeight - m.scrollTop - m.clientHeight < 2];""")
    assert fits == [True, True, True]
    # Every control has a label a screen reader can read.
    unlabeled = page.d.execute_script("""
        return [...document.querySelectorAll('input, textarea, select, button')].filter(e =>
          !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim()).map(e => e.outerHTML);""")
    assert unlabeled == []
    # Focus is visible: the focused control gets an outline.
    box.click()
    page.d.switch_to.active_element.send_keys(Keys.TAB)
    outline = page.d.execute_script("return getComputedStyle(document.activeElement).outlineStyle")
    assert outline not in ("", "none")
