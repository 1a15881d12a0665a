"""web_search (SearXNG, Tavily, Exa, Brave or Firecrawl) and web_extract (fetch + HTML to markdown)."""

from __future__ import annotations

import asyncio
import os
import re
from typing import TYPE_CHECKING, Any

from tools.registry import ToolContext, ToolSpec

if TYPE_CHECKING:
    import httpx  # imported where a request is made: heavy (its CLI pulls rich), and most runs never need it

# Endpoints of the hosted backends (module constants so tests can point them at a local server).
TAVILY_URL = "https://api.tavily.com/search"
EXA_URL = "https://api.exa.ai/search"
BRAVE_URL = "https://api.search.brave.com/res/v1/web/search"
FIRECRAWL_URL = "https://api.firecrawl.dev/v2/search"

SEARCH_BACKENDS = ("searxng", "tavily", "exa", "brave", "firecrawl")
# backend -> (settings field, environment variable) holding its URL or key
_CREDENTIALS = {
    "searxng": ("searxng_url", "SEARXNG_URL"),
    "tavily": ("tavily_api_key", "TAVILY_API_KEY"),
    "exa": ("exa_api_key", "EXA_API_KEY"),
    "brave": ("brave_api_key", "BRAVE_API_KEY"),
    "firecrawl": ("firecrawl_api_key", "FIRECRAWL_API_KEY"),
}
DEFAULT_LIMIT = 5
MAX_LIMIT = 20
DEFAULT_CHAR_LIMIT = 15_000
MAX_URLS = 10
HTTP_TIMEOUT = 30.0
USER_AGENT = "Mozilla/5.0 (X11; Linux x86_64) agent-batch-runner/0.1"


def _credential(settings, backend: str) -> str | None:
    field, env_var = _CREDENTIALS[backend]
    value = getattr(settings, field, None)
    if value is not None and hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    return value or os.environ.get(env_var) or None


def search_backend(settings) -> str | None:
    """The backend web_search uses: the configured one, else the first with a URL or key."""
    if settings.web_search_backend:
        name = settings.web_search_backend.lower()
        return name if name in _CREDENTIALS and _credential(settings, name) else None
    return next((name for name in SEARCH_BACKENDS if _credential(settings, name)), None)


def _search_unavailable(settings) -> str | None:
    if search_backend(settings):
        return None
    chosen = settings.web_search_backend
    if chosen and chosen.lower() not in _CREDENTIALS:
        return f"unknown web search backend {chosen!r} (choose one of {', '.join(SEARCH_BACKENDS)})"
    if chosen:
        return f"web search backend {chosen!r} selected but {_CREDENTIALS[chosen.lower()][1]} is not set"
    return (
        "no search backend configured: set SEARXNG_URL or TAVILY_API_KEY/EXA_API_KEY/"
        "BRAVE_API_KEY/FIRECRAWL_API_KEY"
    )


def _hit(title: Any, url: Any, snippet: Any) -> dict:
    return {"title": str(title or ""), "url": str(url or ""), "snippet": re.sub(r"\s+", " ", str(snippet or "")).strip()}


async def _search(client: httpx.AsyncClient, backend: str, cred: str, query: str, limit: int) -> list[dict]:
    if backend == "searxng":
        resp = await client.get(f"{cred.rstrip('/')}/search", params={"q": query, "format": "json"})
        resp.raise_for_status()
        return [_hit(r.get("title"), r.get("url"), r.get("content")) for r in resp.json().get("results", [])]
    if backend == "tavily":
        resp = await client.post(
            TAVILY_URL, headers={"Authorization": f"Bearer {cred}"}, json={"query": query, "max_results": limit}
        )
        resp.raise_for_status()
        return [_hit(r.get("title"), r.get("url"), r.get("content")) for r in resp.json().get("results", [])]
    if backend == "exa":
        body = {"query": query, "numResults": limit, "contents": {"text": {"maxCharacters": 400}}}
        resp = await client.post(EXA_URL, headers={"x-api-key": cred}, json=body)
        resp.raise_for_status()
        hits = []
        for r in resp.json().get("results", []):
            snippet = r.get("summary") or " ".join(r.get("highlights") or []) or r.get("text")
            hits.append(_hit(r.get("title"), r.get("url"), snippet))
        return hits
    if backend == "brave":
        resp = await client.get(
            BRAVE_URL,
            params={"q": query, "count": limit},
            headers={"X-Subscription-Token": cred, "Accept": "application/json"},
        )
        resp.raise_for_status()
        results = (resp.json().get("web") or {}).get("results", [])
        return [_hit(r.get("title"), r.get("url"), r.get("description")) for r in results]
    if backend == "firecrawl":
        resp = await client.post(
            FIRECRAWL_URL, headers={"Authorization": f"Bearer {cred}"}, json={"query": query, "limit": limit}
        )
        resp.raise_for_status()
        data = resp.json().get("data") or []
        results = data.get("web", []) if isinstance(data, dict) else data  # v2 groups by source, v1 is a list
        return [_hit(r.get("title"), r.get("url"), r.get("description") or r.get("markdown")) for r in results]
    raise ValueError(f"unknown search backend {backend!r}")


async def web_search(args: dict, ctx: ToolContext) -> dict:
    import httpx

    query = str(args.get("query") or "").strip()
    if not query:
        return {"error": "query must not be empty"}
    try:
        limit = max(1, min(MAX_LIMIT, int(args.get("limit") or DEFAULT_LIMIT)))
    except (TypeError, ValueError):
        return {"error": "limit must be an integer"}
    backend = search_backend(ctx.settings)
    if backend is None:
        return {"error": _search_unavailable(ctx.settings)}
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, headers={"User-Agent": USER_AGENT}) as client:
            hits = await _search(client, backend, _credential(ctx.settings, backend), query, limit)
    except httpx.HTTPStatusError as exc:
        return {"error": f"{backend} search failed: HTTP {exc.response.status_code}"}
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{backend} search failed: {type(exc).__name__}: {exc}"}
    return {"query": query, "backend": backend, "results": [h for h in hits if h["url"]][:limit]}


def _html_to_markdown(html: str) -> tuple[str, str]:
    import html2text

    match = re.search(r"<title[^>]*>(.*?)</title>", html, re.IGNORECASE | re.DOTALL)
    title = re.sub(r"\s+", " ", match.group(1)).strip() if match else ""
    converter = html2text.HTML2Text()
    converter.body_width = 0  # no hard wrapping
    converter.ignore_images = True
    converter.unicode_snob = True
    text = converter.handle(html)
    return title, re.sub(r"\n{3,}", "\n\n", text).strip()


async def _extract_one(client: httpx.AsyncClient, url: str, char_limit: int) -> dict:
    import httpx

    if not re.match(r"^https?://", url, re.IGNORECASE):
        return {"url": url, "error": "only http:// and https:// URLs can be extracted"}
    try:
        resp = await client.get(url)
    except httpx.HTTPError as exc:
        return {"url": url, "error": f"{type(exc).__name__}: {exc}"}
    if resp.status_code >= 400:
        return {"url": url, "error": f"HTTP {resp.status_code}"}
    ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
    if "html" in ctype or (not ctype and "<html" in resp.text[:2000].lower()):
        title, content = await asyncio.to_thread(_html_to_markdown, resp.text)
    elif ctype.startswith("text/") or ctype in ("application/json", "application/xml", "application/javascript"):
        title, content = "", resp.text
    else:
        return {"url": url, "error": f"unsupported content type {ctype or 'unknown'}"}
    page = {"url": str(resp.url), "title": title, "content": content[:char_limit]}
    if len(content) > char_limit:
        page["truncated"] = True
        page["total_chars"] = len(content)
    return page


async def web_extract(args: dict, ctx: ToolContext) -> dict:
    import httpx

    urls = args.get("urls")
    if isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
        return {"error": "urls must be a non-empty array of strings"}
    if len(urls) > MAX_URLS:
        return {"error": f"at most {MAX_URLS} URLs per call"}
    try:
        char_limit = max(100, int(args.get("char_limit") or DEFAULT_CHAR_LIMIT))
    except (TypeError, ValueError):
        return {"error": "char_limit must be an integer"}
    async with httpx.AsyncClient(
        timeout=HTTP_TIMEOUT, follow_redirects=True, headers={"User-Agent": USER_AGENT}
    ) as client:
        pages = await asyncio.gather(*(_extract_one(client, u.strip(), char_limit) for u in urls))
    return {"results": list(pages)}


TOOLS = [
    ToolSpec(
        name="web_search",
        toolset="web",
        description=(
            "Search the web. Returns a list of results, each with a title, URL and short snippet. "
            "Use web_extract afterwards to read the full text of promising pages."
        ),
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to search for."},
                "limit": {
                    "type": "integer",
                    "description": f"How many results to return (default {DEFAULT_LIMIT}, at most {MAX_LIMIT}).",
                },
            },
            "required": ["query"],
        },
        handler=web_search,
        check=_search_unavailable,  # the backend chosen, or the first configured
    ),
    ToolSpec(
        name="web_extract",
        toolset="web",
        description=(
            "Download web pages and return their readable content as markdown. Pages that fail "
            "report their own error while the others still return content."
        ),
        parameters={
            "type": "object",
            "properties": {
                "urls": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": f"The http(s) URLs to read (at most {MAX_URLS}).",
                },
                "char_limit": {
                    "type": "integer",
                    "description": f"Maximum characters kept per page (default {DEFAULT_CHAR_LIMIT}).",
                },
            },
            "required": ["urls"],
        },
        handler=web_extract,
        # web_extract needs no key or service: only outbound HTTP, which every worker has. It is
        # offered even when the network turns out to be closed: each URL's failure comes back inside
        # the result for the model to react to, and the set of offered tools stays the same from run
        # to run instead of depending on a reachability probe. Only a missing converter disables it.
        packages=("html2text",),
    ),
]
