"""The browser playground of ``specem serve`` (``GET /``).

Plain HTTP: the page and its assets are served from the package with their content types and
reference nothing outside the server's origin; ``--no-ui`` takes them away; the default follows
the host (on for loopback only).

In a browser: headless Chromium (Debian's ``chromium``) driven by Playwright against a real
``specem serve`` on loopback with two packaged members that both draft (SmolLM2-135M and
Qwen2.5-Coder-0.5B) and a bearer key. The answer streamed into the page is compared with the
stream the server sent (captured from the browser's own request): one segment per content chunk,
coloured as the legend colours the round's winner, and a round's candidates and scores as the
trace gives them. A missing or wrong key is shown as a message. With ``SPECEM_SCREENSHOT=1`` the
test also saves ``docs/assets/playground.png`` mid-answer (the screenshot in the docs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import SERVER_KEY, ServeProcess, serving, start_serve

from specem_integrations.cli import _ui_enabled
from specem_integrations.server._playground import ASSETS

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "assets" / "playground.png"
TWO_DRAFTERS = ["--model", "smollm2", "--model", "qwen2.5-coder", "--max-concurrency", "1", "--no-access-log"]
QUESTION = "Name three colours of the rainbow and say one thing about each."
FOLLOW_UP = "Which of them is your favourite?"
SYSTEM = "You are a concise assistant."

WAIT_MS = 240_000
"""How long the browser waits for an answer (generous: the machine may be busy; nothing is timed)."""

# -- plain HTTP ----------------------------------------------------------------------------------

_EXTERNAL = re.compile(r"https?://|\b(?:src|href|action)\s*=\s*[\"']?//|url\(\s*[\"']?//|@import", re.IGNORECASE)
"""An absolute URL, a protocol-relative reference, or a CSS import: anything that could leave the origin."""


def test_the_page_and_its_assets_are_served_with_their_types_and_nothing_external(open_server: ServeProcess) -> None:
    page = httpx.get(f"{open_server.url}/", timeout=10.0)
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    referenced = re.findall(r"\b(?:src|href)=\"([^\"]+)\"", page.text)
    assert sorted(referenced) == sorted(f"playground/{name}" for name in ASSETS)
    assert not _EXTERNAL.findall(page.text)
    for name, content_type in ASSETS.items():
        asset = httpx.get(f"{open_server.url}/playground/{name}", timeout=10.0)
        assert asset.status_code == 200, name
        assert asset.headers["content-type"] == content_type
        assert asset.headers["x-content-type-options"] == "nosniff"
        assert asset.text.strip()
        assert not _EXTERNAL.findall(asset.text), (name, _EXTERNAL.findall(asset.text))
    # the script reaches the server only through the public endpoints, by relative URLs
    script = httpx.get(f"{open_server.url}/playground/playground.js", timeout=10.0).text
    assert set(re.findall(r"fetch\(\"([^\"]+)\"", script)) == {"v1/models", "v1/chat/completions"}
    # model text goes in as text only: nothing in the script parses a string as HTML
    assert not re.findall(r"\.(?:inner|outer)HTML\s*[+]?=|insertAdjacentHTML|document\.write|eval\(", script)
    missing = httpx.get(f"{open_server.url}/playground/nothing.js", timeout=10.0)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


def test_no_ui_serves_no_page_and_the_api_still_answers() -> None:
    with serving(["--model", "smollm2", "--no-ui", "--no-access-log", "--max-new-tokens", "4"]) as server:
        for path in ("/", "/playground/playground.js", "/playground/playground.css"):
            response = httpx.get(f"{server.url}{path}", timeout=10.0)
            assert response.status_code == 404, path
            assert response.json()["error"]["code"] == "not_found"
        assert "playground on" not in server.log()
        models = httpx.get(f"{server.base_url}/models", timeout=10.0)
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == "specem"


@pytest.mark.parametrize(
    ("flag", "host", "enabled"),
    [
        (None, "127.0.0.1", True),
        (None, "127.0.0.2", True),
        (None, "::1", True),
        (None, "[::1]", True),
        (None, "localhost", True),
        (None, "0.0.0.0", False),
        (None, "::", False),
        (None, "192.168.1.20", False),
        (None, "example.internal", False),
        (True, "0.0.0.0", True),
        (False, "127.0.0.1", False),
    ],
)
def test_the_playground_is_on_by_default_only_on_loopback(flag: bool | None, host: str, enabled: bool) -> None:
    assert _ui_enabled(flag, host) is enabled


# -- in a browser --------------------------------------------------------------------------------


def _chromium() -> str:
    """The system Chromium, or a skip that says why there is none."""
    for name in (os.environ.get("SPECEM_CHROMIUM", ""), "chromium", "chromium-browser"):
        path = shutil.which(name) if name else None
        if path:
            return path
    pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (it is in the test extra: pip install -e '.[test]')")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def two_drafters() -> Iterator[ServeProcess]:
    # one request at a time and none waiting, so that a second request at once is a 429 queue_full
    server = start_serve([*TWO_DRAFTERS, "--max-new-tokens", "48", "--queue", "0"], api_key=SERVER_KEY)
    try:
        yield server
    finally:
        server.cleanup()


def _stream(body: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body (``[DONE]`` dropped)."""
    chunks = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def _is_chat_completion(response: Any) -> bool:
    return str(response.url).endswith("/v1/chat/completions")


def _colour(locator: Any) -> str:
    return str(locator.evaluate("e => getComputedStyle(e).backgroundColor"))


def test_a_missing_then_wrong_key_is_shown_as_a_message(browser: Any, two_drafters: ServeProcess) -> None:
    page = browser.new_page()
    page.set_default_timeout(60_000)
    try:
        page.goto(two_drafters.url + "/")
        # no key yet: GET /v1/models is refused, and the page says so
        auth = page.get_by_test_id("auth-error")
        auth.wait_for(state="visible", timeout=10_000)
        assert "Authentication failed" in auth.inner_text()
        assert "didn't provide an API key" in auth.inner_text()
        # a wrong key: the chat request is a 401, shown as a readable message, and no answer is left
        wrong = "sk-wrong-key-0000"
        page.get_by_test_id("api-key").fill(wrong)
        page.get_by_test_id("api-key").dispatch_event("change")
        page.get_by_test_id("prompt").fill(QUESTION)
        with page.expect_response(_is_chat_completion, timeout=WAIT_MS) as sent:
            page.get_by_test_id("prompt").press("Enter")
        assert sent.value.status == 401
        error = page.get_by_test_id("error")
        error.wait_for(state="visible", timeout=10_000)
        assert error.get_attribute("data-code") == "invalid_api_key"
        assert error.inner_text().startswith("Authentication failed — Incorrect API key provided.")
        assert page.get_by_test_id("answer").count() == 0
        assert page.get_by_test_id("turn-user").count() == 0
        # the question is back in the box, and the keyboard focus is on the key to correct
        assert page.get_by_test_id("prompt").input_value() == QUESTION
        assert page.evaluate("() => document.activeElement.id") == "api-key"
        assert wrong not in page.locator("body").inner_text()  # the key is never displayed
        # the key stays in this tab: sessionStorage, never localStorage
        assert page.evaluate("() => Object.keys(localStorage).length") == 0
        assert page.evaluate("() => sessionStorage.getItem('specem-playground-api-key')") == wrong
    finally:
        page.close()


def _ask(page: Any, text: str) -> Any:
    """Send ``text`` from the page; the chat request's response (its status and headers)."""
    page.get_by_test_id("prompt").fill(text)
    with page.expect_response(_is_chat_completion, timeout=WAIT_MS) as sent:
        page.get_by_test_id("prompt").press("Enter")
    return sent.value


def test_a_too_long_conversation_and_a_full_queue_are_shown_as_messages(
    browser: Any, two_drafters: ServeProcess
) -> None:
    page = browser.new_page()
    page.set_default_timeout(60_000)
    try:
        page.goto(two_drafters.url + "/")
        page.get_by_test_id("api-key").fill(SERVER_KEY)
        page.get_by_test_id("api-key").dispatch_event("change")
        error = page.get_by_test_id("error")

        assert _ask(page, "word " * 12000).status == 400  # SmolLM2's window is 8192 tokens
        error.wait_for(state="visible")
        assert error.get_attribute("data-code") == "context_length_exceeded"
        assert error.inner_text().startswith("The conversation is too long for the members' context window")
        assert page.get_by_test_id("answer").count() == 0

        # a preset of other members is refused by the server, and the page says why
        page.get_by_text("Ensemble settings (per request)").click()  # a closed <details> until opened
        page.locator("#opt-preset").fill("quality")
        response = _ask(page, QUESTION)
        assert response.status == 400
        assert response.request.post_data_json["specem"] == {"preset": "quality"}
        page.locator("[data-testid=error][data-code=invalid_value]").wait_for()
        assert "(parameter specem.preset)" in error.inner_text()
        assert "start a server with --preset quality" in error.inner_text()
        page.locator("#opt-preset").fill("fast")  # the server's own members: allowed (below)

        # another client holds the only slot (its stream has started) and nothing may wait
        body = {
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 400,
            "stream": True,
            "specem": {"ignore_eos": True},  # it holds the slot until this test lets go
        }
        with httpx.stream(
            "POST", f"{two_drafters.base_url}/chat/completions", json=body, headers=two_drafters.headers(), timeout=300
        ) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)  # admitted and running
            response = _ask(page, QUESTION)
            assert response.status == 429
            retry_after = response.headers["retry-after"]
            page.locator("[data-testid=error][data-code=queue_full]").wait_for()
            assert error.inner_text() == (
                f"The server is busy: every slot is taken and its queue is full. Retry in about {retry_after} s."
            )
        two_drafters.wait_idle(120)
        # the page recovers: the same question now gets an answer
        page.get_by_test_id("max-tokens").fill("8")
        response = _ask(page, QUESTION)
        assert response.status == 200
        assert response.request.post_data_json["specem"] == {"preset": "fast"}
        page.locator("[data-testid=answer][data-state=done]").wait_for(timeout=WAIT_MS)
        assert error.is_hidden()
    finally:
        page.close()


def test_the_streamed_answer_shows_each_rounds_winner_candidates_and_scores(
    browser: Any, two_drafters: ServeProcess
) -> None:
    screenshot = os.environ.get("SPECEM_SCREENSHOT") == "1"
    page = browser.new_page(viewport={"width": 1360, "height": 860})
    page.set_default_timeout(60_000)
    try:
        page.goto(two_drafters.url + "/")
        page.get_by_test_id("api-key").fill(SERVER_KEY)
        page.get_by_test_id("api-key").dispatch_event("change")
        page.get_by_test_id("model-info").filter(has_text="2 members").wait_for(timeout=10_000)
        assert page.get_by_test_id("auth-error").is_hidden()
        legend = page.get_by_test_id("legend-item")
        members = [legend.nth(i).get_attribute("data-member") for i in range(legend.count())]
        assert members == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
        legend_colour = {
            m: _colour(page.locator(f'[data-testid=legend-item][data-member="{m}"] [data-testid=legend-swatch]'))
            for m in members
        }
        assert len(set(legend_colour.values())) == 2, legend_colour

        page.get_by_test_id("system").fill(SYSTEM)
        page.get_by_test_id("temperature").fill("0")
        page.get_by_text("Ensemble settings (per request)").click()  # a closed <details> until opened
        page.get_by_label("Model Exit").select_option("false")  # every round keeps both drafters
        if screenshot:  # a longer answer, so that the picture is taken while it streams
            page.get_by_test_id("max-tokens").fill("160")
        else:
            page.get_by_test_id("max-tokens").fill("40")
        page.get_by_test_id("prompt").fill(QUESTION)
        with page.expect_response(_is_chat_completion, timeout=WAIT_MS) as sent:
            page.get_by_test_id("prompt").press("Enter")
            if screenshot:
                _screenshot_mid_answer(page)
        response = sent.value
        request = response.request.post_data_json
        assert response.request.headers["x-specem-trace"] == "1"
        assert request["stream"] is True
        assert request["messages"] == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
        ]
        assert request["temperature"] == 0
        assert request["specem"] == {"model_exit": False}
        answer = page.get_by_test_id("answer")
        page.locator("[data-testid=answer][data-state=done]").wait_for(timeout=WAIT_MS)
        chunks = _stream(response.text())

        # one segment per content chunk, in order, with the chunk's text and round
        content = [c for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")]
        assert len(content) >= 2, "the answer should take several rounds"
        segments = answer.get_by_test_id("segment")
        assert segments.count() == len(content)
        for i, chunk in enumerate(content):
            segment = segments.nth(i)
            trace = chunk["specem"]
            assert segment.text_content() == chunk["choices"][0]["delta"]["content"]
            assert segment.get_attribute("data-round") == str(trace["index"])
            assert segment.get_attribute("data-winner") == trace["winner"]
            # coloured as the legend colours the member the trace names as the round's winner
            assert _colour(segment) == legend_colour[trace["winner"]], (i, trace["winner"])

        # the per-answer summary: wins per member and drafters per round, as the final trace says
        final = next(c["specem"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"])
        wins = page.get_by_test_id("summary-wins")
        for member, count in final["wins"].items():
            assert wins.locator(f'[data-member="{member}"]').get_attribute("data-wins") == str(count)
        assert page.get_by_test_id("summary-drafters").inner_text() == " · ".join(
            str(n) for n in final["members_per_round"]
        )
        assert "tokens in" in page.get_by_test_id("summary-tps").inner_text()
        assert page.get_by_test_id("summary-first").inner_text().endswith("s on the server")

        # a round with both drafters' candidates, opened from the keyboard (focus + Enter)
        index = next(i for i, c in enumerate(content) if len(c["specem"]["candidates"]) >= 2)
        trace = content[index]["specem"]
        segments.nth(index).focus()
        page.keyboard.press("Enter")
        panel = page.get_by_test_id("round")
        panel.wait_for(state="visible")
        assert panel.get_attribute("data-round") == str(trace["index"])
        assert page.get_by_test_id("round-title").inner_text().endswith(trace["winner"])
        candidates = panel.get_by_test_id("candidate")
        assert candidates.count() == len(trace["candidates"]) >= 2
        for i, candidate in enumerate(trace["candidates"]):
            row = candidates.nth(i)
            assert row.get_attribute("data-member") == candidate["member"]
            assert row.get_by_test_id("candidate-text").text_content() == candidate["text"] + (
                " ⏹" if candidate["ended"] else ""
            )
            assert row.get_by_test_id("combined").inner_text().startswith(f"{trace['combined'][i]:.3f}")
        score_rows = panel.get_by_test_id("score-row")
        assert score_rows.count() == len(trace["verifiers"]) == 2
        for j, verifier in enumerate(trace["verifiers"]):
            row = score_rows.nth(j)
            assert row.get_attribute("data-verifier") == verifier
            assert row.get_by_test_id("weight").inner_text() == f"{trace['weights'][j]:.3f}"
            raw = [row.get_by_test_id("raw-score").nth(i).inner_text() for i in range(len(trace["candidates"]))]
            norm = [row.get_by_test_id("norm-score").nth(i).inner_text() for i in range(len(trace["candidates"]))]
            assert raw == [f"{v:.3f}" for v in trace["raw_scores"][j]]
            assert norm == [f"{v:.3f}" for v in trace["normalized"][j]]
        page.keyboard.press("Escape")
        panel.wait_for(state="hidden")

        # the next turn carries the conversation: system prompt, question, the answer shown, follow-up
        shown = answer.first.text_content()
        page.get_by_test_id("max-tokens").fill("16")
        page.get_by_test_id("prompt").fill(FOLLOW_UP)
        with page.expect_response(_is_chat_completion, timeout=WAIT_MS) as second:
            page.get_by_test_id("send").click()
        assert second.value.request.post_data_json["messages"] == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": shown},
            {"role": "user", "content": FOLLOW_UP},
        ]
        page.locator("[data-testid=answer][data-state=done]").nth(1).wait_for(timeout=WAIT_MS)
        assert page.get_by_test_id("error").is_hidden()
    finally:
        page.close()


def _screenshot_mid_answer(page: Any) -> None:
    """Save the page while the answer streams, with the first round's details open."""
    page.locator("[data-testid=answer] [data-testid=segment]").nth(2).wait_for(timeout=WAIT_MS)
    page.get_by_test_id("segment").first.click()
    page.get_by_test_id("round").wait_for(state="visible")
    assert page.locator("[data-testid=answer][data-state=streaming]").count() == 1, "the answer ended too soon"
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))
