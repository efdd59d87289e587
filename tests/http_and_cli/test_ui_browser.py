"""The operator page in a real browser: Debian's Chromium, headless, through Selenium, against ``kvmem serve``.

One ``kvmem serve`` on tiny-llama (a real process with its own home, on a fixed loopback
port so that it can be restarted under the page) with two tenants' keys: ``ops`` (an
operator) and ``globex``. The page signs in only with a key; chatting through it streams a
reply and shows the turn's tier and reuse; the new agent appears hot; after a restart of the
server, without reloading the page, it is warm; forgetting it (with the confirmation) removes
it; and a tenant's page never lists another tenant's agent. Skipped, with the reason, where
Chromium, chromedriver or Selenium is missing (``.ci/setup`` installs them).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from conftest import models_dir
from serve_process import ServeProcess, kvmem_serve

from benches.chromium import missing, open_chromium

WHY_NOT = missing()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no browser to drive: {WHY_NOT}")

KEY_OPS = "kvmem-browser-ops-0123456789"
KEY_GLOBEX = "kvmem-browser-globex-0123456789"
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Served:
    """``kvmem serve`` on one home and one port, restartable."""

    def __init__(self, home: Path) -> None:
        keys = home / "keys.toml"
        keys.write_text(f'[keys]\n"{KEY_OPS}" = "ops"\n"{KEY_GLOBEX}" = "globex"\n\n[tenants.ops]\noperator = true\n')
        keys.chmod(0o600)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "KVMEM_HOME": str(home), "KVMEM_MODELS_DIR": str(models_dir())}
        self.args = ("--model", "tiny-llama", "--port", str(self.port), "--api-keys", str(keys), "--prewarm-mb", "0")
        self._stack = ExitStack()
        self.process: ServeProcess | None = None

    def start(self) -> None:
        self.process = self._stack.enter_context(kvmem_serve(*self.args, env=self.env))
        assert self.process.url.rstrip("/") == self.url

    def stop(self) -> None:
        self._stack.close()  # SIGTERM: the caches are flushed, the status must be 0
        self._stack = ExitStack()

    def turn(self, key: str, agent: str, text: str) -> None:
        response = httpx.post(f"{self.url}/v1/agents/{agent}/messages", headers={"x-api-key": key}, timeout=60,
                              json={"messages": [{"role": "user", "content": text}], "max_tokens": 2})
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = Served(tmp_path_factory.mktemp("ui-browser"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with open_chromium(width=1280, height=900) as driver:
        yield driver


def _wait(driver: Any, what: str, condition: Callable[[], T], timeout: float = 20.0) -> T:
    """``condition()`` once it is truthy; fails naming ``what`` (and the browser's console) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            console = driver.get_log("browser") if hasattr(driver, "get_log") else []
            pytest.fail(f"timed out waiting for {what}; browser console: {console}")
        time.sleep(0.1)


def _js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def _rows(driver: Any) -> dict[str, str]:
    """The agents table: agent id -> the tier its row shows."""
    rows = _js(driver, "return [...document.querySelectorAll('#agents-body tr')]"
                       ".map(r => [r.dataset.agent, r.querySelector('td.tier').dataset.tier])")
    return {agent: tier for agent, tier in rows}


def _visible(driver: Any, element_id: str) -> bool:
    return bool(_js(driver, f"const e = document.getElementById('{element_id}'); return !!e && !e.hidden "
                            "&& e.getClientRects().length > 0"))


def _open(driver: Any, url: str) -> None:
    driver.get("about:blank")  # a new document: the page's script starts afresh
    driver.get(url)


def test_without_a_key_the_page_is_a_sign_in_form_and_nothing_else(served: Served, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, served.url + "/ui")
    _wait(browser, "the sign-in form", lambda: _visible(browser, "signin"))
    assert not _visible(browser, "app")
    assert browser.current_url == served.url + "/ui/"
    browser.find_element(By.ID, "signin-key").send_keys("not-a-key-of-this-server")
    browser.find_element(By.ID, "signin-submit").click()
    _wait(browser, "the refusal", lambda: _visible(browser, "signin-error"))
    assert "not accepted" in browser.find_element(By.ID, "signin-error").text and not _visible(browser, "app")
    assert _js(browser, "return sessionStorage.getItem('kvmem.apiKey')") is None
    field = browser.find_element(By.ID, "signin-key")
    field.clear()
    field.send_keys(KEY_OPS)
    browser.find_element(By.ID, "signin-submit").click()
    _wait(browser, "the page after sign-in", lambda: _visible(browser, "app"))
    assert not _visible(browser, "signin")
    browser.find_element(By.ID, "signout").click()
    _wait(browser, "the sign-in form after signing out", lambda: _visible(browser, "signin"))
    assert _js(browser, "return sessionStorage.length") == 0


def test_a_chat_makes_an_agent_hot_a_restart_leaves_it_warm_and_forget_removes_it(
    served: Served, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, f"{served.url}/ui#key={KEY_OPS}")
    _wait(browser, "the page signed in by its link", lambda: _visible(browser, "app"))
    assert "key" not in browser.current_url and KEY_OPS not in browser.current_url  # the fragment is gone
    assert _js(browser, "return sessionStorage.getItem('kvmem.apiKey')") == KEY_OPS
    _wait(browser, "live figures", lambda: browser.find_element(By.ID, "conn-text").text == "Live")
    assert browser.find_element(By.ID, "fact-model").text == "tiny-llama"

    def send(text: str) -> str:
        browser.find_element(By.ID, "chat-input").send_keys(text)
        browser.find_element(By.ID, "chat-send").click()
        tier: str = _wait(browser, "the turn's tier", lambda: _js(
            browser, "return document.getElementById('chat-turn').dataset.tier"), timeout=60)
        return tier

    agent = browser.find_element(By.ID, "chat-agent")
    agent.clear()
    agent.send_keys("ada")
    browser.find_element(By.ID, "chat-max").clear()
    browser.find_element(By.ID, "chat-max").send_keys("6")
    assert send("Hello, my name is Ada. Please remember it.") == "cold"
    reply = _js(browser, "return [...document.querySelectorAll('#chat-log .msg.assistant')].map(m => m.textContent)")
    assert len(reply) == 1 and reply[0]
    info = browser.find_element(By.ID, "chat-turn").text
    assert "prefilled" in info and "reused 0" in info
    _wait(browser, "ada hot in the agents table", lambda: _rows(browser).get("ada") == "hot")

    served.stop()  # the page stays open: it loses the server, then finds it again
    _wait(browser, "the page to notice the server left",
          lambda: browser.find_element(By.ID, "conn-text").text.startswith("Offline"))
    served.start()
    _wait(browser, "ada warm after the restart", lambda: _rows(browser).get("ada") == "warm", timeout=30)
    _wait(browser, "live figures again", lambda: browser.find_element(By.ID, "conn-text").text == "Live")

    assert send("What is my name?") == "warm"  # the conversation goes on from the disk cache
    reused = int(_js(browser, "return document.querySelector('#chat-turn b').textContent").replace(",", ""))
    assert reused > 0
    _wait(browser, "ada hot again", lambda: _rows(browser).get("ada") == "hot")

    browser.find_element(By.CSS_SELECTOR, '#agents-body tr[data-agent="ada"] button.forget').click()
    alert = WebDriverWait(browser, 5).until(expected_conditions.alert_is_present())
    assert "Forget agent" in alert.text and "ada" in alert.text
    alert.accept()
    _wait(browser, "ada gone from the table", lambda: "ada" not in _rows(browser))
    assert httpx.get(f"{served.url}/v1/agents/ada", headers={"x-api-key": KEY_OPS}).status_code == 404


def test_a_tenants_page_lists_no_other_tenants_agent(served: Served, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    served.turn(KEY_OPS, "ops-private", "An operator's private note.")
    served.turn(KEY_GLOBEX, "globex-own", "Globex's own note.")
    _open(browser, f"{served.url}/ui#key={KEY_OPS}")
    _wait(browser, "the operator's agent", lambda: "ops-private" in _rows(browser))
    browser.get(f"{served.url}/ui/#key={KEY_GLOBEX}")  # the same page (a new fragment), another key
    _wait(browser, "globex's page", lambda: browser.find_element(By.ID, "who").text == "tenant globex")
    _wait(browser, "globex's own agent", lambda: "globex-own" in _rows(browser))
    assert set(_rows(browser)) == {"globex-own"}
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "ops-private" not in text and "operator's private" not in text
    assert "shown to operators" in browser.find_element(By.ID, "memory").text
    assert "shown to operators" in browser.find_element(By.ID, "batch").text


def test_the_chat_sends_its_settings_renders_markdown_as_text_and_lists_its_conversations(
    served: Served, browser: Any
) -> None:
    """Issue 59, item 5: the chat panel's system prompt, temperature and top-p go with the turn; a reply's
    markdown is drawn as elements, and HTML in it is shown as text, never run; the tab's conversations are
    listed, one button each."""
    from selenium.webdriver.common.by import By

    _open(browser, f"{served.url}/ui#key={KEY_OPS}")
    _wait(browser, "the page signed in", lambda: _visible(browser, "app"))
    # What the page sends: a wrapper around fetch keeps each agents-API body (the page's own code is untouched).
    _js(browser, "window.sentBodies = []; const f = window.fetch; window.fetch = (url, opts) => {"
                 " if (opts && opts.body && String(url).includes('/messages')) window.sentBodies.push(opts.body);"
                 " return f(url, opts); }")
    browser.find_element(By.CSS_SELECTOR, "#chat-settings summary").click()
    browser.find_element(By.ID, "chat-system").send_keys("You are terse.")
    for field, value in (("chat-temperature", "0.7"), ("chat-top-p", "0.9"), ("chat-max", "3")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    agent = browser.find_element(By.ID, "chat-agent")
    agent.clear()
    agent.send_keys("grace")
    browser.find_element(By.ID, "chat-input").send_keys("Hello there.")
    browser.find_element(By.ID, "chat-send").click()
    _wait(browser, "the turn's tier", lambda: _js(browser, "return document.getElementById('chat-turn').dataset.tier"),
          timeout=60)
    body = json.loads(_js(browser, "return window.sentBodies[0]"))
    assert body["system"] == "You are terse." and body["temperature"] == 0.7 and body["top_p"] == 0.9, body
    assert body["max_tokens"] == 3 and body["messages"][-1] == {"role": "user", "content": "Hello there."}
    listed = _js(browser, "return [...document.querySelectorAll('#chat-list button')].map(b => b.textContent)")
    assert listed == ["grace · 1 turn"], listed

    # A reply with markdown and with HTML in it, as the page keeps conversations (this tab's sessionStorage).
    hostile = ("# Plan\n**bold** and *soft* and `code`\n\n- one\n- two\n\n```\nx < y && <b>raw</b>\n```\n"
               "<img src=x onerror=\"window.pwned=1\"> [site](https://example.org) [bad](javascript:alert(1))")
    _js(browser, "sessionStorage.setItem('kvmem.chats', JSON.stringify({grace: [{role: 'user', content: 'hi'},"
                 f" {{role: 'assistant', content: {json.dumps(hostile)}}}]}}))")
    _open(browser, f"{served.url}/ui")
    _wait(browser, "the page signed in", lambda: _visible(browser, "app"))
    browser.find_element(By.CSS_SELECTOR, "#chat-list button").click()
    reply = browser.find_element(By.CSS_SELECTOR, "#chat-log .msg.assistant")
    tags = browser.execute_script("return [...arguments[0].querySelectorAll('*')].map(e => e.tagName.toLowerCase())",
                                  reply)
    assert {"h1", "strong", "em", "code", "ul", "li", "pre", "a"} <= set(tags), tags
    assert "img" not in tags and "b" not in tags and "script" not in tags, tags
    assert "<img src=x" in reply.text and "<b>raw</b>" in reply.text  # shown as the characters they are
    links = browser.execute_script("return [...arguments[0].querySelectorAll('a')].map(a => a.href)", reply)
    assert links == ["https://example.org/"], links  # a javascript: link stays text
    assert _js(browser, "return window.pwned === undefined")


def test_an_agent_whose_id_holds_a_slash_is_chatted_with_and_forgotten_through_the_page(
    served: Served, browser: Any
) -> None:
    """Issue 58, item 3: the page names an agent in a URL path as one escaped segment (``team%2Fada``)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, f"{served.url}/ui#key={KEY_OPS}")
    _wait(browser, "the page signed in", lambda: _visible(browser, "app"))
    agent = browser.find_element(By.ID, "chat-agent")
    agent.clear()
    agent.send_keys("team/ada 50%")
    browser.find_element(By.ID, "chat-max").clear()
    browser.find_element(By.ID, "chat-max").send_keys("2")
    browser.find_element(By.ID, "chat-input").send_keys("Hello.")
    browser.find_element(By.ID, "chat-send").click()
    _wait(browser, "the turn's tier", lambda: _js(browser, "return document.getElementById('chat-turn').dataset.tier"),
          timeout=60)
    _wait(browser, "the agent in the table", lambda: "team/ada 50%" in _rows(browser))
    button = browser.find_element(By.CSS_SELECTOR, '#agents-body tr[data-agent="team/ada 50%"] button.forget')
    button.click()
    WebDriverWait(browser, 5).until(expected_conditions.alert_is_present()).accept()
    _wait(browser, "the agent gone from the table", lambda: "team/ada 50%" not in _rows(browser))
    gone = httpx.get(f"{served.url}/v1/agents/team%2Fada%2050%25", headers={"x-api-key": KEY_OPS})
    assert gone.status_code == 404, gone.text
