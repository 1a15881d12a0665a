"""The plain-HTTP path of the model client (agent/plain_http.py): every request to an http://
endpoint that no proxy stands before, the first one too. Each test warms a client up with one
request, then sends what it tests through the plain path."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import zlib

import pytest

from agent.model_client import CallStats, ModelClient, RetryPolicy
from agent.types import ProviderError
from tests.conftest import wait_for


def _after_warm_up(base_url, prompts, policy=None, check=None):
    """Replies (or the ProviderError) to `prompts`, sent one after another by a warmed-up client."""

    async def go():
        client = ModelClient(base_url, "sk-plain-test", policy=policy or RetryPolicy(base_delay=0.05))
        results = []
        try:
            await client.complete([{"role": "user", "content": "warm up"}], model="m")
            assert client._direct._plain is not None, "the plain path is not in use"
            for prompt in prompts:
                stats = CallStats()
                try:
                    reply = await client.complete([{"role": "user", "content": prompt}], model="m", stats=stats)
                    results.append((reply, stats))
                except ProviderError as err:
                    results.append((err, stats))
            if check:
                check(client)
        finally:
            await client.close()
        return results

    return asyncio.run(go())


def test_the_plain_path_sends_the_same_headers_each_time_and_keeps_its_connection(model_server):
    (reply, stats), = _after_warm_up(model_server.base_url, ["hi"] * 1)
    more = _after_warm_up(model_server.base_url, ["again"] * 10)
    assert reply.content and stats.requests == 1 and all(r.content for r, _ in more)
    first, second = model_server.requests[0], model_server.requests[1]
    assert first.body["messages"][0]["content"] == "warm up" and second.body["messages"][0]["content"] == "hi"
    assert second.headers["authorization"] == first.headers["authorization"] == "Bearer sk-plain-test"
    same = {k for k in first.headers if k not in ("content-length", "accept-encoding", "connection")}
    assert {k: second.headers.get(k) for k in same} == {k: first.headers[k] for k in same}
    # Two clients, 13 requests: one connection of the plain path's for each client.
    assert model_server.connections_accepted <= 2
    assert first.headers["content-type"] == "application/json" and first.headers["accept-encoding"] == "identity"


def test_error_statuses_keep_their_headers_and_classes(model_server):
    results = _after_warm_up(model_server.base_url, ["@fail 429 1 retry_after=1\nhi", "@fail 401 1\nhi",
                                                     "@fail 503 1 reset=0.5\nhi"])
    (ok, stats429), (denied, _), (ok2, stats503) = results
    assert ok.content and stats429.retries == 1
    assert isinstance(denied, ProviderError) and denied.error_class == "auth" and denied.status == 401
    assert ok2.content and stats503.retries == 1
    times = [r.time for r in model_server.requests]
    assert times[2] - times[1] >= 1.0  # Retry-After: 1 was read from the plain path's response


def test_hostile_replies_on_the_plain_path(model_server):
    policy = RetryPolicy(base_delay=0.05, request_timeout=1.0, max_unreachable_wait=0.3)
    prompts = ["@close 50\nhi", "@hang 1\nhi", "@drip 0.05 1\nhi", "@endless 1\nhi", "@html 50\nhi",
               "@gzip_bomb 40 1\nhi", "@huge 20 1\nhi", "@malformed 1\nhi", "after all that"]
    closed, hung, dripped, endless, html, bomb, huge, malformed, last = _after_warm_up(
        model_server.base_url, prompts, policy=policy)
    assert isinstance(closed[0], ProviderError) and "connection closed by the server" in str(closed[0])
    assert closed[0].error_class == "connection"
    for reply, stats in (hung, dripped, endless, malformed):
        assert reply.content and stats.retries == 1  # timed out (or unreadable) once, then answered
    assert isinstance(html[0], ProviderError) and "answers HTML" in str(html[0])
    for err, stats in (bomb, huge):
        assert isinstance(err, ProviderError) and "larger than the 16 MiB limit" in str(err) and stats.retries == 0
    assert last[0].content  # no abandoned connection was used again


class _RawServer:
    """A TCP server answering each request with the next of `responses` (bytes, or None to close
    the connection without answering); it closes the connection after an HTTP/1.0 or a
    `Connection: close` answer, and after each answer with `close_after`."""

    def __init__(self, responses, close_after=False):
        self.responses = list(responses)
        self.close_after = close_after
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        try:
            self._answer(conn)
        except OSError:  # the client reset the connection (it gave up on it)
            pass
        finally:
            conn.close()

    def _answer(self, conn):
        data = b""
        while self.responses:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, data = data.partition(b"\r\n\r\n")
            length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0]
                         .split(b":")[1])
            while len(data) < length:
                data += conn.recv(65536)
            data = data[length:]
            response = self.responses.pop(0)
            if response is None:
                return
            for i in range(0, len(response), 7):  # in small pieces: framing across reads
                conn.sendall(response[i:i + 7])
            if self.close_after or response.startswith(b"HTTP/1.0") or b"Connection: close" in response:
                return

    def close(self):
        self.sock.close()


def _completion(text: str) -> bytes:
    return (b'{"id": "c", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": '
            b'{"role": "assistant", "content": "%s"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, '
            b'"completion_tokens": 1, "total_tokens": 2}}' % text.encode())


def _with_length(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        extra, len(body), body)


def _chunked(body: bytes) -> bytes:
    pieces = [body[:10], body[10:11], body[11:]]
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n%s0\r\nX-T: 1\r\n\r\n" % chunks


def test_framings_a_real_server_may_use():
    gz = gzip.compress(_completion("gzipped"))
    server = _RawServer([
        _with_length(_completion("warm")),
        _chunked(_completion("chunked")),
        b"HTTP/1.1 100 Continue\r\n\r\n" + _with_length(_completion("after 100")),
        _with_length(gz, b"Content-Encoding: gzip\r\n"),
        _with_length(_completion("closing"), b"Connection: close\r\n"),
        _with_length(_completion("new connection")),
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + _completion("until close"),
        _with_length(_completion("last")),
    ])
    try:
        replies = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1", "2", "3", "4", "5", "6", "7"])
        assert [r.content for r, _ in replies] == ["chunked", "after 100", "gzipped", "closing", "new connection",
                                                   "until close", "last"]
        # The plain path's first, closed by "Connection: close"; its second, closed by the
        # HTTP/1.0 answer; its third for the last request.
        assert server.connections == 3
    finally:
        server.close()


def test_a_server_closing_every_connection_after_answering_has_every_request_answered():
    server = _RawServer([_with_length(_completion(str(i))) for i in range(6)], close_after=True)
    try:
        replies = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1", "2", "3", "4", "5"])
        assert [r.content for r, _ in replies] == ["1", "2", "3", "4", "5"]
        # A request sent on a connection whose close has not reached the client yet fails and is
        # asked again (as through the SDK's transport): it may cost a retry, never an answer.
        assert all(stats.retries <= 1 and stats.requests == stats.retries + 1 for _, stats in replies)
    finally:
        server.close()


def test_bytes_that_are_not_http_are_a_connection_error_and_retried():
    server = _RawServer([_with_length(_completion("warm")), b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
                         _with_length(_completion("framed"), b"Content-Length: 3\r\n"),
                         _with_length(_completion("ok"))])
    try:
        (reply, stats), = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1"])
        assert reply.content == "ok" and stats.retries == 2
    finally:
        server.close()


def test_a_redirect_hands_the_request_to_the_sdk_transport(model_server):
    redirect = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s/chat/completions\r\nContent-Length: 0\r\n\r\n" % (
            model_server.base_url.encode())
    # The plain path gets the redirect and hands the request to the SDK's transport, which asks
    # the same URL again, gets the redirect again and follows it.
    server = _RawServer([_with_length(_completion("warm")), redirect, redirect])

    def check(client):
        assert client._direct._plain is None  # given up for good after a redirect

    try:
        (reply, _), = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1"], check=check)
        assert reply.content and len(model_server.requests) == 1
        # A redirect to another origin (another port) does not carry the key.
        assert "authorization" not in model_server.requests[0].headers
    finally:
        server.close()


@pytest.mark.parametrize("proxy_var", ["http_proxy", "ALL_PROXY"])
def test_a_proxy_in_the_environment_keeps_the_sdk_transport(model_server, monkeypatch, proxy_var):
    monkeypatch.setenv(proxy_var, "http://127.0.0.1:9")
    monkeypatch.setenv("no_proxy", "")

    async def go():
        client = ModelClient(model_server.base_url, "k", policy=RetryPolicy(base_delay=0.05, max_unreachable_wait=0.1))
        try:
            await client.complete([{"role": "user", "content": "hi"}], model="m")
        except ProviderError:
            pass
        plain = client._direct._plain
        await client.close()
        return plain

    assert asyncio.run(go()) is None


def _status(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d Error\r\n%sContent-Length: %d\r\n\r\n%s" % (status, extra, len(body), body)


def test_a_compressed_error_body_is_read_as_the_sdk_reads_it():
    # The server compresses whatever the client asked for: the body of an error status is then
    # gzip too, and its message, class and Retry-After are read from it as from a plain one.
    gz = b"Content-Encoding: gzip\r\nContent-Type: application/json\r\n"
    server = _RawServer([
        _with_length(_completion("warm")),
        _status(429, gzip.compress(b'{"error": {"message": "slow down"}}'), gz + b"Retry-After: 0\r\n"),
        _with_length(_completion("after 429")),
        _status(401, gzip.compress(b'{"error": {"message": "bad key"}}'), gz),
    ])
    try:
        (ok, stats), (denied, _) = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1", "2"])
        assert ok.content == "after 429" and stats.retries == 1
        assert isinstance(denied, ProviderError) and denied.error_class == "auth" and "bad key" in str(denied)
    finally:
        server.close()


def test_any_number_of_interim_responses_before_the_answer():
    server = _RawServer([_with_length(_completion("warm")),
                         b"HTTP/1.1 100 Continue\r\n\r\n" * 3000 + _with_length(_completion("answer"))])
    try:
        (reply, stats), = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1"])
        assert reply.content == "answer" and stats.retries == 0
    finally:
        server.close()


def test_endless_trailers_after_the_last_chunk_are_refused_not_held():
    # After the last chunk, a server sends trailer lines that never end (and then waits): the
    # client stops at the same 64 KiB a header block may have, instead of holding all of it in
    # memory until the request times out.
    endless = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"X-Pad: " + b"a" * (4 * 2**20)

    class Waiting(_RawServer):
        def _handle(self, conn):
            if self.connections > 1:  # the plain path's own connection
                try:
                    conn.recv(65536)
                    conn.sendall(endless)
                except OSError:  # the client stopped reading and closed
                    return
                threading.Event().wait(30)
            else:
                super()._handle(conn)

    server = Waiting([_with_length(_completion("warm"))])
    try:
        policy = RetryPolicy(max_attempts=1, request_timeout=20)
        (err, _), = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1"], policy=policy)
        assert isinstance(err, ProviderError) and "trailers are longer than 64 KiB" in str(err), err
    finally:
        server.close()


def test_a_server_ending_its_lines_with_a_bare_lf_is_read_as_the_sdk_reads_it():
    # Some hand-written servers end lines with "\n" alone; the SDK's transport reads them, so the
    # plain path must too (else every request after the first waits for a blank line until it times out).
    def lf_only(raw: bytes) -> bytes:
        head, _, body = raw.partition(b"\r\n\r\n")
        return head.replace(b"\r\n", b"\n") + b"\n\n" + body.replace(b"\r\n", b"\n")

    server = _RawServer([lf_only(_with_length(_completion("warm"))), lf_only(_with_length(_completion("length"))),
                         lf_only(_chunked(_completion("chunked"))), _with_length(_completion("crlf again"))])
    try:
        policy = RetryPolicy(max_attempts=1, request_timeout=5)
        replies = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1", "2", "3"], policy=policy)
        assert [getattr(r, "content", r) for r, _ in replies] == ["length", "chunked", "crlf again"]
        assert server.connections == 1  # every framing was kept
    finally:
        server.close()


@pytest.mark.parametrize("line_end", [b"\r\n", b"\n"])
def test_every_framing_read_one_byte_at_a_time(line_end):
    from agent.plain_http import _Connection

    class Transport:  # what the connection writes and whether it closed
        closed = False

        def write(self, data):
            pass

        def is_closing(self):
            return self.closed

        def close(self):
            self.closed = True

    body = _completion("split")
    gz = gzip.compress(body, mtime=0)
    n = line_end

    def chunked(data, head=b""):
        chunks = b"".join(b"%x%s%s%s" % (len(p), n, p, n) for p in (data[:10], data[10:11], data[11:]))
        return b"HTTP/1.1 200 OK%s%sTransfer-Encoding: chunked%s%s%s0%s%s" % (n, head, n, n, chunks, n, n)

    def with_length(data, head=b""):
        return b"HTTP/1.1 200 OK%s%sContent-Length: %d%s%s%s" % (n, head, len(data), n, n, data)

    responses = [with_length(body), chunked(body), b"HTTP/1.1 100 Continue%s%s" % (n, n) + with_length(body),
                 with_length(gz, b"Content-Encoding: gzip" + n), chunked(gz, b"Content-Encoding: gzip" + n)]
    raw_deflate = zlib.compressobj(wbits=-15)
    for deflated in (zlib.compress(body), raw_deflate.compress(body) + raw_deflate.flush()):
        responses.append(chunked(deflated, b"Content-Encoding: deflate" + n))

    async def go():
        connection = _Connection(limit=2**20)
        connection.connection_made(Transport())
        for raw in responses:
            waiter = connection.request(b"POST / HTTP/1.1\r\n\r\n")
            for i in range(len(raw)):
                assert not waiter.done()
                connection.data_received(raw[i:i + 1])
            assert (await waiter).content == body and connection.usable

    asyncio.run(go())


def test_deflate_bodies_zlib_wrapped_or_raw():
    def deflated(text: str, wbits: int) -> bytes:
        compressor = zlib.compressobj(wbits=wbits)
        return _with_length(compressor.compress(_completion(text)) + compressor.flush(), b"Content-Encoding: deflate\r\n")

    server = _RawServer([deflated("warm", -15), deflated("raw", -15), deflated("zlib", 15)])
    try:
        policy = RetryPolicy(max_attempts=1, request_timeout=5)
        replies = _after_warm_up(f"http://127.0.0.1:{server.port}/v1", ["1", "2"], policy=policy)
        assert [getattr(r, "content", r) for r, _ in replies] == ["raw", "zlib"]
    finally:
        server.close()


def test_no_connection_is_left_open_when_first_requests_answer_one_after_another(model_server):
    # Sessions whose first requests answer one after another, each then sending another: every
    # connection the plain path opened is closed with the client.
    async def go():
        client = ModelClient(model_server.base_url, "k", policy=RetryPolicy(base_delay=0.05))

        async def session(latency):
            await client.complete([{"role": "user", "content": f"@latency {latency}\nslow {latency}"}], model="m")
            await client.complete([{"role": "user", "content": f"again {latency}"}], model="m")

        try:
            await asyncio.gather(*(session(latency) for latency in (0.0, 0.3, 0.6)))
        finally:
            await client.close()
        await asyncio.sleep(0.2)

    asyncio.run(go())
    assert wait_for(lambda: not model_server._connections, 3), f"{len(model_server._connections)} left open"


def test_a_request_in_flight_when_the_client_closes_leaves_no_connection_open(model_server):
    async def go():
        client = ModelClient(model_server.base_url, "k", policy=RetryPolicy(base_delay=0.05))
        await client.complete([{"role": "user", "content": "warm up"}], model="m")
        late = asyncio.ensure_future(client.complete([{"role": "user", "content": "@latency 0.4\nlate"}], model="m"))
        await asyncio.sleep(0.1)
        await client.close()
        assert (await late).content  # it still gets its answer
        await asyncio.sleep(0.2)

    asyncio.run(go())
    assert wait_for(lambda: not model_server._connections, 3), f"{len(model_server._connections)} left open"


def test_the_plain_path_serves_only_what_it_can_send_as_it_is(monkeypatch):
    from agent.model_client import plain_post_for

    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    plain = plain_post_for("http://127.0.0.1:8080/v1/?api-version=2", "sk-1")
    assert plain is not None
    head = plain._head.decode()
    assert head.startswith("POST /v1/chat/completions?api-version=2 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n")
    assert "Authorization: Bearer sk-1\r\n" in head
    # A key that would end the header line (and start another), or that a header cannot carry:
    # the SDK's transport gets the endpoint, and refuses such a key itself.
    for key in ("sk-1\r\nX-Injected: 1", "sk-1\nX", "clé"):
        assert plain_post_for("http://127.0.0.1:8080/v1", key) is None, key
    assert plain_post_for("https://api.example.com/v1", "sk-1") is None
    assert plain_post_for("http://127.0.0.1:notaport/v1", "sk-1") is None
    assert plain_post_for(None, "sk-1") is None


def test_sessions_meeting_a_redirect_together_all_go_the_sdk_way(model_server):
    """Sessions waiting on the plain path when one of them meets a redirect get theirs too: each
    hands its request to the SDK's transport, none finds the plain path gone under it."""
    from tests.helpers.model_server import ModelServer, Reply

    target = f"{model_server.base_url}/chat/completions"

    def redirect(body, state):
        return Reply(status=307, body="", headers={"Location": target}, latency=0.3)

    async def go(base_url):
        client = ModelClient(base_url, "k", policy=RetryPolicy(base_delay=0.05, max_attempts=1))
        try:
            return await asyncio.gather(*(client.complete([{"role": "user", "content": f"s{i}"}], model="m")
                                          for i in range(6)), return_exceptions=True)
        finally:
            await client.close()

    with ModelServer(policy=redirect) as redirecting:
        replies = asyncio.run(go(redirecting.base_url))
    assert all(getattr(r, "content", None) for r in replies), replies
    assert model_server.count() == 6


def test_a_url_the_request_line_cannot_carry_as_it_is_goes_the_sdk_way(monkeypatch):
    from agent.model_client import plain_post_for

    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for url in ("http://127.0.0.1:8080/v 1", "http://127.0.0.1:8080/v1?a=b c", "http://127.0.0.1:8080/vé",
                "http://127.0.0.1:8080/v€", "http://user:pw@127.0.0.1:8080/v1", "http://127.0.0.1:0/v1",
                "http://127.0.0.1:65536/v1", "http://exämple.test/v1"):
        assert plain_post_for(url, "k") is None, url
    assert plain_post_for("http://127.0.0.1/v1", "k").port == 80
    assert plain_post_for("http://127.0.0.1:8080/v%201", "k") is not None  # escaped already: sent as it is


def test_a_bad_answer_through_the_sdk_transport_is_a_failed_request_retried(monkeypatch):
    """Bytes that are no HTTP response, met on the SDK's way (here through a proxy), are a request
    without an answer, retried as on the plain path: never the transport's own exception."""
    server = _RawServer([b"XYZ garbage\r\n\r\n"] * 4, close_after=True)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{server.port}")
    monkeypatch.setenv("no_proxy", "")
    try:
        err, stats = _failure_of("http://127.0.0.1:9/v1", attempts=2)
    finally:
        server.close()
    assert isinstance(err, ProviderError) and err.error_class in ("provider", "connection"), err
    assert "after 2 attempt(s)" in str(err) and stats.retries == 1 and stats.requests == 2


def test_a_redirect_loop_fails_the_request_once_without_retries():
    """Redirects that never end would end the same way when asked again, each hop a request the
    endpoint gets: the row fails at the first, with what happened named."""
    from tests.helpers.model_server import ModelServer

    with ModelServer() as server:
        server.redirect_to = server.root_url  # every request is sent back to where it came
        err, stats = _failure_of(server.base_url, attempts=4)
    assert isinstance(err, ProviderError) and err.error_class == "provider", err
    assert "redirects never end" in str(err) and stats.retries == 0 and stats.requests == 1


def _failure_of(base_url: str, attempts: int) -> tuple[ProviderError, CallStats]:
    """The ProviderError one request to `base_url` ends with, after at most `attempts` attempts."""

    async def go():
        client = ModelClient(base_url, "k", policy=RetryPolicy(base_delay=0.01, max_attempts=attempts))
        stats = CallStats()
        try:
            await client.complete([{"role": "user", "content": "hi"}], model="m", stats=stats)
        except ProviderError as err:
            return err, stats
        finally:
            await client.close()
        raise AssertionError("the request succeeded")

    return asyncio.run(go())
