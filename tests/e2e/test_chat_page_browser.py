"""The web chat page at `/`, driven in a real headless Chromium (selenium + chromedriver) against a real
`splitserve serve` on the default model.

The browser and its driver are Debian's `chromium` and `chromium-driver` packages (the README's test
command installs them); selenium is pointed at both paths, so it never tries to download a driver.

What the page sends is recorded by a wrapper around `window.fetch` installed after the page loads; what
the server did with it is read from its API and /metrics, so each check has a side the page does not
control: the answer's text against the API's own greedy answer, the token count against max_tokens, the
abort against the server's finished-request counters.
"""
from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from tests.e2e.test_server_errors import wait_idle

ANSWER_TIMEOUT_S = 240  # a CPU shared with other test processes can be slow
INSTALL_HINT = "install Debian's packages: apt-get install -y chromium chromium-driver"

# Kept before each request by the wrapper below: the JSON bodies the page POSTs.
RECORD_FETCH = """
if (!window.__sent) {
  window.__sent = [];
  const original = window.fetch;
  window.fetch = (url, init) => {
    if (init && init.method === "POST") window.__sent.push({ url: String(url), body: JSON.parse(init.body) });
    return original(url, init);
  };
}"""


def _find(*names: str) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


@pytest.fixture(scope="module")
def browser():
    chrome, driver = _find("chromium", "chromium-browser"), _find("chromedriver")
    if not chrome or not driver:
        pytest.fail(f"no headless browser (chromium: {chrome}, chromedriver: {driver}); {INSTALL_HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900"):
        options.add_argument(arg)
    os.environ.setdefault("SE_OFFLINE", "true")  # belt and braces: never let Selenium Manager download
    drv = webdriver.Chrome(options=options, service=Service(driver))
    drv.set_script_timeout(30)
    yield drv
    drv.quit()


@pytest.fixture
def page(browser, server):
    """The page freshly loaded, with default settings, connected to the server, recording its POSTs."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text.startswith("SmolLM2"))
    browser.execute_script(RECORD_FETCH)
    return browser


def sent(page) -> list[dict]:
    return page.execute_script("return window.__sent")


def ask(page, text: str) -> None:
    box = page.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_answer(page) -> str:
    """The last answer bubble's text as the page holds it (textContent: no whitespace folding)."""
    return page.execute_script("const m = document.querySelectorAll('.msg.assistant');"
                               "return m.length ? m[m.length - 1].textContent : ''")


def wait_reply_done(page) -> str:
    """The last answer's text once the page has finished streaming it."""
    WebDriverWait(page, ANSWER_TIMEOUT_S).until(
        lambda d: d.execute_script("return window.__sent.length > 0 && !document.body.dataset.busy"))
    errors = [e.text for e in page.find_elements(By.CSS_SELECTOR, ".error")]
    assert not errors, errors
    return last_answer(page)


def plain(body: dict, **changes) -> dict:
    """The page's request body as a non-streamed request (the API's own answer to compare with)."""
    return {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False, **changes}


def set_field(page, field_id: str, value: str) -> None:
    el = page.find_element(By.ID, field_id)
    el.clear()
    el.send_keys(value)


def open_settings(page) -> None:
    if not page.find_element(By.ID, "settings").get_attribute("open"):
        page.find_element(By.ID, "summary").click()


def test_a_question_gets_a_sensible_answer(page, server):
    ask(page, "What is the capital of France?")
    answer = wait_reply_done(page)
    assert "Paris" in answer
    body = sent(page)[-1]["body"]
    # the defaults: greedy, the model's own system prompt, streamed
    assert body["temperature"] == 0 and body["stream"] is True and "top_p" not in body
    assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    # the page shows exactly what the API answers to the same request (streamed text reassembled)
    api = httpx.post(server.url + "/v1/chat/completions", json=plain(body), timeout=ANSWER_TIMEOUT_S).json()
    assert answer == api["choices"][0]["message"]["content"]


def test_settings_change_the_request(page, server, metric):
    open_settings(page)
    set_field(page, "temperature", "0.7")
    set_field(page, "top_p", "0.8")
    set_field(page, "max_tokens", "5")
    set_field(page, "system", "You are a sailor who loves the sea.")
    generated = metric("splitserve:generation_tokens_total")
    ask(page, "Tell me a long story about the ocean.")
    wait_reply_done(page)
    body = sent(page)[-1]["body"]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.7, 0.8, 5)
    assert body["messages"] == [{"role": "system", "content": "You are a sailor who loves the sea."},
                                {"role": "user", "content": "Tell me a long story about the ocean."}]
    # the server ran it with those settings: exactly five tokens, and the page says it was cut there
    assert metric("splitserve:generation_tokens_total") - generated == 5
    notes = [e.text for e in page.find_elements(By.CSS_SELECTOR, ".note")]
    assert notes and "cut at max tokens (5 tokens)" in notes[-1]

    # the settings survive a reload (kept in localStorage), and a second turn carries the first
    page.refresh()
    WebDriverWait(page, 30).until(lambda d: d.find_element(By.ID, "model").text.startswith("SmolLM2"))
    assert page.find_element(By.ID, "max_tokens").get_attribute("value") == "5"
    assert page.find_element(By.ID, "system").get_attribute("value") == "You are a sailor who loves the sea."

    # a bad value is refused on the page: an error naming the field, no request sent
    page.execute_script(RECORD_FETCH)
    open_settings(page)
    set_field(page, "temperature", "7")
    ask(page, "Hello")
    WebDriverWait(page, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".error"))
    assert "temperature" in page.find_element(By.CSS_SELECTOR, ".error").text
    assert sent(page) == []
    page.find_element(By.ID, "reset").click()
    assert page.find_element(By.ID, "temperature").get_attribute("value") == "0"
    assert page.find_element(By.ID, "system").get_attribute("value") == ""


# Greedy, this prompt makes the default model count on ("1. 1\n2. 2\n...", still counting after 60 tokens),
# far past the few tokens the test waits for before pressing Stop (and the test checks that it goes on).
LONG_PROMPT = "Count from 1 to 500, one number per line."


def test_stop_ends_a_long_answer_and_the_server_aborts_it(page, server, metric):
    def finished(reason: str) -> float:
        return metric("splitserve:request_success_total", finished_reason=reason) or 0.0

    open_settings(page)
    set_field(page, "max_tokens", "1500")
    before = {r: finished(r) for r in ("abort", "stop", "length")}
    ask(page, LONG_PROMPT)
    # stop once some text has arrived
    WebDriverWait(page, ANSWER_TIMEOUT_S).until(lambda d: len(last_answer(d)) >= 12)
    page.find_element(By.ID, "stop").click()
    WebDriverWait(page, 30).until(lambda d: not d.execute_script("return document.body.dataset.busy"))
    shown = last_answer(page)
    assert page.find_elements(By.CSS_SELECTOR, ".note")[-1].text == "stopped"
    assert page.find_element(By.ID, "send").is_displayed() and not page.find_element(By.ID, "stop").is_displayed()

    # the server aborted it in the core: counted as aborted, not finished, and nothing keeps running
    wait_idle(metric, timeout=60)
    assert finished("abort") == before["abort"] + 1
    assert (finished("stop"), finished("length")) == (before["stop"], before["length"])
    assert last_answer(page) == shown  # nothing more arrived

    # the same request left alone goes on past where it was stopped: the stop cut it short (greedy,
    # so the API's answer starts with what the page showed; a few tokens more than shown suffice)
    body = sent(page)[-1]["body"]
    assert body["max_tokens"] == 1500
    shown_tokens = httpx.post(server.url + "/tokenize", json={"prompt": shown, "add_special_tokens": False},
                              timeout=30).json()["count"]
    more = httpx.post(server.url + "/v1/chat/completions", json=plain(body, max_tokens=shown_tokens + 4),
                      timeout=ANSWER_TIMEOUT_S).json()["choices"][0]
    assert more["finish_reason"] == "length"
    assert more["message"]["content"].startswith(shown) and len(more["message"]["content"]) > len(shown)

    # the partial answer stays in the conversation: the next turn sends it
    set_field(page, "max_tokens", "3")
    ask(page, "Thanks.")
    wait_reply_done(page)
    messages = sent(page)[-1]["body"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"] and messages[1]["content"] == shown
