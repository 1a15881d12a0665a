"""web_search and web_extract against the local fixture site (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.web_fixtures import FixtureSite, make_ctx
from tools import web_tools
from tools.registry import unavailable_reason
from tools.settings import ToolSettings

SEARCH_ENV = ("SEARXNG_URL", "TAVILY_API_KEY", "EXA_API_KEY", "BRAVE_API_KEY", "FIRECRAWL_API_KEY")


@pytest.fixture(scope="module")
def site():
    with FixtureSite() as site:
        yield site


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SEARCH_ENV:
        monkeypatch.delenv(name, raising=False)


def search(settings, **args):
    return asyncio.run(web_tools.web_search(args, make_ctx(settings)))


def extract(**args):
    return asyncio.run(web_tools.web_extract(args, make_ctx(ToolSettings())))


def test_searxng_results_are_normalised_and_limited(site):
    result = search(ToolSettings(searxng_url=site.url("")), query="fox tales", limit=3)
    assert result["backend"] == "searxng"
    assert len(result["results"]) == 3
    first = result["results"][0]
    assert first == {"title": "Result 1 for fox tales", "url": site.url("/second?hit=1"), "snippet": "Snippet number 1"}
    request = site.requests_to("/search")[-1]
    assert "format=json" in request.path and "q=fox+tales" in request.path


def test_searxng_url_from_environment(site, monkeypatch):
    monkeypatch.setenv("SEARXNG_URL", site.url("/"))
    settings = ToolSettings()
    assert web_tools._search_unavailable(settings) is None
    assert len(search(settings, query="x")["results"]) == web_tools.DEFAULT_LIMIT


@pytest.mark.parametrize(
    "backend, constant, header, expected_header, title",
    [
        ("tavily", "TAVILY_URL", "authorization", "Bearer k-123", "Tavily hit"),
        ("exa", "EXA_URL", "x-api-key", "k-123", "Exa hit"),
        ("brave", "BRAVE_URL", "x-subscription-token", "k-123", "Brave hit"),
        ("firecrawl", "FIRECRAWL_URL", "authorization", "Bearer k-123", "Firecrawl hit"),
    ],
)
def test_hosted_backends(site, monkeypatch, backend, constant, header, expected_header, title):
    monkeypatch.setattr(web_tools, constant, site.url(f"/api/{backend}"))
    settings = ToolSettings(**{f"{backend}_api_key": "k-123"})
    result = search(settings, query="who", limit=2)
    assert result["backend"] == backend
    assert result["results"][0]["title"] == title
    assert result["results"][0]["snippet"]
    request = site.requests_to(f"/api/{backend}")[-1]
    assert request.headers[header] == expected_header
    if request.method == "POST":
        assert request.body["query"] == "who"
    else:
        assert "q=who" in request.path and "count=2" in request.path


def test_backend_choice_and_unavailable_reasons(site):
    assert "no search backend configured" in web_tools._search_unavailable(ToolSettings())
    both = ToolSettings(searxng_url=site.url(""), brave_api_key="b")
    assert web_tools.search_backend(both) == "searxng"  # first configured
    assert web_tools.search_backend(both.model_copy(update={"web_search_backend": "brave"})) == "brave"
    missing = ToolSettings(searxng_url=site.url(""), web_search_backend="tavily")
    assert "TAVILY_API_KEY" in web_tools._search_unavailable(missing)
    assert "unknown" in web_tools._search_unavailable(ToolSettings(web_search_backend="bing"))
    assert "error" in search(ToolSettings(), query="x")


def test_search_http_failure_is_an_error(site):
    result = search(ToolSettings(searxng_url=site.url("/nowhere")), query="x")
    assert "HTTP 404" in result["error"]
    assert "error" in search(ToolSettings(searxng_url=site.url("")), query="  ")


def test_extract_article_as_markdown(site):
    result = extract(urls=[site.url("/article")])
    page = result["results"][0]
    assert page["title"] == "Long Article"
    assert page["content"].startswith("# Long Article")
    assert "## Introduction" in page["content"]
    assert "Paragraph 1: the quick brown fox" in page["content"]
    assert "<p>" not in page["content"]
    assert page["content"].endswith("THE END") and "truncated" not in page


def test_extract_char_limit_and_per_url_errors(site):
    urls = [site.url("/second"), site.url("/missing"), site.url("/binary"), "ftp://example.com/x", site.url("/redirect")]
    results = extract(urls=urls, char_limit=500)["results"]
    assert [r.get("error") is None for r in results] == [True, False, False, False, True]
    assert "You followed the link." in results[0]["content"]
    assert "truncated" not in results[0]
    assert results[1]["error"] == "HTTP 404"
    assert "unsupported content type" in results[2]["error"]
    assert "http" in results[3]["error"]
    assert results[4]["url"] == site.url("/second")  # redirect followed

    short = extract(urls=[site.url("/article")], char_limit=300)["results"][0]
    assert len(short["content"]) == 300 and short["total_chars"] > 300


def test_extract_argument_checks_and_availability():
    assert "error" in extract(urls=[])
    assert "error" in extract(urls=[1, 2])
    assert unavailable_reason(web_tools.TOOLS[1], ToolSettings()) is None
    assert [t.name for t in web_tools.TOOLS] == ["web_search", "web_extract"]
    assert web_tools.TOOLS[1].parameters["required"] == ["urls"]
