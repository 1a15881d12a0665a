"""A local web site for the web, browser and image tool tests (real sockets on 127.0.0.1).

Pages: `/` (a form, a button that changes text via JS, a link, two images, console output),
`/submitted?q=...` (shows what the form sent), `/second`, `/article` (long), `/redirect`,
`/binary`, and JSON stand-ins for the services the tools call: SearXNG (`/search?format=json`),
Tavily, Exa, Brave and Firecrawl (`/api/<name>`), FAL (`/fal/<model>`) and an OpenAI-style images
endpoint that answers with `b64_json` (`/b64/images/generations`). Every request is recorded.
"""

from __future__ import annotations

import base64
import html
import http.server
import inspect
import json
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit


def make_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes(rgb) * width
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


RED_PNG = make_png(40, 30, (220, 30, 30))
BLUE_PNG = make_png(16, 24, (30, 30, 220))
ARTICLE_PARAGRAPHS = 80

HOME = """<!doctype html>
<html><head><title>Fixture Home</title></head>
<body>
<h1>Fixture home</h1>
<p>Welcome to the local test site.</p>
<form action="/submitted" method="get">
  <label for="q">Your name</label> <input id="q" name="q" type="text">
  <button type="submit">Submit</button>
</form>
<p id="status">Not clicked yet</p>
<button id="change" type="button"
  onclick="document.getElementById('status').textContent = 'Clicked!'; console.log('button clicked')">Change text</button>
<p><a href="/second">Second page</a></p>
<img src="/img/red.png" alt="Red rectangle">
<img src="/img/blue.png" alt="Blue rectangle">
<script>console.log('fixture loaded');</script>
</body></html>
"""

SECOND = """<!doctype html>
<html><head><title>Second Page</title></head>
<body><h1>Second page</h1><p>You followed the link.</p><a href="/">Home</a></body></html>
"""


def article() -> str:
    paragraphs = "\n".join(
        f"<p>Paragraph {i}: the quick brown fox jumps over the lazy dog, again and again, "
        f"so that this article is long enough to need scrolling and truncation. End of paragraph {i}.</p>"
        for i in range(1, ARTICLE_PARAGRAPHS + 1)
    )
    return (
        "<!doctype html><html><head><title>Long Article</title>"
        "<style>p { margin: 24px 0; }</style></head><body>"
        f"<h1>Long Article</h1><h2>Introduction</h2>{paragraphs}<p>THE END</p></body></html>"
    )


def submitted(query: str) -> str:
    return (
        "<!doctype html><html><head><title>Submitted</title></head>"
        f"<body><h1>Form received</h1><p id=\"echo\">You typed: {html.escape(query)}</p></body></html>"
    )


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # keys lower-cased
    body: dict | None


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        self._handle(None)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"_raw": raw.decode(errors="replace")}
        self._handle(body)

    def _handle(self, body: dict | None) -> None:
        site: FixtureSite = self.server.site
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        site._record(Recorded(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        route = parts.path
        base = site.url("")
        if route == "/":
            self._send(200, HOME)
        elif route == "/second":
            self._send(200, SECOND)
        elif route == "/article":
            self._send(200, article())
        elif route == "/submitted":
            self._send(200, submitted(query.get("q", "")))
        elif route == "/redirect":
            self._send(302, "", headers={"Location": "/second"})
        elif route == "/binary":
            self._send(200, b"\x00\x01\x02\x03", "application/octet-stream")
        elif route == "/img/red.png":
            self._send(200, RED_PNG, "image/png")
        elif route == "/img/blue.png":
            self._send(200, BLUE_PNG, "image/png")
        elif route == "/search" and query.get("format") == "json":
            hits = [
                {"title": f"Result {i} for {query.get('q', '')}", "url": f"{base}/second?hit={i}",
                 "content": f"Snippet  number {i}"}
                for i in range(1, 9)
            ]
            self._send(200, {"query": query.get("q", ""), "results": hits})
        elif route == "/api/tavily":
            self._send(200, {"results": [{"title": "Tavily hit", "url": "https://t.example/1", "content": "tv text"}]})
        elif route == "/api/exa":
            self._send(200, {"results": [{"title": "Exa hit", "url": "https://e.example/1", "text": "exa text"}]})
        elif route == "/api/brave":
            self._send(200, {"web": {"results": [{"title": "Brave hit", "url": "https://b.example/1",
                                                  "description": "brave text"}]}})
        elif route == "/api/firecrawl":
            self._send(200, {"success": True, "data": {"web": [{"title": "Firecrawl hit", "url": "https://f.example/1",
                                                                "description": "fc text"}]}})
        elif route.startswith("/fal/"):
            self._send(200, {"images": [{"url": f"{base}/img/red.png", "width": 40, "height": 30}], "seed": 1})
        elif route == "/b64/images/generations":
            self._send(200, {"created": 0, "data": [{"b64_json": base64.b64encode(BLUE_PNG).decode()}]})
        else:
            self._send(404, "<html><body>not found</body></html>")

    def _send(self, status: int, body, content_type: str | None = None, headers: dict | None = None) -> None:
        if isinstance(body, dict):
            data, content_type = json.dumps(body).encode(), content_type or "application/json"
        elif isinstance(body, str):
            data, content_type = body.encode(), content_type or "text/html; charset=utf-8"
        else:
            data = body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    site: "FixtureSite"


class FixtureSite:
    """`with FixtureSite() as site: site.url("/second")`"""

    def __init__(self):
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._requests: list[Recorded] = []

    def start(self) -> "FixtureSite":
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.site = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "FixtureSite":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}{path}"

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    def requests_to(self, prefix: str) -> list[Recorded]:
        return [r for r in self.requests if r.path.startswith(prefix)]

    def _record(self, entry: Recorded) -> None:
        with self._lock:
            self._requests.append(entry)


class DirEnv:
    """A minimal session environment rooted in a host directory (read_file/write_file only)."""

    def __init__(self, root: str):
        self.workdir = str(root)

    def _path(self, path: str) -> str:
        return os.path.join(self.workdir, path)

    def read_file(self, path: str) -> bytes:
        with open(self._path(path), "rb") as fh:
            return fh.read()

    def write_file(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(self._path(path)) or ".", exist_ok=True)
        with open(self._path(path), "wb") as fh:
            fh.write(data)


def make_ctx(settings, model=None, env=None, task_id: str = "test-task"):
    from tools.registry import ToolContext

    return ToolContext(env=env, settings=settings, model=model, task_id=task_id)


async def run_cleanups(ctx) -> None:
    for cleanup in reversed(ctx.cleanups):
        result = cleanup()
        if inspect.isawaitable(result):
            await result
