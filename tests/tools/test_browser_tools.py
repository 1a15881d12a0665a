"""Every browser tool in a real headless Chromium against the local fixture site.

All tests share one event loop (the shared browser belongs to the loop that launched it). Without
Chromium the tests are skipped locally but fail under CI (env var CI set).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import os
import re

import pytest

from agent.model_client import ModelClient, RetryPolicy, SessionModel
from tests.helpers.model_server import ModelServer
from tests.helpers.web_fixtures import FixtureSite, make_ctx, run_cleanups
from tools import browser_tools as bt
from tools.registry import unavailable_reason
from tools.settings import ToolSettings

pytestmark = pytest.mark.browser
CHROMIUM = "/usr/bin/chromium"


def _missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed"
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is missing"
    return None


@pytest.fixture(scope="module", autouse=True)
def require_chromium():
    reason = _missing()
    if reason and os.environ.get("CI"):
        pytest.fail(f"browser tests need Chromium under CI: {reason}")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(bt.shutdown_browser())
    loop.close()


@pytest.fixture(scope="module")
def site():
    with FixtureSite() as site:
        yield site


@pytest.fixture(scope="module")
def model_server():
    with ModelServer(latency=0.0) as server:
        yield server


@pytest.fixture
def session(loop, model_server):
    """A fresh tool session (its own browser context) with a model client on the local server."""
    settings = ToolSettings(model="run-model", vision_model="vision-model", browser_executable=CHROMIUM,
                            browser_timeout=15)
    client = ModelClient(model_server.base_url, "test-key", policy=RetryPolicy(max_attempts=1, request_timeout=30))
    ctx = make_ctx(settings, model=SessionModel(client, "run-model"))

    def call(tool: str, **args) -> dict:
        return loop.run_until_complete(getattr(bt, tool)(args, ctx))

    call.ctx = ctx
    yield call
    loop.run_until_complete(run_cleanups(ctx))
    loop.run_until_complete(client.close())


def snapshot(call, full=False) -> str:
    result = call("browser_snapshot", full=full)
    assert "error" not in result, result
    return result["snapshot"]


def ref(text: str, role: str, name: str) -> str:
    match = re.search(rf'- {re.escape(role)} "{re.escape(name)}" \[@(e\d+)\]', text)
    assert match, f"no {role} {name!r} in snapshot:\n{text}"
    return "@" + match.group(1)


def test_navigate_and_snapshot_refs(session, site):
    result = session("browser_navigate", url=site.url("/"))
    assert result == {"success": True, "url": site.url("/"), "title": "Fixture Home", "status": 200}
    result = session("browser_snapshot")
    text = result["snapshot"]
    assert text.startswith(f"Title: Fixture Home\nURL: {site.url('/')}\n")
    assert "# Fixture home" in text and "Welcome to the local test site." in text
    assert result["interactive_elements"] == 4
    refs = [ref(text, "textbox", "Your name"), ref(text, "button", "Submit"),
            ref(text, "button", "Change text"), ref(text, "link", "Second page")]
    assert len(set(refs)) == 4
    assert '"Second page" [@e4] -> /second' in text
    assert snapshot(session) == text  # refs are stable across snapshots


def test_type_and_click_submit_shows_text(session, site):
    session("browser_navigate", url=site.url("/"))
    text = snapshot(session)
    typed = session("browser_type", ref=ref(text, "textbox", "Your name"), text="hello world")
    assert typed["success"] and typed["text"] == "hello world"
    assert 'value="hello world"' in snapshot(session)
    clicked = session("browser_click", ref=ref(text, "button", "Submit").lstrip("@"))  # "e2" works too
    assert clicked["success"] and clicked["url"] == site.url("/submitted?q=hello+world")
    assert "You typed: hello world" in snapshot(session)


def test_button_click_changes_text(session, site):
    session("browser_navigate", url=site.url("/"))
    text = snapshot(session)
    assert "Not clicked yet" in text
    assert session("browser_click", ref=ref(text, "button", "Change text"))["success"]
    after = snapshot(session)
    assert "Clicked!" in after and "Not clicked yet" not in after


def test_link_back_and_press_enter(session, site):
    session("browser_navigate", url=site.url("/"))
    text = snapshot(session)
    assert session("browser_click", ref=ref(text, "link", "Second page"))["url"] == site.url("/second")
    assert "# Second page" in snapshot(session)
    back = session("browser_back")
    assert back["success"] and back["url"] == site.url("/") and back["title"] == "Fixture Home"

    text = snapshot(session)
    session("browser_type", ref=ref(text, "textbox", "Your name"), text="via enter")
    pressed = session("browser_press", key="Enter")
    assert pressed["pressed"] == "Enter" and pressed["url"] == site.url("/submitted?q=via+enter")
    assert "You typed: via enter" in snapshot(session)


def test_scroll_and_full_snapshot(session, site):
    session("browser_navigate", url=site.url("/article"))
    down = session("browser_scroll", direction="down")
    assert down["success"] and down["scroll_y"] > 0 and not down["at_bottom"]
    assert session("browser_scroll", direction="down")["scroll_y"] > down["scroll_y"]
    up = session("browser_scroll", direction="up")
    assert 0 < up["scroll_y"] < down["scroll_y"] * 2
    assert "error" in session("browser_scroll", direction="sideways")

    short, full = snapshot(session), snapshot(session, full=True)
    assert "THE END" in short and "THE END" in full
    assert "End of paragraph 80." in full and "End of paragraph 80." not in short  # long lines are cut
    assert "# Long Article" in full and "## Introduction" in full


def test_get_images(session, site):
    session("browser_navigate", url=site.url("/"))
    result = session("browser_get_images")
    assert result["count"] == 2
    red, blue = result["images"]
    assert red["src"] == site.url("/img/red.png") and red["alt"] == "Red rectangle"
    assert (red["width"], red["height"]) == (40, 30)
    assert blue["src"] == site.url("/img/blue.png") and (blue["width"], blue["height"]) == (16, 24)


def test_console_evaluates_and_captures(session, site):
    session("browser_navigate", url=site.url("/"))
    result = session("browser_console", expression="document.title")
    assert result["result"] == "Fixture Home"
    assert {"type": "log", "text": "fixture loaded"} in result["console"]

    text = snapshot(session)
    session("browser_click", ref=ref(text, "button", "Change text"))
    result = session("browser_console", expression="console.warn('from tool'), ({a: [1, 2]})", clear=True)
    assert result["result"] == {"a": [1, 2]}
    assert {"type": "log", "text": "button clicked"} in result["console"]
    assert {"type": "warning", "text": "from tool"} in result["console"]
    assert session("browser_console")["console"] == []  # cleared

    broken = session("browser_console", expression="no_such_variable.x")
    assert "no_such_variable" in broken["error"]


def test_vision_sends_screenshot_to_model(session, site, model_server):
    session("browser_navigate", url=site.url("/"))
    model_server.reset()
    result = session("browser_vision", question="What colour is the first image?", annotate=True)
    assert result["analysis"] and result["url"] == site.url("/")
    (request,) = model_server.requests
    assert request.body["model"] == "vision-model"
    # the tool's model call is in the row's usage, under its own model
    assert session.ctx.model.stats.by_model["vision-model"].requests == 1 == session.ctx.model.stats.requests
    text_part, image_part = request.body["messages"][0]["content"]
    assert "What colour is the first image?" in text_part["text"] and site.url("/") in text_part["text"]
    assert image_part["type"] == "image_url"
    url = image_part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    assert "__abr_label" not in str(session("browser_console", expression="document.body.innerHTML")["result"])


def test_errors_are_reported(session, site):
    session("browser_navigate", url=site.url("/"))
    assert "invalid ref" in session("browser_click", ref="#submit")["error"]
    assert "browser_snapshot" in session("browser_click", ref="@e999")["error"]
    assert "error" in session("browser_navigate", url="file:///etc/passwd")
    assert "error" in session("browser_navigate", url="http://127.0.0.1:9/unreachable")
    assert "error" in session("browser_press", key="NoSuchKey")


def test_back_without_history(session, site):
    session("browser_navigate", url=site.url("/second"))
    assert "no previous page" in session("browser_back")["error"]
    assert session("browser_console", expression="location.pathname")["result"] == "/second"


def test_close_and_session_cleanup(session, site, loop):
    assert session("browser_close") == {"success": True, "closed": False, "message": "no browser session was open"}
    session("browser_navigate", url=site.url("/"))
    first = session.ctx.state[bt._STATE_KEY]
    assert first.context in bt._Shared.browser.contexts
    assert session("browser_close") == {"success": True, "closed": True}
    assert first.closed and first.context not in bt._Shared.browser.contexts

    session("browser_navigate", url=site.url("/second"))  # a new context after close
    second = session.ctx.state[bt._STATE_KEY]
    assert second is not first and second.context in bt._Shared.browser.contexts
    loop.run_until_complete(run_cleanups(session.ctx))  # what the runner does at session end
    assert second.closed and bt._Shared.browser.contexts == []


def test_sessions_are_isolated(loop, site, session):
    other_ctx = make_ctx(session.ctx.settings, model=session.ctx.model)
    session("browser_navigate", url=site.url("/second"))
    loop.run_until_complete(bt.browser_navigate({"url": site.url("/article")}, other_ctx))
    assert session("browser_console", expression="location.pathname")["result"] == "/second"
    loop.run_until_complete(run_cleanups(other_ctx))


def test_unavailable_reasons():
    def reason(**settings):
        return unavailable_reason(bt.TOOLS[0], ToolSettings(**settings))

    assert reason(browser_executable=CHROMIUM) is None
    assert "/nope/chromium" in reason(browser_executable="/nope/chromium")
    assert "browser_executable" in reason(browser_executable=None)
    assert [t.name for t in bt.TOOLS] == [
        "browser_navigate", "browser_snapshot", "browser_click", "browser_type", "browser_scroll",
        "browser_back", "browser_press", "browser_close", "browser_get_images", "browser_vision",
        "browser_console",
    ]


def test_session_survives_a_browser_crash(session, site, loop):
    session("browser_navigate", url=site.url("/"))
    loop.run_until_complete(bt._Shared.browser.close())  # as if Chromium died
    result = session("browser_navigate", url=site.url("/second"))
    assert result["success"] and result["title"] == "Second Page"


def test_type_into_a_select_picks_the_option(session, site):
    session("browser_navigate", url=site.url("/second"))
    session("browser_console", expression="document.body.insertAdjacentHTML('beforeend', "
            "'<select aria-label=\"Fruit\"><option value=a>Apple</option><option value=b>Banana</option></select>')")
    text = snapshot(session)
    assert re.search(r'- combobox "Fruit" \[@e\d+\] selected="Apple" options=\[Apple, Banana\]', text), text
    assert session("browser_type", ref=ref(text, "combobox", "Fruit"), text="Banana")["success"]
    assert 'selected="Banana"' in snapshot(session)
