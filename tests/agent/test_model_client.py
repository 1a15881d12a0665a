"""The retry layer against the real local server: Retry-After, reset headers, limits, classes."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent.model_client import (AdaptiveLimiter, CallStats, ModelClient, RetryPolicy, classify_status, parse_duration,
                                server_requested_delay)
from agent.types import ProviderError
from tests.conftest import read_jsonl, run_cli, write_jsonl


def test_parse_duration_and_requested_delay():
    assert parse_duration("1.5") == 1.5
    assert parse_duration("20ms") == pytest.approx(0.02)
    assert parse_duration("6m0s") == 360
    assert parse_duration("1h2m3s") == 3723
    assert parse_duration("soon") is None
    assert server_requested_delay({"retry-after": "3"}) == 3
    assert server_requested_delay({"retry-after-ms": "250"}) == 0.25
    assert server_requested_delay({"x-ratelimit-reset-requests": "2s", "x-ratelimit-reset-tokens": "500ms"}) == 2
    assert server_requested_delay({}) is None


def test_status_classes():
    assert classify_status(401) == ("auth", False)
    assert classify_status(402) == ("quota", False)
    assert classify_status(429, ("insufficient_quota", "insufficient_quota")) == ("quota", False)
    assert classify_status(429, ("rate_limit_exceeded",)) == ("provider", True)
    assert classify_status(429) == ("provider", True)
    assert classify_status(503) == ("provider", True)
    assert classify_status(400, ("invalid_request_error",)) == ("provider", False)


def test_unparseable_retry_after_is_ignored():
    assert server_requested_delay({"retry-after": "abc"}) is None
    assert server_requested_delay({"retry-after": "abc", "x-ratelimit-reset-requests": "2s"}) == 2


def test_adaptive_limiter_halves_on_429_and_recovers_slowly():
    async def scenario():
        limiter = AdaptiveLimiter(16)
        limiter.on_throttled()
        limiter.on_throttled()  # the same burst: cut once
        assert limiter.limit == 8
        for _ in range(8):
            limiter.on_success()
        assert 8 < limiter.limit < 10
        # the cap is enforced
        limiter.limit = 2
        entered = []

        async def hold(i):
            async with limiter:
                entered.append(i)
                await asyncio.sleep(0.05)

        task = asyncio.gather(*(hold(i) for i in range(4)))
        await asyncio.sleep(0.01)
        assert len(entered) == 2
        await task

    asyncio.run(scenario())


def _complete(server, prompt, policy=None, **kw):
    async def go():
        client = ModelClient(server.base_url, "k", policy=policy or RetryPolicy(base_delay=0.05), **kw)
        stats = CallStats()
        try:
            return await client.complete([{"role": "user", "content": prompt}], model="m", stats=stats), stats
        finally:
            await client.close()

    return asyncio.run(go())


def test_retry_after_and_reset_headers_are_honoured(model_server):
    started = time.monotonic()
    reply, stats = _complete(model_server, "@fail 429 1 retry_after=1\nhi")
    assert time.monotonic() - started >= 1.0 and stats.retries == 1 and reply.content.startswith("Final answer")
    started = time.monotonic()
    _, stats = _complete(model_server, "@fail 429 1 reset=0.8\nhi")
    assert time.monotonic() - started >= 0.8 and stats.retries == 1


def test_bounded_total_wait_gives_up(model_server):
    policy = RetryPolicy(base_delay=0.05, max_total_wait=0.5)
    with pytest.raises(ProviderError, match="budget") as info:
        _complete(model_server, "@fail 503 10 retry_after=2\nhi", policy=policy)
    assert info.value.error_class == "provider" and info.value.status == 503


def test_malformed_and_empty_responses_are_retried(model_server):
    reply, stats = _complete(model_server, "@malformed 1\n@empty_choices 1\nhi")
    assert stats.retries == 2 and reply.content


def test_hung_request_times_out_and_is_retried(model_server):
    policy = RetryPolicy(base_delay=0.05, request_timeout=0.5)
    reply, stats = _complete(model_server, "@hang 1\nhi", policy=policy)
    assert stats.retries == 1 and reply.content


def test_usage_is_summed(model_server):
    reply, stats = _complete(model_server, "hi")
    assert stats.total_tokens == reply.usage["total_tokens"] > 0 and stats.cost == pytest.approx(0.0001)


def test_a_reply_is_reported_once_with_its_usage_never_as_a_request_gone_without_a_charge(model_server):
    """Each report goes to the parent (and the spend journal): a reply's is one report, with its
    usage in, not also one in between where the request is neither pending nor priced."""
    reports = []
    stats = CallStats(listener=lambda s: reports.append(s.report()))
    client = ModelClient(model_server.base_url, "k")

    async def two_requests():
        try:
            for _ in range(2):
                await client.complete([{"role": "user", "content": "hi"}], model="m", stats=stats)
        finally:
            await client.close()

    asyncio.run(two_requests())
    assert len(reports) == 4  # each request: once sent, once answered
    for report in reports:
        answered = report["requests"] - report["pending"]
        assert report["total_tokens"] >= 7 * answered  # no answered request without its usage (7 tokens each)
    assert [(r["requests"], r["pending"]) for r in reports] == [(1, 1), (1, 0), (2, 1), (2, 0)]
    assert reports[-1]["cost"] == pytest.approx(0.0002) and reports[-1]["unpriced_requests"] == 0


def test_prompt_timeout_fails_row_as_timeout_and_resume_retries(tmp_path, model_server):
    rows = [{"prompt": "@hang 1\nStuck once."}, {"prompt": "Quick."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    args = [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=2", "--distribution=terminal_only",
            f"--base_url={model_server.base_url}", "--model=m", "--api_key=x", "--prompt_timeout=2"]
    started = time.monotonic()
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 60
    out = tmp_path / "data" / "r"
    (failed,) = [r for p in out.glob("batch_*.jsonl") for r in read_jsonl(p) if r.get("failed")]
    assert failed["error_class"] == "timeout" and failed["prompt_index"] == 0
    proc = run_cli(args + ["--resume"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(read_jsonl(out / "trajectories.jsonl")) == 2


def test_requests_per_minute_paces_requests(tmp_path, model_server):
    rows = [{"prompt": f"Paced {i}."} for i in range(4)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=4", "--distribution=terminal_only",
                    f"--base_url={model_server.base_url}", "--model=m", "--api_key=x", "--num_workers=4",
                    "--num_processes=1", "--max_requests_per_minute=120"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    times = sorted(r.time for r in model_server.requests)
    # 120/min = one start every 0.5 s (the first may reach the server late: connection set-up)
    assert len(times) == 4 and times[-1] - times[1] >= 0.9 and times[-1] - times[0] >= 1.0


def test_closed_connection_is_named_and_classed_as_connection(model_server):
    policy = RetryPolicy(base_delay=0.05, max_unreachable_wait=0.3)
    with pytest.raises(ProviderError, match="connection closed by the server") as info:
        _complete(model_server, "@close 50\nhi", policy=policy)
    assert info.value.error_class == "connection"


def test_refused_connection_is_named_not_a_timeout():
    class Nowhere:
        base_url = "http://127.0.0.1:9/v1"  # discard port: nothing listens

    policy = RetryPolicy(base_delay=0.05, max_unreachable_wait=0.3)
    with pytest.raises(ProviderError, match="connection refused") as info:
        _complete(Nowhere, "hi", policy=policy)
    assert info.value.error_class == "connection" and "timed out" not in str(info.value)


def test_prompt_caching_auto_means_claude_on_openrouter_and_at_most_four_breakpoints():
    from agent.model_client import wants_prompt_caching, with_cache_breakpoints

    openrouter = "https://openrouter.ai/api/v1"
    assert wants_prompt_caching("auto", "anthropic/claude-sonnet-4.6", openrouter)
    assert not wants_prompt_caching("auto", "openai/gpt-5", openrouter)
    assert not wants_prompt_caching("auto", "anthropic/claude-sonnet-4.6", "http://localhost:4000/v1")
    assert wants_prompt_caching("on", "qwen3", "http://localhost:4000/v1")
    assert not wants_prompt_caching("off", "anthropic/claude-sonnet-4.6", openrouter)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                {"role": "tool", "tool_call_id": "1", "content": "T1"},
                {"role": "assistant", "content": "A"}, {"role": "tool", "tool_call_id": "2", "content": "T2"},
                {"role": "user", "content": [{"type": "text", "text": "U2"}, {"type": "image_url", "image_url": {}}]}]
    marked = with_cache_breakpoints(messages)
    flagged = [i for i, m in enumerate(marked) if isinstance(m["content"], list)
               and m["content"][-1].get("cache_control") == {"type": "ephemeral"}]
    assert flagged == [0, 4, 5, 6]
    assert marked[6]["content"][0] == {"type": "text", "text": "U2"}  # only the last part is marked
    assert messages[0] == {"role": "system", "content": "S"}  # the caller's messages are not changed


def test_a_reported_cost_that_is_no_amount_is_unknown_not_a_number_to_sum():
    from agent.model_client import charge, reported_cost

    assert [charge(v) for v in (0.25, "0.5", 0, "1e-05")] == [0.25, 0.5, 0.0, 1e-05]
    for bad in (None, "", "abc", "nan", "inf", "-inf", "-5", -0.1, float("nan"), True, {"usd": 1}, [1]):
        assert charge(bad) is None, bad
    # A body cost that is no amount does not hide a good header, and never raises.
    assert reported_cost({"cost": "abc"}, {"x-litellm-response-cost": "0.002"}) == 0.002
    assert reported_cost({"cost": None}, {"x-litellm-response-cost": "nan"}) is None


def test_the_key_follows_a_redirect_only_within_its_origin():
    from agent.model_client import _same_origin

    assert _same_origin("http://h:8000/v1/models", "http://h:8000/v1/models/")
    assert _same_origin("http://h/v1", "https://h/v1")  # an upgrade on the same host
    assert _same_origin("https://H/v1", "https://h:443/x")
    assert not _same_origin("https://h/v1", "http://h/v1")  # never from https to http
    assert not _same_origin("http://127.0.0.1:8000/v1", "http://127.0.0.2:8000/v1")
    assert not _same_origin("http://h:8000/v1", "http://h:8001/v1")
    assert not _same_origin("http://h:8000/v1", "https://h:8443/v1")


def test_an_outage_shorter_than_the_unreachable_budget_is_ridden_out_whatever_the_backoff_draws(model_server,
                                                                                                 monkeypatch):
    """The budget bounds the waiting, not the luck of the draw: when the next backoff would pass it,
    the request waits what is left of it and tries once more instead of giving up early."""
    import random
    import threading

    monkeypatch.setattr(random, "uniform", lambda low, high: high)  # the longest backoff every time
    # Backoffs 0.1, 0.2, 0.4, 0.8, 1.6 (3.1 s waited); the next, 3.2, would pass the 6 s budget: it
    # is cut to 2.9 s. The server is back at 4.5 s, well after a give-up at 3.1 s, well before 6 s.
    policy = RetryPolicy(base_delay=0.1, max_unreachable_wait=6.0)
    _complete(model_server, "warm up")  # imports done, so the outage starts with the first request
    model_server.stop()
    threading.Timer(4.5, model_server.start).start()  # back on the same port within the budget
    reply, stats = _complete(model_server, "hi", policy=policy)
    assert reply.content and stats.retries >= 5


def test_a_dead_endpoint_still_fails_once_the_unreachable_budget_is_spent():
    class Nowhere:
        base_url = "http://127.0.0.1:9/v1"

    started = time.monotonic()
    with pytest.raises(ProviderError, match="connection refused.*budget"):
        _complete(Nowhere, "hi", policy=RetryPolicy(base_delay=0.05, max_unreachable_wait=0.6))
    assert 0.6 <= time.monotonic() - started < 5
