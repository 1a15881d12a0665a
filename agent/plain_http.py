"""POST over plain HTTP/1.1 keep-alive connections to one `http://` origin, on asyncio itself.

The hot path of a run against a local server (llama.cpp, vLLM, LiteLLM, the test servers) is two
or more model requests per prompt; through the SDK's transport a whole request (our JSON work
included) costs 0.63 to 0.75 ms of CPU, most of it the transport's objects and callbacks, which
bounds how many sessions a worker carries. Here a request is one `write` of bytes the caller
prepared and one future the protocol resolves once the whole response is in: 0.25 ms in all
(docs/benchmarks.md).

It does only what that needs and refuses the rest to the caller (`ModelClient` falls back to the
SDK's transport): no TLS, no proxies, no redirects (a 3xx comes back as-is), no HTTP/2. It reads
`Content-Length`, chunked and read-until-close bodies, decodes gzip and deflate, and never holds
more than `limit` decoded bytes of one reply. A connection that failed, was closed by the server,
said `Connection: close` or saw its request abandoned (a timeout, a cancel) is never used again.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Iterable


class ServerDisconnectedError(ConnectionError):
    """The server closed the connection before the response was complete."""


class HTTPProtocolError(Exception):
    """The server's bytes are not an HTTP/1.x response this client reads."""


class ReplyTooLarge(Exception):
    """A reply body passed the client's limit (decoded): reading stopped there."""


class Headers(dict):
    """Response headers by lower-case name (a repeated header's values joined by ", ")."""

    def __init__(self, raw_headers: list[tuple[str, str]]):
        super().__init__()
        for name, value in raw_headers:
            key = name.lower()
            self[key] = f"{self[key]}, {value}" if key in self else value

    def get(self, name: str, default=None):  # type: ignore[override]
        return super().get(name.lower(), default)


class Response:
    __slots__ = ("status_code", "headers", "raw_headers", "content")

    def __init__(self, status_code: int, raw_headers: list[tuple[str, str]], headers: Headers, content: bytes):
        self.status_code = status_code
        self.raw_headers = raw_headers
        self.headers = headers
        self.content = content


_HEADER_LIMIT = 64 * 1024  # a status line and headers longer than this are not a model endpoint's


class _Connection(asyncio.Protocol):
    """One TCP connection; at most one request in flight on it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.transport: asyncio.Transport | None = None
        self.usable = True  # may carry another request
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None
        self._head: tuple[int, list[tuple[str, str]], Headers] | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._framing = ""  # length | chunked | close
        self._remaining = 0  # body bytes (length) or bytes of the current chunk (chunked)
        self._decoder = None
        self._closes = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():  # bytes nobody asked for: the connection is spoilt
            self.usable = False
            self.transport.close()
            return
        self._buffer += data
        try:
            self._parse()
        except Exception as err:
            self._fail(err)

    def eof_received(self) -> bool:
        self.usable = False
        if self._waiter is not None and not self._waiter.done():
            if self._head is not None and self._framing == "close":
                self._finish_body()
            else:
                self._fail(ServerDisconnectedError("the server closed the connection before the response was complete"))
        return False  # close the transport

    def connection_lost(self, exc) -> None:
        self.usable = False
        if self._waiter is not None and not self._waiter.done():
            error = ServerDisconnectedError("the connection was lost before the response was complete")
            error.__cause__ = exc
            self._fail(error)

    # one request
    def request(self, data: bytes) -> asyncio.Future:
        self._waiter = asyncio.get_running_loop().create_future()
        self._head, self._body, self._body_size, self._decoder, self._closes = None, [], 0, None, False
        self.transport.write(data)
        return self._waiter

    def abandon(self) -> None:
        """The request was given up half way: its connection's state is unknown."""
        self.usable = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, err: BaseException) -> None:
        self.usable = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(err)
        if self.transport is not None:
            self.transport.close()

    def _parse(self) -> None:
        while self._head is None:
            end, after = _blank_line(self._buffer, 0)
            if end < 0:
                if len(self._buffer) > _HEADER_LIMIT:
                    raise HTTPProtocolError("the response's headers are longer than 64 KiB")
                return
            head = bytes(self._buffer[:end]).decode("latin-1")
            del self._buffer[:after]
            status, headers, http10 = _parse_head(head)
            if 100 <= status < 200:  # an interim response (100 Continue): the real one follows
                continue
            self._head = (status, headers, Headers(headers))
            self._start_body(closes=http10)  # an HTTP/1.0 server closes after each response
        if self._framing == "length":
            take = min(self._remaining, len(self._buffer))
            if take:
                self._add(bytes(self._buffer[:take]))
                del self._buffer[:take]
                self._remaining -= take
            if self._remaining == 0:
                self._finish_body()
        elif self._framing == "chunked":
            self._parse_chunks()
        else:  # until the server closes
            if self._buffer:
                self._add(bytes(self._buffer))
                self._buffer.clear()

    def _start_body(self, closes: bool) -> None:
        status, raw_headers, headers = self._head
        self._closes = closes or "close" in headers.get("connection", "").lower()
        encoding = headers.get("content-encoding", "").lower()
        if encoding in ("gzip", "x-gzip"):
            self._decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._decoder = _DeflateDecoder()
        elif encoding not in ("", "identity"):
            raise HTTPProtocolError(f"the response's content encoding {encoding!r} is not one this client decodes")
        transfer = headers.get("transfer-encoding", "").lower()
        if status in (204, 304):
            self._framing, self._remaining = "length", 0
        elif transfer:
            if transfer.split(",")[-1].strip() != "chunked":
                raise HTTPProtocolError(f"the response's transfer encoding {transfer!r} is not chunked")
            self._framing, self._remaining = "chunked", -1
        elif "content-length" in headers:
            lengths = {value for name, value in raw_headers if name.lower() == "content-length"}
            if len(lengths) != 1 or not next(iter(lengths)).isdigit():
                raise HTTPProtocolError(f"the response's Content-Length is not one number: {sorted(lengths)}")
            self._framing, self._remaining = "length", int(lengths.pop())
        else:
            self._framing, self._closes = "close", True

    def _parse_chunks(self) -> None:
        while True:
            if self._remaining < 0:  # at a chunk's size line
                end = self._buffer.find(b"\n")
                if end < 0:
                    if len(self._buffer) > 1024:
                        raise HTTPProtocolError("a chunk size line longer than 1 KiB")
                    return
                size_text = bytes(self._buffer[:end]).split(b";", 1)[0].strip()  # strip(): a CR too
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise HTTPProtocolError(f"a chunk size that is not a hex number: {size_text[:40]!r}") from None
                if size == 0:  # the last chunk; trailers (ignored) end with an empty line
                    _, trailer_end = _blank_line(self._buffer, end)
                    if trailer_end < 0:
                        if len(self._buffer) > _HEADER_LIMIT:
                            raise HTTPProtocolError("the response's trailers are longer than 64 KiB")
                        return
                    del self._buffer[:trailer_end]
                    self._finish_body()
                    return
                del self._buffer[: end + 1]
                self._remaining = size
            if len(self._buffer) <= self._remaining:  # (part of) the chunk's data, not yet its line end
                take = len(self._buffer)
                if take:
                    self._add(bytes(self._buffer))
                    self._buffer.clear()
                    self._remaining -= take
                return
            # The chunk's data ends with a CRLF (or a bare LF).
            line_end = 1 if self._buffer[self._remaining] == 0x0A else 2
            if len(self._buffer) < self._remaining + line_end:
                return
            self._add(bytes(self._buffer[: self._remaining]))
            del self._buffer[: self._remaining + line_end]
            self._remaining = -1

    def _add(self, data: bytes, flush: bool = False) -> None:
        if self._decoder is not None:
            try:
                # Never more out than the limit allows, whatever the ratio of a compression bomb.
                data = self._decoder.flush() if flush else self._decoder.decompress(data, self.limit - self._body_size + 1)
            except zlib.error as err:
                raise HTTPProtocolError(f"the response's compressed body does not decode: {err}") from None
        self._body_size += len(data)
        if self._body_size > self.limit:
            raise ReplyTooLarge(f"the reply is larger than the {self.limit // 2**20} MiB limit of a model reply "
                                f"(reading stopped there; HTTP {self._head[0]})")
        self._body.append(data)

    def _finish_body(self) -> None:
        if self._decoder is not None:
            self._add(b"", flush=True)
        status, raw_headers, headers = self._head
        if self._closes or self._buffer:  # leftover bytes: the connection's framing cannot be trusted
            self.usable = False
        waiter = self._waiter
        self._waiter = None
        waiter.set_result(Response(status, raw_headers, headers, b"".join(self._body)))
        if not self.usable:
            self.transport.close()


class _DeflateDecoder:
    """HTTP's "deflate" is a zlib stream, but some servers send raw deflate (as the SDK's transport
    reads too): the first two bytes tell which, by whether they are a zlib header."""

    def __init__(self):
        self._start = b""
        self._inner = None

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._inner is None:
            self._start += data
            if len(self._start) < 2:
                return b""
            zlib_header = self._start[0] & 0x0F == 8 and int.from_bytes(self._start[:2], "big") % 31 == 0
            self._inner = zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
            data, self._start = self._start, b""
        return self._inner.decompress(data, max_length)

    def flush(self) -> bytes:
        return self._inner.flush() if self._inner is not None else b""


def _blank_line(buffer: bytearray, start: int) -> tuple[int, int]:
    """Where the block of lines from `start` ends at an empty line, and where what follows it
    begins; (-1, -1) while there is none. Lines end with CRLF or (some servers) a bare LF."""
    crlf, lf = buffer.find(b"\n\r\n", start), buffer.find(b"\n\n", start)
    if lf >= 0 and (crlf < 0 or lf < crlf):
        return lf, lf + 2
    return (crlf, crlf + 3) if crlf >= 0 else (-1, -1)


def _parse_head(head: str) -> tuple[int, list[tuple[str, str]], bool]:
    """The status, the headers and whether the response is HTTP/1.0."""
    lines = [line.removesuffix("\r") for line in head.split("\n")]
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HTTPProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HTTPProtocolError(f"a malformed header line: {line[:80]!r}")
        headers.append((name, value.strip()))
    return int(parts[1]), headers, parts[0] == "HTTP/1.0"


class PlainHttpPost:
    """POST to one `http://host:port/path`, with the same headers each time, over a pool of
    keep-alive connections (one per request in flight; idle ones are reused, newest first)."""

    def __init__(self, host: str, port: int, path: str, headers: Iterable[tuple[str, str]], limit: int):
        self.host, self.port, self.limit = host, port, limit
        host_header = host if port == 80 else f"{host}:{port}"
        if ":" in host and not host.startswith("["):  # an IPv6 literal
            host_header = f"[{host}]" if port == 80 else f"[{host}]:{port}"
        lines = [f"POST {path} HTTP/1.1", f"Host: {host_header}"]
        lines += [f"{name}: {value}" for name, value in headers]
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        self._idle: list[_Connection] = []
        self._closed = False  # closed: a connection whose request ends is closed, not kept

    async def post(self, body: bytes) -> Response:
        connection = await self._connection()
        waiter = connection.request(b"%s%d\r\n\r\n%s" % (self._head, len(body), body))
        try:
            response = await waiter
        except BaseException:
            connection.abandon()
            raise
        if connection.usable and not self._closed:
            self._idle.append(connection)
        elif connection.usable:
            connection.abandon()
        return response

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable and not connection.transport.is_closing():
                return connection
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(lambda: _Connection(self.limit), self.host, self.port)
        return connection

    def close(self) -> None:
        self._closed = True
        for connection in self._idle:
            connection.abandon()
        self._idle.clear()
