"""A loopback HTTP proxy in front of moto's S3 that fails on purpose, the way real stores fail.

Faults happen on the server side of a real socket, so the whole client stack (s3fs,
aiobotocore, aiohttp, the KV store's retries and circuit breaker) meets them as it would in
production; nothing in the client is patched.

    proxy = FaultProxy("127.0.0.1", moto_port)
    proxy.plan("503", method="GET", path=r"\\.arrow", times=2)   # the next two pack reads
    proxy.plan("reset", fraction=0.3, seed=1)                   # ~30% of all requests
    proxy.refuse()                                              # stop listening: ECONNREFUSED
    proxy.counts["503"], proxy.counts["forwarded"]

Faults: "503" (S3's XML ServiceUnavailable body), "reset" (close with SO_LINGER 0: an RST),
"stall" (read the request, answer nothing for `stall_s`, then close), "truncate" (the real
response's headers with its full Content-Length, half the body, then close), "short" (half the
body with a Content-Length that matches it: only the reader's own length/checksum checks can
tell), and `refuse()` / `resume()` for a store that is down. Everything is bounded: stalls end
at `stall_s` or at `close()`, sockets time out, `close()` joins its threads.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field

FAULTS = ("503", "reset", "stall", "truncate", "short")

_S3_503 = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
           b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>")
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
_MAX_HEADER_LINES = 200


@dataclass
class _Rule:
    fault: str
    method: str | None
    path: re.Pattern | None
    times: int | None  # None: no limit (with `fraction`)
    fraction: float
    rng: random.Random
    stall_s: float
    hits: int = 0

    def matches(self, method: str, target: str) -> bool:
        if self.method is not None and method != self.method:
            return False
        return self.path is None or self.path.search(target) is not None


@dataclass
class _Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    close: bool = False


@dataclass
class FaultProxy:
    """See the module docstring. Thread-safe; `counts` is updated under a lock."""

    upstream_host: str
    upstream_port: int
    socket_timeout_s: float = 10.0
    counts: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._stop = threading.Event()
        self._clients: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self.port = 0
        self._listen()

    # -- the plan --------------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def plan(self, fault: str, *, method: str | None = None, path: str | None = None, times: int | None = None,
             fraction: float = 1.0, seed: int = 0, stall_s: float = 5.0) -> None:
        """Add a rule: requests matching `method` and the regex `path` (searched in the request
        target, query included) get `fault`, for the next `times` of them, or each with
        probability `fraction` (a seeded RNG, so a run is reproducible). First matching rule wins."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; use one of {FAULTS}")
        if times is None and not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        if not 0 <= stall_s <= 60:
            raise ValueError(f"stall_s must be in [0, 60], got {stall_s}")
        rule = _Rule(fault, method, re.compile(path) if path else None, times, fraction, random.Random(seed), stall_s)
        with self._lock:
            self._rules.append(rule)

    def clear(self) -> None:
        """No more faults: every request is forwarded."""
        with self._lock:
            self._rules.clear()

    def _fault_for(self, method: str, target: str) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if not rule.matches(method, target):
                    continue
                if rule.times is not None:
                    if rule.hits >= rule.times:
                        continue
                elif rule.rng.random() >= rule.fraction:
                    continue
                rule.hits += 1
                self.counts[rule.fault] += 1
                return rule
            self.counts["forwarded"] += 1
            return None

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    # -- listening ---------------------------------------------------------------------------------

    def _listen(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))  # 0 the first time; the same port on resume()
        s.listen(64)
        s.settimeout(0.2)  # accept() wakes up to notice refuse() / close()
        self.port = s.getsockname()[1]
        self._listener = s
        t = threading.Thread(target=self._accept_loop, args=(s,), name="fault-proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def refuse(self) -> None:
        """Stop listening and drop every open connection: new connections are refused."""
        with self._lock:
            listener, self._listener = self._listener, None
            clients = list(self._clients)
        if listener is not None:
            listener.close()
        for c in clients:
            try:  # wakes the handler (its read returns EOF), which then closes the socket
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def resume(self) -> None:
        """Listen again on the same port."""
        with self._lock:
            if self._listener is not None:
                return
        self._listen()

    def close(self) -> None:
        self._stop.set()
        self.refuse()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> FaultProxy:  # noqa: PYI034 - a dataclass, not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._listener is not listener:
                    return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by refuse()
            conn.settimeout(self.socket_timeout_s)
            with self._lock:
                self._clients.add(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name="fault-proxy-conn", daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    # -- one client connection ---------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        upstream: http.client.HTTPConnection | None = None
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                req = _read_request(reader, conn)
                if req is None:
                    return
                rule = self._fault_for(req.method, req.target)
                if rule is not None and rule.fault == "reset":
                    _abort(conn, reader)
                    return
                if rule is not None and rule.fault == "stall":
                    self._stop.wait(rule.stall_s)  # hold the socket: the client's read timeout must fire
                    return
                if rule is not None and rule.fault == "503":
                    conn.sendall(_head(503, "Service Unavailable", [("Content-Type", "application/xml")],
                                       len(_S3_503)) + _S3_503)
                    continue
                if upstream is None:
                    upstream = http.client.HTTPConnection(self.upstream_host, self.upstream_port,
                                                          timeout=self.socket_timeout_s)
                status, reason, headers, body, length = _forward(upstream, req)
                if req.method != "HEAD":  # a HEAD's Content-Length is the object's, with no body
                    length = len(body)
                if rule is not None and rule.fault in ("truncate", "short"):
                    cut = body[: len(body) // 2]
                    conn.sendall(_head(status, reason, headers, len(cut) if rule.fault == "short" else len(body),
                                       close=True) + cut)
                    if rule.fault == "truncate":
                        _abort(conn, reader)
                    return
                conn.sendall(_head(status, reason, headers, length, close=req.close) + body)
                if req.close:
                    return
        except OSError:
            return  # the client went away, or refuse()/close() dropped it
        finally:
            reader.close()
            with self._lock:
                self._clients.discard(conn)
            try:
                conn.close()
            except OSError:
                pass
            if upstream is not None:
                upstream.close()


def _abort(conn: socket.socket, reader) -> None:
    """Close with an RST (SO_LINGER on, timeout 0), as a crashed server or a load balancer does.
    The reader goes first: a socket with an open makefile() is not really closed."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reader.close()
        conn.close()
    except OSError:
        pass


def _read_request(reader, conn: socket.socket) -> _Request | None:
    line = reader.readline(65537)
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3:
        return None
    method, target, _ = parts
    headers: list[tuple[str, str]] = []
    for _ in range(_MAX_HEADER_LINES):
        h = reader.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    lower = {k.lower(): v for k, v in headers}
    if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in lower.get("transfer-encoding", "").lower():
        body = _read_chunked(reader)
    else:
        body = reader.read(int(lower.get("content-length", "0") or 0))
    return _Request(method, target, headers, body, close=lower.get("connection", "").lower() == "close")


def _read_chunked(reader) -> bytes:
    out = bytearray()
    for _ in range(1 << 20):  # bounded: at most this many chunks
        size = int(reader.readline(1024).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while reader.readline(65537) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(out)
        out += reader.read(size)
        reader.readline(8)
    raise ValueError("too many chunks")


def _forward(upstream: http.client.HTTPConnection,
             req: _Request) -> tuple[int, str, list[tuple[str, str]], bytes, int]:
    headers = {k: v for k, v in req.headers if k.lower() not in _HOP}
    headers["Content-Length"] = str(len(req.body))
    for attempt in range(2):  # a kept-alive upstream connection may have been closed by moto
        try:
            upstream.request(req.method, req.target, body=req.body, headers=headers)
            resp = upstream.getresponse()
            body = resp.read()
            length = int(resp.getheader("Content-Length") or len(body))
            return resp.status, resp.reason, [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP
                                              and k.lower() != "content-length"], body, length
        except (http.client.HTTPException, OSError):
            upstream.close()
            if attempt:
                raise
    raise AssertionError("unreachable")


def _head(status: int, reason: str, headers: list[tuple[str, str]], length: int, close: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() != "content-length"]
    lines.append(f"Content-Length: {length}")
    lines.append("Connection: close" if close else "Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
