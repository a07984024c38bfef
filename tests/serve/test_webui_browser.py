"""The web page in headless Chromium (selenium, the system's chromium and chromedriver) against a
real `jaxinfer serve` process on the tiny random Llama, started with an API key: the page asks
for the key, streams an answer, stops a generation (the server aborts it and frees its pages),
shows the dashboard's numbers moving, and shows model output that is HTML as text.

Skipped, saying why, where selenium, chromium or chromedriver is missing (`apt-get install
chromium chromium-driver`; .ci/run installs them). Nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import httpx
import pytest

from tests.serve.conftest import free_port
from tests.serve.server_process import server_process

TIMEOUT = 600.0  # the first requests compile their shapes (no warm-up)
WAIT = 120.0
MODEL = "tiny"
KEY = "webui-test-key"
NUM_PAGES = 64  # usable: one fewer (page 0 is the null page)

selenium = pytest.importorskip("selenium", reason="the browser test needs `pip install selenium`")
from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def _browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths, or skip the module."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))
                    if p), None)
    driver = shutil.which("chromedriver") or next(
        (p for p in ("/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver") if os.path.exists(p)),
        None)
    if browser is None or driver is None:
        if os.environ.get("JAXINFER_REQUIRE_BROWSER") == "1":  # CI installed it: must run
            pytest.fail("JAXINFER_REQUIRE_BROWSER=1 but no Chromium and chromedriver were found")
        pytest.skip("no Chromium and chromedriver found: `apt-get install chromium chromium-driver` "
                    "to run the web page's browser test", allow_module_level=True)
    return browser, driver


BROWSER, CHROMEDRIVER = _browser()  # skips here, before any server starts


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    port = free_port()
    cache = tmp_path_factory.mktemp("jax-cache")
    args = ["-m", "jaxinfer.cli", "--log-level", "INFO", "serve", str(tiny_llama_dir),
            "--port", str(port), "--served-model-name", MODEL, "--num-pages", str(NUM_PAGES),
            "--page-size", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
            "--max-model-len", "256", "--no-warmup", "--compilation-cache-dir", str(cache)]
    with server_process(args, port, timeout=TIMEOUT, env={"JAXINFER_API_KEY": KEY}) as srv:
        yield srv


@pytest.fixture(scope="module")
def driver():
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def page(server, driver):
    """The page, open, with the API key entered when it asked for it (its first call got 401)."""
    driver.get(server.base_url + "/")
    form = driver.find_element(By.ID, "key-form")
    _wait(driver, lambda d: form.is_displayed(), "the page did not ask for the API key")
    assert driver.execute_script("return sessionStorage.getItem('jaxinfer.apiKey')") is None
    driver.find_element(By.ID, "key-input").send_keys(KEY + Keys.ENTER)
    _wait(driver, lambda d: not form.is_displayed(), "the key form stayed open")
    _wait(driver, lambda d: _value(d, "stat-kv-total") == NUM_PAGES - 1,
          "the dashboard did not show the KV pool")
    assert driver.execute_script("return sessionStorage.getItem('jaxinfer.apiKey')") == KEY
    assert driver.execute_script("return localStorage.length") == 0
    driver.find_element(By.CSS_SELECTOR, "#settings summary").click()  # open the settings
    return driver


def _wait(driver, condition, message: str, timeout: float = WAIT):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, message)


def _value(driver, stat_id: str) -> float | None:
    raw = driver.find_element(By.ID, stat_id).get_attribute("data-value")
    return float(raw) if raw else None


def _stats(server) -> dict:
    r = httpx.get(f"{server.base_url}/v1/engine/stats",
                  headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200
    return r.json()


def _set(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _send(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text + Keys.ENTER)


def _answers(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def _record_lengths(driver) -> None:
    """Each re-render of the newest answer's text length, into window.answerLengths."""
    driver.execute_script("""
        window.answerLengths = [];
        new MutationObserver(() => {
          const bodies = document.querySelectorAll('#messages .message.assistant .body');
          if (bodies.length) window.answerLengths.push(bodies[bodies.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true});""")


def test_chat_streams_an_answer_and_the_dashboard_moves(page, server):
    generated_before = _value(page, "stat-generated") or 0.0
    _set(page, "temperature", "0")
    _set(page, "max-tokens", "40")
    _set(page, "system", "You are terse.")
    _record_lengths(page)
    n = len(_answers(page))
    _send(page, "Hello there")
    _wait(page, lambda d: len(_answers(d)) == n + 1, "no answer bubble")
    answer = _answers(page)[-1]
    _wait(page, lambda d: "done" in answer.get_attribute("class"), "the answer did not finish")
    stats = answer.find_element(By.CLASS_NAME, "answer-stats")
    assert float(stats.get_attribute("data-ttft-ms")) > 0
    assert float(stats.get_attribute("data-tokens-per-s")) > 0
    assert "40 tokens" in stats.text, stats.text
    text = answer.find_element(By.CLASS_NAME, "body").text
    assert text.strip()
    lengths = page.execute_script("return window.answerLengths")
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths  # it grew as it streamed
    user = page.find_elements(By.CSS_SELECTOR, "#messages .message.user")[-1]
    assert user.find_element(By.CLASS_NAME, "body").text == "Hello there"
    _wait(page, lambda d: (_value(d, "stat-generated") or 0) >= generated_before + 40,
          "the dashboard's generated tokens did not move")
    _wait(page, lambda d: _value(d, "stat-tps") is not None, "no tokens/s on the dashboard")
    assert _value(page, "stat-prefix-hit") is not None


def test_stop_aborts_the_request_and_frees_its_pages(page, server):
    """Stop is clicked from inside the page the moment the first text shows (a test's polling
    could let the tiny model finish first); the server must then abort the request."""
    page.find_element(By.ID, "clear").click()  # a new conversation: its prompt stays short
    assert not _answers(page)
    _set(page, "temperature", "1")
    _set(page, "max-tokens", "200")
    before = _stats(server)
    page.execute_script("""
        window.stoppedAt = null;
        const observer = new MutationObserver(() => {
          const body = document.querySelector('#messages .message.assistant .body');
          if (body && body.textContent.length) {
            observer.disconnect();
            window.stoppedAt = body.textContent.length;
            document.getElementById('stop').click();
          }
        });
        observer.observe(document.getElementById('messages'), {childList: true, subtree: true});""")
    _send(page, "Tell me a very long story")
    _wait(page, lambda d: len(_answers(d)) == 1, "no answer bubble")
    answer = _answers(page)[0]
    _wait(page, lambda d: "stopped" in answer.get_attribute("class"), "the answer did not stop")
    assert page.execute_script("return window.stoppedAt") > 0  # streamed text, then Stop
    assert "stopped" in answer.find_element(By.CLASS_NAME, "answer-stats").text
    assert answer.find_element(By.CLASS_NAME, "body").text.strip()
    deadline = time.monotonic() + WAIT
    while (s := _stats(server))["kv_pages"]["used"] or s["requests"]["running"] \
            or s["requests"]["in_flight"]:
        assert time.monotonic() < deadline, f"the stopped request kept its pages: {s}"
        time.sleep(0.05)
    generated = s["tokens"]["generated"] - before["tokens"]["generated"]
    assert 0 < generated < 200, generated  # it was cut short, not run to max_tokens
    metrics = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=10).text
    assert 'jaxinfer_requests_total{endpoint="chat",outcome="disconnected"} 1.0' in metrics, \
        [line for line in metrics.splitlines() if "requests_total" in line]
    # the dashboard, polled from the same numbers, catches up and shows the pages freed
    _wait(page, lambda d: _value(d, "stat-generated") == s["tokens"]["generated"]
          and _value(d, "stat-kv-used") == 0 and _value(d, "stat-running") == 0,
          "the dashboard did not show the pages freed")
    assert not page.find_element(By.ID, "send").get_attribute("disabled")


MARKUP = ("Some **bold** and `<b>code</b>` here.\n\n<script>window.pwned = 1; alert(1)</script>\n"
          "<img src=x onerror=\"window.pwned = 2\"><b onmouseover=alert(3)>hover</b>\n\n"
          "- item <i>one</i>\n- item two\n\n```html\n<script>window.pwned = 3</script>\n```\n")


def test_model_output_with_html_is_shown_as_text(page, server, tmp_path):
    """The chat endpoint is stubbed in the page (its fetch) to stream MARKUP as the answer."""
    chunks = [MARKUP[i:i + 7] for i in range(0, len(MARKUP), 7)]
    events = "".join(
        "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": c},
                                            "finish_reason": None}]}) + "\n\n" for c in chunks)
    events += "data: " + json.dumps({"choices": [{"index": 0, "delta": {},
                                                  "finish_reason": "stop"}]}) + "\n\ndata: [DONE]\n\n"
    page.execute_script("""
        const events = arguments[0];
        const realFetch = window.realFetch = window.fetch;
        window.fetch = (url, init) => {
          if (!String(url).endsWith('/v1/chat/completions')) return realFetch(url, init);
          const bytes = new TextEncoder().encode(events);
          const body = new ReadableStream({start(c) {
            for (let i = 0; i < bytes.length; i += 50) c.enqueue(bytes.slice(i, i + 50));
            c.close();
          }});
          return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
        };""", events)
    try:
        n = len(_answers(page))
        _send(page, "Say something with HTML in it")
        _wait(page, lambda d: len(_answers(d)) == n + 1, "no answer bubble")
        answer = _answers(page)[-1]
        _wait(page, lambda d: "done" in answer.get_attribute("class"), "the answer did not finish")
        body = answer.find_element(By.CLASS_NAME, "body")
        text = page.execute_script("return arguments[0].textContent", body)
        assert "<script>window.pwned = 1; alert(1)</script>" in text
        assert '<img src=x onerror="window.pwned = 2">' in text
        assert "<script>window.pwned = 3</script>" in text
        assert page.execute_script(
            "return document.querySelectorAll('#messages script, #messages img, #messages b, "
            "#messages i, #messages [onerror], #messages [onmouseover]').length") == 0
        assert page.execute_script("return window.pwned") is None
        try:
            alert = page.switch_to.alert
            raise AssertionError(f"an alert fired: {alert.text}")
        except NoAlertPresentException:
            pass
        # the markdown subset still renders, from text
        assert body.find_element(By.TAG_NAME, "strong").text == "bold"
        assert body.find_element(By.CSS_SELECTOR, "p code").text == "<b>code</b>"
        assert [li.text for li in body.find_elements(By.CSS_SELECTOR, "ul li")] == [
            "item <i>one</i>", "item two"]
        assert body.find_element(By.CSS_SELECTOR, "pre code").text == "<script>window.pwned = 3</script>"
    finally:
        page.execute_script("window.fetch = window.realFetch")
    # the page broke no rule of its own CSP (an inline script or style would be logged)
    logs = [e["message"] for e in page.get_log("browser")]
    assert not [m for m in logs if "Content Security Policy" in m], logs
    path = tmp_path / "webui.png"
    page.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    if os.environ.get("JAXINFER_WEBUI_SCREENSHOT"):  # to refresh docs/webui.png
        shutil.copy(path, os.environ["JAXINFER_WEBUI_SCREENSHOT"])

