"""Driving the chat page the way a user does (keyboard, buttons), and reading what it shows.

Every wait is on a DOM condition (WebDriverWait), never on time passing. The page's own
state is read from its localStorage record, the same bytes it restores after a reload.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import httpx

STORE = "pagewire.chat.v1"
WAIT_S = 180.0  # a generous ceiling for a loaded 2-core machine; the waits end on conditions


class ChatPage:
    def __init__(self, driver: Any, base: str) -> None:
        self.d = driver
        self.base = base

    # -- navigation -------------------------------------------------------------------------------
    def open(self) -> "ChatPage":
        self.d.get(self.base + "/")
        self.wait(lambda d: self.conn_text() == "connected", "the page to connect")
        return self

    def reload(self) -> None:
        self.d.refresh()
        self.wait(lambda d: self.conn_text() == "connected", "the page to reconnect after reload")

    # -- waiting ----------------------------------------------------------------------------------
    def wait(self, cond: Callable[[Any], Any], what: str, timeout: float = WAIT_S) -> Any:
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.d, timeout, poll_frequency=0.05).until(cond)
        except TimeoutException:
            raise AssertionError(f"timed out waiting for {what}; the page says: {self.diagnose()}") from None

    def diagnose(self) -> str:
        """What the page shows now, for a failure message."""
        try:
            arts = self.all_css("article.msg")
            last = arts[-1].get_attribute("outerHTML")[-1500:] if arts else "no messages"
            return f"conn={self.conn_text()!r} messages={len(arts)} last={last}"
        except Exception as e:  # noqa: BLE001 - best effort
            return f"(could not read the page: {e})"

    def by_css(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.d.find_element(By.CSS_SELECTOR, css)

    def all_css(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.d.find_elements(By.CSS_SELECTOR, css)

    # -- actions ----------------------------------------------------------------------------------
    def set_field(self, element_id: str, value: str) -> None:
        """Type into a settings field and leave it (Tab), which fires its change event."""
        from selenium.webdriver.common.keys import Keys

        el = self.by_css("#" + element_id)
        el.clear()
        el.send_keys(value, Keys.TAB)

    def set_params(self, temperature: str = "0", top_p: str = "1", max_tokens: str = "32") -> None:
        self.set_field("temperature", temperature)
        self.set_field("top-p", top_p)
        self.set_field("max-tokens", max_tokens)
        self.wait(lambda d: self.store()["settings"]["max_tokens"] == int(max_tokens), "settings to save")

    def send(self, text: str) -> None:
        """Type a message and press Enter, as a keyboard user does."""
        from selenium.webdriver.common.keys import Keys

        n = len(self.all_css("article.msg.assistant"))
        box = self.by_css("#input")
        box.click()
        box.send_keys(text, Keys.ENTER)
        self.wait(lambda d: len(self.all_css("article.msg.assistant")) == n + 1, "the answer to start")

    def escape(self) -> None:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        ActionChains(self.d).send_keys(Keys.ESCAPE).perform()

    def click_action(self, label: str, index: int = -1) -> None:
        """Click a message action button by its accessible label (e.g. 'Regenerate this answer')."""
        buttons = self.all_css(f'button[aria-label="{label}"]')
        assert buttons, f"no button labelled {label!r}"
        buttons[index].click()

    # -- reading ----------------------------------------------------------------------------------
    def conn_text(self) -> str:
        return self.by_css("#conn").text

    def store(self) -> dict[str, Any]:
        raw = self.d.execute_script(f"return localStorage.getItem('{STORE}')")
        return json.loads(raw) if raw else {}

    def conversation(self) -> dict[str, Any]:
        s = self.store()
        return s["convs"][s["current"]]

    def last_answer(self) -> dict[str, Any]:
        return [m for m in self.conversation()["messages"] if m["role"] == "assistant"][-1]

    def last_article(self) -> Any:
        return self.all_css("article.msg.assistant")[-1]

    def last_state(self) -> Optional[str]:
        arts = self.all_css("article.msg.assistant")
        return arts[-1].get_attribute("data-state") if arts else None

    def last_seq(self) -> int:
        return int(self.last_article().get_attribute("data-seq") or 0)

    def wait_state(self, *states: str, timeout: float = WAIT_S) -> str:
        return self.wait(lambda d: self.last_state() in states and self.last_state(), f"answer state in {states}",
                         timeout)

    def wait_seq(self, seq: int) -> None:
        """Until the page shows and has saved the answer up to delta `seq`."""
        self.wait(lambda d: self.last_seq() >= seq and self.last_answer()["gen"]["seq"] >= seq,
                  f"the answer to reach seq {seq}")

    def rendered_text_of(self, markdown: str) -> str:
        """The text the page's own renderer makes of `markdown` (to compare with what it shows)."""
        return self.d.execute_script(
            "const d = document.createElement('div'); d.append(PagewireMarkdown.render(arguments[0]));"
            "return d.textContent;", markdown)

    def last_part(self, css: str) -> dict[str, Optional[str]]:
        """Text and role of one part (`.notice`, `.body`) of the last answer, read in one script call.

        The page rebuilds a message's parts on every change (the busy countdown ticks each second),
        so a WebElement held across two calls can go stale; one call reads a consistent snapshot.
        """
        got = self.d.execute_script(
            "const a = [...document.querySelectorAll('article.msg.assistant')].pop();"
            "const e = a && a.querySelector(arguments[0]);"
            "return e ? {text: e.innerText, role: e.getAttribute('role')} : null;", css)
        assert got is not None, f"the last answer has no {css}; the page says: {self.diagnose()}"
        return got

    def shown_text(self, article: Any) -> str:
        return self.d.execute_script("return arguments[0].querySelector('.body').textContent;", article)


# The chat tests compare what the page shows with the API's answer to the same greedy request on
# the same server, whose prompt is then a prefix-cache hit (its tail prefilled in fewer rows). With
# the real model served from its Q4_1 blocks (`--quantization auto`) the row count changes the kernel
# path, so only batch-invariant mode makes the two answers the same text on every CPU kind.
UI_ENGINE: tuple[str, ...] = ("--deterministic", "on")


def greedy_chat(base: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The non-streamed answer of the same greedy request, over HTTP, as the reference."""
    r = httpx.post(base + "/v1/chat/completions", timeout=300,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, "top_p": 1})
    r.raise_for_status()
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], "usage": body["usage"]}
