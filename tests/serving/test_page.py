"""The page at ``GET /``: served without the API key (its API calls need it), and, in a headless Chromium over
the bundled model, streaming an answer whose token spans say where each token came from and concatenate to
the API's greedy text; the plain-vs-speculative race gives identical texts; a missing key is asked for.

The browser tests need the ``browser`` extra (``pip install playwright``) and a Chromium at /usr/bin/chromium;
they skip otherwise (no browser is ever downloaded).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from helpers.models import word_target
from helpers.tokenizers import CHAT_TEMPLATE

import specdecode as sd
from specdecode.serving import ServerConfig, create_app
from specdecode.serving.local import LocalServer

API_KEY = "sekrit"
PAGE_IDS = ("prompt", "send", "output", "stats", "speculative", "race", "race-plain", "race-spec", "api-key", "error")
STATIC = Path(sd.__file__).parent / "serving" / "static"
CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "page.png"  # refreshed with SPECDECODE_SCREENSHOT=1
FRUITS = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine"
PROMPT = f"Here is a list of fruits: {FRUITS}. Write the same list again."
MAX_TOKENS = 48
STREAM_TIMEOUT_MS = 180_000


@pytest.fixture(scope="module")
def keyed_tiny_server():
    target = word_target(chat_template=CHAT_TEMPLATE, backend="native")
    with LocalServer(create_app(ServerConfig(target=target, served_model_name="tiny", api_key=API_KEY))) as server:
        yield server


def test_the_page_is_served_without_the_key_and_its_api_calls_need_it(keyed_tiny_server):
    with httpx.Client(base_url=keyed_tiny_server.url, timeout=30) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for element in PAGE_IDS:
            assert f'id="{element}"' in page.text, element
        for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
            served = http.get(f"/static/{name}")
            assert served.status_code == 200 and kind in served.headers["content-type"], name
            assert served.text == (STATIC / name).read_text()
        assert http.get("/v1/speculation").status_code == 401
        state = http.get("/v1/speculation", headers={"Authorization": f"Bearer {API_KEY}"})
        assert state.status_code == 200 and "lookup" in state.json()["proposers"]
    for name in ("index.html", "app.js", "style.css"):  # offline: nothing fetched from elsewhere
        assert "://" not in (STATIC / name).read_text(), name


# --- in a browser, over the bundled model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need: pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-background-networking"]
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def smollm2() -> sd.LoadedModel:
    return sd.load_model("smollm2")


def open_page(browser, url: str):
    """A fresh page (own localStorage) on ``url``; script errors are collected in ``page.script_errors``."""
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.script_errors = []
    page.on("pageerror", lambda error: page.script_errors.append(str(error)))
    page.goto(url)
    return page


def ask(page, prompt: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_selector("#output:is([data-state=done], [data-state=error])", timeout=STREAM_TIMEOUT_MS)


def token_spans(page) -> list[tuple[str, str]]:
    return page.eval_on_selector_all("#output span", "spans => spans.map(s => [s.dataset.source, s.textContent])")


@pytest.mark.slow
def test_the_page_streams_the_greedy_answer_token_by_token_and_races(browser, smollm2):
    # policy "always": "auto" weighs measured costs, and on some machine might not draft, leaving no draft spans
    config = ServerConfig(target=smollm2, served_model_name="smollm2", policy="always")
    with LocalServer(create_app(config)) as server:
        page = open_page(browser, server.url + "/")
        page.wait_for_selector("#proposer option", state="attached")  # /v1/speculation answered
        ask(page, PROMPT, MAX_TOKENS)
        assert page.is_hidden("#error"), page.text_content("#error")
        spans = token_spans(page)
        assert {"draft", "target"} <= {source for source, _ in spans}
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        expected = reply["choices"][0]["message"]["content"]
        assert "".join(text for _, text in spans) == expected
        assert float(page.text_content("#stat-tpp")) > 1  # drafts were accepted: more than a token a pass

        page.click("#race")
        page.wait_for_selector("#race-result:is([data-state=done], [data-state=error])", timeout=STREAM_TIMEOUT_MS)
        assert page.is_hidden("#error"), page.text_content("#error")
        assert page.get_attribute("#race-result", "data-identical") == "true"
        assert page.text_content("#race-plain") == page.text_content("#race-spec") == expected
        assert "identical" in page.text_content("#race-summary")
        page.wait_for_selector("#server-load:has-text('running 0')")  # the poll of /v1/speculation saw it end
        if os.environ.get("SPECDECODE_SCREENSHOT") == "1":  # the picture in docs/SERVING.md; a test run keeps the tree
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        assert not page.script_errors


@pytest.mark.slow
def test_the_page_asks_for_the_api_key_and_works_once_it_is_given(browser, smollm2):
    config = ServerConfig(target=smollm2, served_model_name="smollm2", api_key=API_KEY)
    with LocalServer(create_app(config)) as server:
        page = open_page(browser, server.url + "/")
        page.wait_for_selector("#error:not([hidden])")  # the first poll of /v1/speculation got a 401
        assert "API key" in page.text_content("#error")
        ask(page, "Count from 1 to 5.", 8)
        assert page.get_attribute("#output", "data-state") == "error"
        assert "API key" in page.text_content("#error")

        page.fill("#api-key", API_KEY)
        page.wait_for_selector("#error", state="hidden")
        ask(page, "Count from 1 to 5.", 8)
        assert page.get_attribute("#output", "data-state") == "done" and page.is_hidden("#error")
        assert token_spans(page)
        page.reload()
        assert page.input_value("#api-key") == API_KEY  # kept in localStorage
        assert not page.script_errors
