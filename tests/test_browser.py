"""The web app in a real browser (Debian's chromium driven by Playwright): a chat reply streams into the
chatbot, and a completion shows its tokens coloured by probability. Saves docs/screenshot*.png."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from app_server import REPO_ROOT, serve_app

from llama_core.app import ui
from llama_core.serving import stream_completion

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
TIMEOUT_MS = 60_000

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
expect = sync_api.expect
expect.set_options(timeout=TIMEOUT_MS)  # generous: CPU-only machines may be busy


@pytest.fixture(scope="module")
def served():
    with serve_app(max_seq_len=512) as (engine, url):  # room for a completion long enough to stop
        yield engine, url


@pytest.fixture(scope="module")
def page(served):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(served[1])
        yield page
        browser.close()


def set_number(page, selector: str, value: int) -> None:
    box = page.locator(f"{selector} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def test_chat_reply_streams_into_the_chatbot(page):
    message = "Good morrow, my lord. What news from the court?"
    page.fill("#chat-input textarea", message)
    page.click("#chat-send")
    expect(page.locator('#chatbot [data-testid="user"]')).to_have_text(message)
    expect(page.locator('#chatbot [data-testid="bot"]').first).to_have_text(re.compile(r"\S"))
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s")  # the reply has finished
    expect(page.locator("#chat-input textarea")).to_have_value("")
    page.screenshot(path=str(REPO_ROOT / "docs" / "screenshot.png"))


def test_completion_shows_tokens_coloured_by_probability(page):
    page.click("#completion-tab-button")
    page.check("#completion-probabilities input")
    page.fill("#completion-prompt textarea", "ROMEO:\nBut soft, what light")
    page.click("#completion-generate")
    expect(page.locator("#completion-stats")).to_contain_text("tokens/s")
    expect(page.locator("#completion-output textarea")).to_have_value(re.compile(r"\S"))
    tokens = page.locator("#completion-tokens .token")
    assert tokens.count() > 0
    probabilities = [float(label) for label in page.locator("#completion-tokens .label").all_inner_texts()]
    assert len(probabilities) == tokens.count() and all(0.0 <= p <= 1.0 for p in probabilities)
    colours = tokens.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
    assert all(c not in ("rgba(0, 0, 0, 0)", "transparent") for c in colours)
    page.screenshot(path=str(REPO_ROOT / "docs" / "screenshot-completion.png"), full_page=True)


def test_model_tab_shows_the_checkpoint_and_its_size(page):
    page.click("#model-tab-button")
    expect(page.locator("#model-facts")).to_contain_text("Parameters")
    expect(page.locator("#model-facts")).to_contain_text("max_seq_len")


def test_stop_cancels_the_request_in_the_engine(page, served, monkeypatch):
    engine = served[0]
    cancels = []  # per cancel() call: was the request still running?

    def recording_stream_completion(*args, **kwargs):
        stream = stream_completion(*args, **kwargs)
        cancel = stream.cancel
        stream.cancel = lambda: (cancels.append(stream.finish_reason is None), cancel())
        return stream

    monkeypatch.setattr(ui, "stream_completion", recording_stream_completion)
    page.click("#completion-tab-button")
    page.uncheck("#completion-probabilities input")
    set_number(page, "#completion-max-new-tokens", engine.info.max_seq_len - 16)
    set_number(page, "#completion-temperature", 0)
    page.fill("#completion-prompt textarea", "ROMEO:\n")
    output = page.locator("#completion-output textarea")
    earlier = output.input_value()
    page.click("#completion-generate")
    expect(output).not_to_have_value(earlier)  # streaming: the new completion has begun
    expect(output).to_have_value(re.compile(r"\S"))
    page.locator("#completion-stop").dispatch_event("click")
    expect(page.locator("#completion-stats")).to_contain_text("Stopped.")
    deadline = time.monotonic() + 10
    while (engine.active_count or not cancels) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancels and cancels[0], "Stop should cancel the running request in the engine"
    assert engine.active_count == 0


def test_retry_undo_and_clear(page):
    user, bot = page.locator('#chatbot [data-testid="user"]'), page.locator('#chatbot [data-testid="bot"]')
    page.click("#chat-tab-button")
    page.click("#chat-clear")
    expect(user).to_have_count(0)
    set_number(page, "#chat-max-new-tokens", 8)
    page.fill("#chat-input textarea", "Speak, speak.")
    page.click("#chat-send")
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s")

    page.click("#chat-retry")
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s")
    expect(user).to_have_count(1)
    expect(bot).to_have_count(1)

    page.click("#chat-undo")
    expect(user).to_have_count(0)
    expect(page.locator("#chat-input textarea")).to_have_value("Speak, speak.")

    page.click("#chat-send")
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s")
    expect(bot).to_have_count(1)
    page.click("#chat-clear")
    expect(user).to_have_count(0)
    expect(page.locator("#chat-stats")).to_have_text("")
