"""The browser toolset: a headless Chromium driven through Playwright's async API.

One browser per worker process, launched on first use and shared by all its sessions. Each session
gets its own browser context (cookies, storage) and page, created on its first browser call and
closed by a cleanup at session end, or earlier by browser_close.

browser_snapshot tags every interactive element with a `data-abr-ref="eN"` attribute and lists it
as `@eN`; click/type act on those refs, so they stay valid until the page changes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
from typing import Any, Awaitable, Callable

from tools.environments.base import truncate_output
from tools.registry import ToolContext, ToolSpec

# Without the background-networking flags Chromium keeps calling home, which floods a closed network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 900}
SNAPSHOT_LIMIT = 20_000  # characters of a default snapshot
TEXT_LINE_LIMIT = 150  # characters per text line in a default snapshot
MAX_CONSOLE_MESSAGES = 500
_STATE_KEY = "browser_session"
_LOCK_KEY = "browser_lock"
_REF_ATTR = "data-abr-ref"

_SNAPSHOT_JS = r"""
({full, lineLimit}) => {
  const SEL = 'a[href],button,input,select,textarea,summary,[role=button],[role=link],[role=checkbox],'
    + '[role=radio],[role=tab],[role=menuitem],[role=option],[role=switch],[role=textbox],'
    + '[role=combobox],[contenteditable=""],[contenteditable=true],[onclick]';
  const SKIP = new Set(['SCRIPT', 'STYLE', 'NOSCRIPT', 'TEMPLATE', 'SVG', 'IFRAME', 'CANVAS']);
  const clean = s => (s || '').replace(/\s+/g, ' ').trim();
  const cut = (s, n) => s.length > n ? s.slice(0, n - 1) + '…' : s;
  const visible = el => el.checkVisibility ? el.checkVisibility({visibilityProperty: true, checkVisibilityCSS: true})
                                           : el.getClientRects().length > 0;
  const lines = [];
  let seq = window.__abrRefSeq || 0, count = 0;
  const pushText = text => {
    for (const raw of (text || '').split('\n')) {
      const line = clean(raw);
      if (line) lines.push(full ? line : cut(line, lineLimit));
    }
  };
  const roleOf = el => {
    const tag = el.tagName.toLowerCase(), type = (el.getAttribute('type') || 'text').toLowerCase();
    if (el.getAttribute('role')) return el.getAttribute('role');
    if (tag === 'a') return 'link';
    if (tag === 'button' || (tag === 'input' && ['submit', 'button', 'reset', 'image'].includes(type))) return 'button';
    if (tag === 'input' && ['checkbox', 'radio'].includes(type)) return type;
    if (tag === 'input') return type === 'text' ? 'textbox' : `textbox(${type})`;
    if (tag === 'textarea' || el.isContentEditable) return 'textbox';
    if (tag === 'select') return 'combobox';
    if (tag === 'summary') return 'summary';
    return 'clickable';
  };
  const nameOf = el => {
    const isField = ['INPUT', 'TEXTAREA', 'SELECT'].includes(el.tagName);
    const buttonValue = el.tagName === 'INPUT' && ['submit', 'button', 'reset'].includes(el.type) ? el.value : '';
    return clean(el.getAttribute('aria-label') || (el.labels && el.labels[0] && el.labels[0].innerText)
      || (isField ? '' : el.innerText) || buttonValue || el.getAttribute('placeholder')
      || el.getAttribute('title') || el.getAttribute('alt') || el.getAttribute('name') || '');
  };
  const describe = (el, ref) => {
    const role = roleOf(el);
    let line = `- ${role} "${cut(nameOf(el), 100)}" [@${ref}]`;
    if (el.tagName === 'A') line += ` -> ${cut(el.getAttribute('href') || '', 120)}`;
    if (role.startsWith('textbox') && el.value) line += ` value="${cut(el.value, 80)}"`;
    if (el.tagName === 'SELECT') {
      const opts = Array.from(el.options).map(o => clean(o.text));
      line += ` selected="${clean(el.selectedOptions[0] ? el.selectedOptions[0].text : '')}"`
        + ` options=[${cut(opts.join(', '), 200)}]`;
    }
    if (el.checked) line += ' checked';
    if (el.disabled) line += ' disabled';
    return line;
  };
  const walk = el => {
    if (SKIP.has(el.tagName.toUpperCase()) || !visible(el)) return;
    if (el !== document.body && el.matches(SEL)) {
      let ref = el.getAttribute('data-abr-ref');
      if (!ref) { ref = 'e' + (++seq); el.setAttribute('data-abr-ref', ref); }
      count++;
      lines.push(describe(el, ref));
      return;
    }
    if (el.tagName === 'IMG') { if (clean(el.alt)) lines.push(`- image "${cut(clean(el.alt), 100)}"`); return; }
    const heading = /^H([1-6])$/.exec(el.tagName);
    if (heading) { const t = clean(el.innerText); if (t) lines.push('#'.repeat(+heading[1]) + ' ' + t); return; }
    if (!el.querySelector(SEL + ',h1,h2,h3,h4,h5,h6')) { pushText(el.innerText); return; }
    for (const child of el.childNodes) {
      if (child.nodeType === Node.TEXT_NODE) pushText(child.textContent);
      else if (child.nodeType === Node.ELEMENT_NODE) walk(child);
    }
  };
  if (document.body) walk(document.body);
  window.__abrRefSeq = seq;
  return {lines, count};
}
"""

_ANNOTATE_JS = """
() => {
  for (const el of document.querySelectorAll('[data-abr-ref]')) {
    const r = el.getBoundingClientRect();
    if (!r.width || !r.height || r.bottom < 0 || r.top > innerHeight) continue;
    const tag = document.createElement('div');
    tag.className = '__abr_label';
    tag.textContent = '@' + el.getAttribute('data-abr-ref');
    tag.style.cssText = `position:fixed;left:${r.left}px;top:${Math.max(0, r.top - 14)}px;z-index:2147483647;`
      + 'background:#d00;color:#fff;font:bold 11px monospace;padding:0 2px;pointer-events:none';
    document.body.appendChild(tag);
  }
}
"""

_IMAGES_JS = """
() => Array.from(document.images).filter(img => img.currentSrc || img.src).slice(0, 100).map(img => ({
  src: (img.currentSrc || img.src).slice(0, 300), alt: img.alt || '',
  width: img.naturalWidth, height: img.naturalHeight,
  displayed_width: Math.round(img.getBoundingClientRect().width),
  displayed_height: Math.round(img.getBoundingClientRect().height),
}))
"""

_SCROLL_JS = """
(direction) => {
  window.scrollBy(0, (direction === 'down' ? 1 : -1) * Math.round(innerHeight * 0.8));
  const height = document.documentElement.scrollHeight;
  return {scroll_y: Math.round(scrollY), page_height: height, viewport_height: innerHeight,
          at_top: scrollY <= 0, at_bottom: scrollY + innerHeight >= height - 2};
}
"""


# ---------------------------------------------------------------- the shared browser (one per process)


class _Shared:
    loop: asyncio.AbstractEventLoop | None = None
    lock: asyncio.Lock | None = None
    playwright: Any = None
    browser: Any = None


async def _get_browser(settings) -> Any:
    loop = asyncio.get_running_loop()
    if _Shared.loop is not loop:
        # Playwright objects belong to the event loop that made them: a new loop starts over.
        _Shared.loop, _Shared.lock, _Shared.playwright, _Shared.browser = loop, asyncio.Lock(), None, None
    async with _Shared.lock:
        if _Shared.browser is None or not _Shared.browser.is_connected():
            from playwright.async_api import async_playwright

            if _Shared.playwright is None:
                _Shared.playwright = await async_playwright().start()
            _Shared.browser = await _Shared.playwright.chromium.launch(
                executable_path=settings.browser_executable,
                args=CHROMIUM_ARGS,
                headless=True,
                timeout=settings.browser_timeout * 1000,
            )
    return _Shared.browser


async def shutdown_browser() -> None:
    """Close this process's shared browser and Playwright driver (call before the event loop ends)."""
    browser, playwright = _Shared.browser, _Shared.playwright
    _Shared.browser = _Shared.playwright = None
    for closer in (browser and browser.close, playwright and playwright.stop):
        if closer:
            try:
                await closer()
            except Exception:
                pass


# ---------------------------------------------------------------- per-session context and page


class _Session:
    def __init__(self, context: Any):
        self.context = context
        self.page: Any = None
        self.console: list[dict] = []
        self.closed = False
        self._pages: set[int] = set()

    def adopt(self, page: Any) -> None:
        """Make `page` current (new tabs and popups take over) and capture its console."""
        self.page = page
        if id(page) not in self._pages:
            self._pages.add(id(page))
            page.on("console", lambda msg: self._log(msg.type, msg.text))
            page.on("pageerror", lambda exc: self._log("pageerror", str(exc)))

    def _log(self, kind: str, text: str) -> None:
        self.console.append({"type": kind, "text": text[:2000]})
        del self.console[:-MAX_CONSOLE_MESSAGES]

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                await self.context.close()
            except Exception:
                pass


async def _session(ctx: ToolContext) -> _Session:
    session = ctx.state.get(_STATE_KEY)
    if session is not None and not (session.context.browser and session.context.browser.is_connected()):
        session.closed = True  # the browser died: start over in a new one
    if session is None or session.closed:
        browser = await _get_browser(ctx.settings)
        context = await browser.new_context(viewport=VIEWPORT)
        context.set_default_timeout(ctx.settings.browser_timeout * 1000)
        session = _Session(context)
        context.on("page", session.adopt)
        session.adopt(await context.new_page())
        ctx.state[_STATE_KEY] = session
        ctx.cleanups.append(session.close)
    elif session.page.is_closed():
        live = [p for p in session.context.pages if not p.is_closed()]
        session.adopt(live[-1] if live else await session.context.new_page())
    return session


def _error_text(exc: Exception) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}"[:500]


async def _run(ctx: ToolContext, action: Callable[[_Session], Awaitable[dict]]) -> dict:
    """Run one browser action with the session's lock held, turning failures into {"error": ...}."""
    lock = ctx.state.setdefault(_LOCK_KEY, asyncio.Lock())
    async with lock:
        try:
            return await action(await _session(ctx))
        except Exception as exc:
            return {"error": _error_text(exc)}


async def _settle(page: Any) -> None:
    """Give an action's navigation or DOM update a moment to start, then wait (briefly) for load."""
    await asyncio.sleep(0.15)
    try:
        await page.wait_for_load_state("load", timeout=5000)
    except Exception:
        pass


async def _where(page: Any) -> dict:
    try:
        title = await page.title()
    except Exception:  # the page is between documents
        title = ""
    return {"url": page.url, "title": title}


def _locate(page: Any, ref: Any) -> Any:
    ref = str(ref or "").strip().lstrip("@")
    if not re.fullmatch(r"e\d+", ref):
        raise ValueError(f"invalid ref {ref!r}: use a ref like @e5 from browser_snapshot")
    return page.locator(f'[{_REF_ATTR}="{ref}"]').first, ref


async def _require(locator: Any, ref: str) -> None:
    if await locator.count() == 0:
        raise LookupError(f"no element @{ref} on this page; take a new browser_snapshot to get current refs")


# ---------------------------------------------------------------- tools


async def browser_navigate(args: dict, ctx: ToolContext) -> dict:
    url = str(args.get("url") or "").strip()
    if not url:
        return {"error": "url must not be empty"}
    if "://" not in url and not url.startswith("about:"):
        url = "https://" + url
    if not re.match(r"^(https?://|about:blank$)", url, re.IGNORECASE):
        return {"error": "only http(s) URLs can be opened"}

    async def action(s: _Session) -> dict:
        response = await s.page.goto(url, wait_until="domcontentloaded")
        try:
            await s.page.wait_for_load_state("load", timeout=5000)
        except Exception:
            pass
        result = {"success": True, **await _where(s.page)}
        if response is not None:
            result["status"] = response.status
        return result

    return await _run(ctx, action)


async def browser_snapshot(args: dict, ctx: ToolContext) -> dict:
    full = bool(args.get("full", False))

    async def action(s: _Session) -> dict:
        data = await s.page.evaluate(_SNAPSHOT_JS, {"full": full, "lineLimit": TEXT_LINE_LIMIT})
        where = await _where(s.page)
        text = f"Title: {where['title']}\nURL: {where['url']}\n\n" + "\n".join(data["lines"])
        limit = ctx.settings.max_output_chars if full else min(SNAPSHOT_LIMIT, ctx.settings.max_output_chars)
        return {"snapshot": truncate_output(text, limit), "interactive_elements": data["count"]}

    return await _run(ctx, action)


async def browser_click(args: dict, ctx: ToolContext) -> dict:
    async def action(s: _Session) -> dict:
        locator, ref = _locate(s.page, args.get("ref"))
        await _require(locator, ref)
        await locator.click()
        await _settle(s.page)
        return {"success": True, "clicked": f"@{ref}", **await _where(s.page)}

    return await _run(ctx, action)


async def browser_type(args: dict, ctx: ToolContext) -> dict:
    text = args.get("text")
    if not isinstance(text, str):
        return {"error": "text must be a string"}

    async def action(s: _Session) -> dict:
        locator, ref = _locate(s.page, args.get("ref"))
        await _require(locator, ref)
        if await locator.evaluate("el => el.tagName") == "SELECT":
            await locator.select_option(text)  # picks the option whose value or label is `text`
        else:
            await locator.fill(text)  # replaces the field's current content
        return {"success": True, "typed_into": f"@{ref}", "text": text}

    return await _run(ctx, action)


async def browser_scroll(args: dict, ctx: ToolContext) -> dict:
    direction = args.get("direction")
    if direction not in ("up", "down"):
        return {"error": "direction must be 'up' or 'down'"}

    async def action(s: _Session) -> dict:
        return {"success": True, "direction": direction, **await s.page.evaluate(_SCROLL_JS, direction)}

    return await _run(ctx, action)


async def browser_back(args: dict, ctx: ToolContext) -> dict:
    async def action(s: _Session) -> dict:
        before = s.page.url
        response = await s.page.go_back(wait_until="domcontentloaded")
        if s.page.url == "about:blank" and before != "about:blank":
            await s.page.go_forward(wait_until="domcontentloaded")  # the blank start page is not a page
            response, before = None, s.page.url
        if response is None and s.page.url == before:
            return {"error": "there is no previous page in this tab's history"}
        return {"success": True, **await _where(s.page)}

    return await _run(ctx, action)


async def browser_press(args: dict, ctx: ToolContext) -> dict:
    key = str(args.get("key") or "").strip()
    if not key:
        return {"error": "key must not be empty"}

    async def action(s: _Session) -> dict:
        await s.page.keyboard.press(key)
        await _settle(s.page)
        return {"success": True, "pressed": key, **await _where(s.page)}

    return await _run(ctx, action)


async def browser_close(args: dict, ctx: ToolContext) -> dict:
    session = ctx.state.pop(_STATE_KEY, None)
    if session is None or session.closed:
        return {"success": True, "closed": False, "message": "no browser session was open"}
    async with ctx.state.setdefault(_LOCK_KEY, asyncio.Lock()):
        await session.close()
    return {"success": True, "closed": True}


async def browser_get_images(args: dict, ctx: ToolContext) -> dict:
    async def action(s: _Session) -> dict:
        images = await s.page.evaluate(_IMAGES_JS)
        return {"images": images, "count": len(images), "url": s.page.url}

    return await _run(ctx, action)


async def browser_console(args: dict, ctx: ToolContext) -> dict:
    expression = args.get("expression")

    async def action(s: _Session) -> dict:
        result: dict = {}
        if expression:
            value = await s.page.evaluate(str(expression))
            encoded = json.dumps(value, default=str, ensure_ascii=False)
            if len(encoded) > ctx.settings.max_output_chars:
                result["result"] = truncate_output(encoded, ctx.settings.max_output_chars)
                result["result_truncated"] = True
            else:
                result["result"] = json.loads(encoded)
        result["console"] = list(s.console)
        if args.get("clear"):
            s.console.clear()
        return result

    return await _run(ctx, action)


async def browser_vision(args: dict, ctx: ToolContext) -> dict:
    question = str(args.get("question") or "").strip()
    if not question:
        return {"error": "question must not be empty"}
    annotate = bool(args.get("annotate", False))

    async def capture(s: _Session) -> dict:
        if annotate:
            await s.page.evaluate(_SNAPSHOT_JS, {"full": False, "lineLimit": TEXT_LINE_LIMIT})
            await s.page.evaluate(_ANNOTATE_JS)
        try:
            png = await s.page.screenshot(type="png")
        finally:
            if annotate:
                await s.page.evaluate("() => document.querySelectorAll('.__abr_label').forEach(e => e.remove())")
        return {"png": png, **await _where(s.page)}

    shot = await _run(ctx, capture)
    if "error" in shot:
        return shot
    data_url = "data:image/png;base64," + base64.b64encode(shot["png"]).decode()
    intro = f"This is a screenshot of the web page {shot['url']} (title: {shot['title']!r})."
    if annotate:
        intro += " Interactive elements are labelled with red @eN refs."
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"{intro}\n\n{question}"},
                {"type": "image_url", "image_url": {"url": data_url}},
            ],
        }
    ]
    try:
        reply = await ctx.model.complete(messages, model=ctx.settings.vision_model, max_tokens=None)
    except Exception as exc:
        return {"error": f"vision model failed: {exc}"}
    if not (reply.content or "").strip():
        return {"error": "the vision model returned an empty answer"}
    return {"analysis": reply.content, "url": shot["url"], "title": shot["title"]}


def _browser_missing(settings) -> str | None:
    exe = settings.browser_executable
    if not exe:
        return "no browser executable configured (browser_executable)"
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return f"Chromium not found at {exe} (apt-get install chromium, or set browser_executable)"
    return None


def _spec(name: str, description: str, handler, properties: dict | None = None, required=()) -> ToolSpec:
    parameters = {"type": "object", "properties": properties or {}, "required": list(required)}
    return ToolSpec(name, "browser", description, parameters, handler, packages=("playwright",), check=_browser_missing)


_REF = {"type": "string", "description": 'An element ref from the latest browser_snapshot, e.g. "@e5".'}

TOOLS = [
    _spec(
        "browser_navigate",
        "Open a URL in the browser. Follow with browser_snapshot to see the page and its element refs.",
        browser_navigate,
        {"url": {"type": "string", "description": "The http(s) address to open."}},
        ["url"],
    ),
    _spec(
        "browser_snapshot",
        "Return a text view of the current page: title, URL, headings and text, and every interactive "
        "element (links, buttons, fields) on its own line with a ref such as @e5 for the other tools.",
        browser_snapshot,
        {
            "full": {
                "type": "boolean",
                "default": False,
                "description": "false: condensed view focused on interactive elements; true: the whole page text.",
            }
        },
    ),
    _spec("browser_click", "Click the element with the given ref.", browser_click, {"ref": _REF}, ["ref"]),
    _spec(
        "browser_type",
        "Replace the content of the input field with the given ref by `text` (for a drop-down list: "
        "select the option with that label).",
        browser_type,
        {"ref": _REF, "text": {"type": "string", "description": "The text to enter."}},
        ["ref", "text"],
    ),
    _spec(
        "browser_scroll",
        "Scroll the page by most of a screen height.",
        browser_scroll,
        {"direction": {"type": "string", "enum": ["up", "down"], "description": "Which way to scroll."}},
        ["direction"],
    ),
    _spec("browser_back", "Go back to the previous page in the browser history.", browser_back),
    _spec(
        "browser_press",
        "Press a keyboard key (or combination) in the page, on the focused element.",
        browser_press,
        {"key": {"type": "string", "description": 'Key name such as "Enter", "Tab", "ArrowDown" or "Control+A".'}},
        ["key"],
    ),
    _spec("browser_close", "Close the browser session. A later browser call starts a fresh one.", browser_close),
    _spec(
        "browser_get_images",
        "List the images of the current page with their address, alt text and size.",
        browser_get_images,
    ),
    _spec(
        "browser_vision",
        "Take a screenshot of the visible part of the page and have a vision model answer a question about it. "
        "Useful for layouts, charts, images and CAPTCHAs that the text snapshot cannot show.",
        browser_vision,
        {
            "question": {"type": "string", "description": "What to find out from the screenshot."},
            "annotate": {
                "type": "boolean",
                "default": False,
                "description": "Label interactive elements with their @eN refs in the screenshot.",
            },
        },
        ["question"],
    ),
    _spec(
        "browser_console",
        "Read the page's console messages and errors captured so far, optionally after evaluating a "
        "JavaScript expression in the page (its JSON-serialisable value is returned).",
        browser_console,
        {
            "clear": {"type": "boolean", "default": False, "description": "Clear the captured messages after reading."},
            "expression": {"type": "string", "description": "JavaScript to evaluate in the page."},
        },
    ),
]
