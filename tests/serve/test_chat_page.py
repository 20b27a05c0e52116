"""The chat page at ``/`` in a real browser: Debian's headless Chromium driven by selenium.

Needs the ``chromium`` and ``chromium-driver`` packages (``.ci/run`` installs them when
missing); selenium is given their paths, so it never tries to download a browser.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

LiveServer = Callable[..., str]  # tests/serve/conftest.py's live_server


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path, removed after the test: Chromium's singleton
    socket lives in it, and a Unix socket's path must stay under 108 bytes (pytest's
    ``tmp_path`` under xdist is too long: the browser then exits at start)."""
    with tempfile.TemporaryDirectory(prefix="infer-chrome-") as tmp:
        yield Path(tmp)


def _browser(tmp: Path) -> Any:
    """Headless Chromium whose profile and temporary files live under ``tmp`` (by default it
    leaves an ``org.chromium.Chromium.*`` directory in /tmp after ``quit()``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None
    )
    if chromium is None or driver is None:
        pytest.fail(
            "headless Chromium is needed for this test: apt-get install chromium chromium-driver "
            f"(.ci/run does); found chromium={chromium}, chromedriver={driver}"
        )
    os.environ["SE_OFFLINE"] = "1"  # selenium-manager must not try to download anything
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--no-first-run", "--disable-extensions", "--window-size=1000,800",
                 # no crash handler: Chromium's crashpad daemon outlives browser.quit() otherwise
                 "--disable-crash-reporter", "--disable-breakpad"):  # fmt: skip
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp / 'profile'}")
    service = Service(executable_path=driver, env={**os.environ, "TMPDIR": str(tmp)})
    return webdriver.Chrome(service=service, options=options)


@pytest.mark.slow
def test_chat_page_streams_a_reply(live_server: LiveServer, tiny_llm: Any, short_tmp: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base = live_server(tiny_llm)
    browser = _browser(short_tmp)
    try:
        browser.get(base + "/")
        assert browser.title == "infer chat"
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text not in ("", "…"))
        model = browser.find_element(By.ID, "model").text
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("48")
        browser.find_element(By.ID, "temperature").clear()
        browser.find_element(By.ID, "temperature").send_keys("0")
        browser.find_element(By.ID, "input").send_keys("Hello there")
        browser.find_element(By.ID, "send").click()
        seen: list[str] = []  # the reply's text each time we looked: it grows while streaming

        def done(b: Any) -> bool:
            replies = b.find_elements(By.CSS_SELECTOR, ".msg.assistant")
            if not replies:
                return False
            text = replies[-1].text.removeprefix("model: ")
            if not seen or seen[-1] != text:
                seen.append(text)
            return bool(replies[-1].get_attribute("data-done") == "true")

        start = time.monotonic()
        WebDriverWait(browser, 60, poll_frequency=0.01).until(done)
        user = browser.find_element(By.CSS_SELECTOR, ".msg.user").text
        reply = (
            browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].get_attribute("textContent") or ""
        )
        errors = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".msg.error")]
        expected = tiny_llm.chat([{"role": "user", "content": "Hello there"}], max_new_tokens=48).text
        print(f"model {model!r}; user {user!r}; reply {reply!r} after {time.monotonic() - start:.2f} s; "
              f"{len(seen)} states seen; errors {errors}")  # fmt: skip
        assert not errors
        assert "Hello there" in user
        assert reply == expected and reply.strip()
        partial = [s for s in seen if 0 < len(s) < len(expected) and expected.startswith(s)]
        assert partial, f"the reply appeared all at once (states seen: {seen!r}); it should stream"
    finally:
        browser.quit()
