"""The built-in page in a real browser (Debian's chromium, driven by Selenium): chat with
streamed text and per-reply timings, the template's rendering, the dashboard's step chart and
queue counts moving under the built-in load, the API key asked for and sent, and no request
leaving for another host. The data endpoint and the switch are checked without a browser."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time

import httpx
import pytest

from conftest import running_server

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (the README's test command installs "
           "them)")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,1000", "--disable-gpu"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def wait_for(condition, timeout=30.0, every=0.1):
    """The first truthy value of condition() within the timeout (fails the test otherwise)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out waiting for the page")


def requested_urls(driver):
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def fresh_page(driver, url: str) -> None:
    """The page at `url` with nothing kept from an earlier test (conversations, key)."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(url + "/")


def type_message(driver, url: str, max_tokens: int, text: str) -> None:
    """A fresh page, once it knows the model, with `max_tokens` set and `text` typed."""
    from selenium.webdriver.common.by import By

    fresh_page(driver, url)
    wait_for(lambda: driver.find_element(By.ID, "model-name").text)
    driver.find_element(By.ID, "max-tokens").clear()
    driver.find_element(By.ID, "max-tokens").send_keys(str(max_tokens))
    driver.find_element(By.ID, "chat-input").send_keys(text)


# A reply's timings under it: TTFT, TPOT, tokens/s and its token count.
REPLY_STATS = r"TTFT \d+ ms · TPOT [\d.]+ ms · [\d.]+ tokens/s · (\d+) tokens"


@pytest.fixture(scope="module")
def served(llama_dir):
    with running_server(llama_dir, scheduling_policy="fcfs", max_num_batched_tokens=64) as pair:
        yield pair


@pytest.fixture
def driver():
    instance = browser()
    try:
        yield instance
    finally:
        instance.quit()


@needs_browser
def test_chat_streams_a_reply_with_its_timings(server, driver):
    from selenium.webdriver.common.by import By

    type_message(driver, server.url, 24, "hello there")
    # note the reply's length at each change of the page: a streamed reply shows partly first
    driver.execute_script("""
        window.lengths = [];
        new MutationObserver(() => {
            const replies = document.querySelectorAll('.message.assistant .content');
            if (replies.length) window.lengths.push(replies[replies.length - 1].textContent.length);
        }).observe(document.getElementById('messages'),
                   {childList: true, subtree: true, characterData: true});""")
    driver.find_element(By.ID, "send").click()
    stats = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".message.assistant .reply-stats"))
    text = stats[-1].text
    match = re.fullmatch(REPLY_STATS, text)
    assert match and 1 < int(match.group(1)) <= 24, text  # max_tokens 24 (EOS may end it)
    replies = driver.find_elements(By.CSS_SELECTOR, ".message.assistant .content")
    assert replies[-1].text.strip()
    final = len(replies[-1].get_attribute("textContent"))
    partial = {n for n in driver.execute_script("return window.lengths") if 0 < n < final}
    assert partial, "the reply appeared all at once, not streamed"
    assert driver.find_elements(By.CSS_SELECTOR, ".message.user .content")[-1].text == \
        "hello there"
    driver.find_element(By.ID, "show-prompt").click()
    rendered = wait_for(lambda: driver.find_element(By.ID, "rendered-prompt").text)
    assert "<|im_start|>user\nhello there<|im_end|>" in rendered
    # the conversation is kept in the browser, and a new one starts empty
    driver.get(server.url + "/")
    assert wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".message.user"))
    driver.find_element(By.ID, "new-chat").click()
    assert not driver.find_elements(By.CSS_SELECTOR, ".message")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2
    assert all(url.startswith(server.url) for url in requested_urls(driver))


# A chat stream the page is given instead of the server's: (ms after the request, event).
# Three tokens, the last an EOS, which streams no text: its event only finishes the reply.
EOS_ENDED_STREAM = [(0, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
                    (100, {"choices": [{"delta": {"content": "a"}}]}),
                    (200, {"choices": [{"delta": {"content": "b"}}]}),
                    (400, {"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}),
                    (400, {"choices": [], "usage": {"completion_tokens": 3}})]


@needs_browser
def test_a_replys_tpot_ends_at_its_last_token_even_without_text(server, driver):
    """TPOT is (last token - first token) / (tokens - 1); the last token's event may carry no
    text (an EOS). The page ended at the last text: 50 ms here instead of 150."""
    from selenium.webdriver.common.by import By

    type_message(driver, server.url, 24, "hello")
    driver.execute_script("""
        const events = arguments[0], real = window.fetch;
        window.fetch = (path, options) => {
          if (!String(path).endsWith('/v1/chat/completions')) return real(path, options);
          const encoder = new TextEncoder();
          const body = new ReadableStream({ start(controller) {
            for (const [at, event] of events)
              setTimeout(() => controller.enqueue(encoder.encode(
                'data: ' + JSON.stringify(event) + '\\n\\n')), at);
            setTimeout(() => { controller.enqueue(encoder.encode('data: [DONE]\\n\\n'));
                               controller.close(); }, 450);
          } });
          return Promise.resolve(new Response(body, { status: 200,
            headers: { 'Content-Type': 'text/event-stream' } }));
        };""", EOS_ENDED_STREAM)
    driver.find_element(By.ID, "send").click()
    stats = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".message.assistant .reply-stats"))
    match = re.fullmatch(r"TTFT \d+ ms · TPOT ([\d.]+) ms · [\d.]+ tokens/s · 3 tokens",
                         stats[-1].text)
    assert match and 120 <= float(match.group(1)) <= 250, stats[-1].text


@needs_browser
def test_a_reasoning_models_thinking_is_shown_apart(llama_dir, driver):
    """With --reasoning-parser deepseek_r1 a (random) answer without </think> is all thinking:
    the page shows it in its own folded box, streamed, and times the reply from its first
    piece (it counted answer text alone: no timings, no tokens)."""
    from selenium.webdriver.common.by import By

    with running_server(llama_dir, scheduling_policy="fcfs",
                        app_kwargs={"reasoning_parser": "deepseek_r1"}) as (server, _):
        type_message(driver, server.url, 16, "think")
        driver.find_element(By.ID, "send").click()
        stats = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR,
                                                      ".message.assistant .reply-stats"))
        assert re.fullmatch(REPLY_STATS, stats[-1].text), stats[-1].text
        thought = driver.find_element(By.CSS_SELECTOR, ".message.assistant .reasoning-text")
        assert thought.get_attribute("textContent")
        assert driver.find_element(By.CSS_SELECTOR, ".message.assistant .reasoning summary"
                                   ).text == "thinking"


@needs_browser
def test_dashboard_shows_the_scheduler_at_work(server, async_llm, driver):
    from selenium.webdriver.common.by import By

    driver.get(server.url + "/")
    driver.find_element(By.ID, "tab-dashboard").click()
    wait_for(lambda: "policy" in driver.find_element(By.ID, "model-name").text)
    steps_before = int(driver.find_element(By.ID, "step-count").text)
    driver.find_element(By.ID, "fire-load").click()
    assert "load started" in wait_for(lambda: driver.find_element(By.ID, "load-status").text
                                      if "load started" in driver.find_element(
                                          By.ID, "load-status").text else None)
    # The tiny model serves the built-in load in a blink; requests that decode for a few
    # seconds keep the queues busy across several of the page's 1 s polls.
    def long_requests():
        with httpx.Client(timeout=60) as client:
            threads = [threading.Thread(target=client.post, args=(
                server.url + "/v1/completions",), kwargs={"json": {
                    "prompt": "x", "max_tokens": 480, "ignore_eos": True, "min_tokens": 480}})
                for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    background = threading.Thread(target=long_requests)
    background.start()
    seen_running, seen_rows = 0, 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen_running = max(seen_running, int(driver.find_element(By.ID, "q-running").text))
        rows = driver.find_elements(By.CSS_SELECTOR, "#requests-table tbody tr")
        seen_rows = max(seen_rows, len(rows))
        if seen_running and seen_rows and not background.is_alive():
            break
        time.sleep(0.1)
    background.join()
    assert seen_running >= 1 and seen_rows >= 1
    wait_for(lambda: int(driver.find_element(By.ID, "step-count").text) > steps_before + 5)
    chart = driver.find_element(By.ID, "chart-steps")
    assert int(chart.get_attribute("data-points")) > 5
    assert int(driver.find_element(By.ID, "chart-cache").get_attribute("data-points")) > 1
    wait_for(lambda: driver.find_element(By.ID, "ttft").text != "-", timeout=10)
    assert all(url.startswith(server.url) for url in requested_urls(driver))


@needs_browser
def test_the_page_asks_for_the_api_key(llama_dir, driver):
    from selenium.webdriver.common.by import By

    with running_server(llama_dir, app_kwargs={"api_key": "sesame"}) as (server, _):
        fresh_page(driver, server.url)
        dialog = driver.find_element(By.ID, "key-dialog")
        wait_for(lambda: dialog.is_displayed())
        driver.find_element(By.ID, "key-input").send_keys("sesame")
        driver.find_element(By.ID, "key-save").click()
        wait_for(lambda: driver.find_element(By.ID, "model-name").text == "m")
        driver.find_element(By.ID, "tab-dashboard").click()
        wait_for(lambda: int(driver.find_element(By.ID, "step-count").text) >= 0
                 and "policy" in driver.find_element(By.ID, "model-name").text)


@needs_browser
def test_a_cancelled_key_dialog_stays_closed(llama_dir, driver):
    """Cancel means no key for now: the dashboard's polls, refused each second, opened the
    dialog again each time. The key button still asks, and the saved key is used."""
    from selenium.webdriver.common.by import By

    with running_server(llama_dir, app_kwargs={"api_key": "sesame"}) as (server, _):
        fresh_page(driver, server.url)
        dialog = driver.find_element(By.ID, "key-dialog")
        wait_for(lambda: dialog.is_displayed())
        driver.find_element(By.ID, "key-cancel").click()
        driver.find_element(By.ID, "tab-dashboard").click()
        time.sleep(2.5)  # two polls, both refused
        assert not dialog.is_displayed()
        driver.find_element(By.ID, "key-button").click()
        driver.find_element(By.ID, "key-input").send_keys("sesame")
        driver.find_element(By.ID, "key-save").click()
        wait_for(lambda: "policy" in driver.find_element(By.ID, "model-name").text)


def test_state_endpoint_and_switch(server, llama_dir):
    before = httpx.get(server.url + "/dashboard/state").json()
    for _ in range(3):
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                          "ignore_eos": True})
    state = httpx.get(server.url + "/dashboard/state",
                      params={"since": before["steps"][-1]["step"] if before["steps"] else -1}
                      ).json()
    assert state["steps"] and all(s["step"] > (before["steps"] or [{"step": -1}])[-1]["step"]
                                  for s in state["steps"])
    assert [s["step"] for s in state["steps"]] == sorted({s["step"] for s in state["steps"]})
    assert sum(s["decode"] for s in state["steps"]) >= 3 * 3
    assert state["config"]["max_num_batched_tokens"] == 64
    assert state["latency"]["finished"] >= 3 and state["latency"]["ttft_ms"]["median"] > 0
    assert state["queues"] == {"running": 0, "waiting": 0, "preempted": 0,
                               "preemptions_total": 0}
    assert httpx.get(server.url + "/static/app.js").status_code == 200
    with running_server(llama_dir, app_kwargs={"web_ui": False}) as (plain, _):
        assert httpx.get(plain.url + "/").status_code == 404
        assert httpx.get(plain.url + "/dashboard/state").status_code == 404
    with running_server(llama_dir, app_kwargs={"api_key": "k"}) as (keyed, _):
        assert httpx.get(keyed.url + "/").status_code == 200  # the page itself is open
        assert httpx.get(keyed.url + "/dashboard/state").status_code == 401
        assert httpx.post(keyed.url + "/dashboard/load").status_code == 401


def test_the_demos_dashboard_refuses_in_the_apis_error_shape():
    """`fulcrum demo --dashboard` serves the page over an engine not yet started and with no
    load to fire: its refusals are the API's error bodies (they were 500s with a traceback
    logged for each, the page polling once a second)."""
    from fastapi.testclient import TestClient

    from fulcrum.server.dashboard import DashboardFeed, dashboard_app

    with TestClient(dashboard_app(DashboardFeed(None, "starting")),
                    raise_server_exceptions=False) as client:
        state = client.get("/dashboard/state")
        assert state.status_code == 503
        assert state.json()["error"]["message"] == "no engine is running yet"
        load = client.post("/dashboard/load")
        assert load.status_code == 404
        assert load.json()["error"]["message"] == "this page has no server engine to load"
        assert client.get("/nowhere").json()["error"]["code"] == 404
        invalid = client.get("/dashboard/state", params={"since": "abc"})
        assert invalid.status_code == 400 and "since" in invalid.json()["error"]["message"]


def _step(step: int, start_time: float, prefill: int, decode: int, wall: float = 0.1):
    from fulcrum.stats import StepStats

    return StepStats(step, start_time, wall, wall, wall, prefill, decode, 0, 0, 0, 0, 0, 64, 0.0,
                     0, 0)


def test_throughput_spreads_a_burst_over_its_window():
    """One 200-token prompt after an idle spell is 20 tokens/s over the card's 10 s (it read
    1121 tokens/s: the tokens over the time since their own step began); an engine younger
    than the window counts its own age."""
    from types import SimpleNamespace

    from fulcrum.server.dashboard import THROUGHPUT_WINDOW_S, DashboardFeed

    now = 1000.0
    steps = [_step(0, now - 0.2, 200, 0), _step(1, now - 0.1, 0, 1)]
    for ready, expected in ((now - 60.0, 201 / THROUGHPUT_WINDOW_S), (now - 4.0, 201 / 4.0)):
        feed = DashboardFeed(SimpleNamespace(stats=steps, ready_time=ready), "m")
        throughput = feed._throughput(now)
        assert throughput["tokens_per_s"] == pytest.approx(expected)
        assert throughput["prefill_per_s"] == pytest.approx(expected * 200 / 201)
    idle = DashboardFeed(SimpleNamespace(stats=steps, ready_time=now - 60.0), "m")
    assert idle._throughput(now + THROUGHPUT_WINDOW_S + 0.5)["tokens_per_s"] == 0.0


def test_prefix_hits_are_those_of_the_recent_requests(server, monkeypatch):
    """The card's share is of the prompt tokens of requests finished within the window: the
    server's lifetime share (here 48 of 384 tokens, 12%, while the last two prompts found
    48 of 128, 38%) hardly moves once a server has run a while."""
    import random

    from fulcrum.server import dashboard

    monkeypatch.setattr(dashboard, "WINDOW_S", 1.5)
    rng = random.Random(8)

    def complete(prompt):
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 1})
        assert reply.status_code == 200, reply.text

    for _ in range(4):  # unseen prompts: no hits
        complete([rng.randrange(300) for _ in range(64)])
    time.sleep(1.6)
    repeated = [rng.randrange(300) for _ in range(64)]
    complete(repeated)
    complete(repeated)  # finds 3 blocks of 16 (one token is always computed)
    state = httpx.get(server.url + "/dashboard/state").json()
    assert state["latency"]["finished"] == 2
    assert state["kv"]["prefix_cache_hit_rate"] == pytest.approx(48 / 128)


def test_throughput_counts_steps_that_ended_in_its_window(monkeypatch):
    """A step counts when its tokens are out: a 12 s prefill that just ended is in the last
    10 s (it never counted, having started before them); past the steps it reads, the rate
    is over those read."""
    from types import SimpleNamespace

    from fulcrum.server import dashboard

    now = 1000.0
    engine = SimpleNamespace(stats=[_step(0, now - 12.1, 512, 0, wall=12.0)],
                             ready_time=now - 60.0)
    assert dashboard.DashboardFeed(engine, "m")._throughput(now)["tokens_per_s"] == \
        pytest.approx(512 / dashboard.THROUGHPUT_WINDOW_S)
    monkeypatch.setattr(dashboard, "MAX_WINDOW_STEPS", 2)
    engine.stats = [_step(i, now - 3.1 + i, 0, 10, wall=0.9) for i in range(3)]  # end each s
    assert dashboard.DashboardFeed(engine, "m")._throughput(now)["tokens_per_s"] == \
        pytest.approx(20 / 2.1)  # since the first read began
