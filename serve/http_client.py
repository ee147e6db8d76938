"""A lean KServe v2 HTTP client for load tests whose tensors live in system shared memory.

Why not tritonclient: with the tensors in shared memory a request is a few hundred bytes of JSON, and at
thousands of requests a second the client's own work per request (building the JSON, gevent's HTTP stack,
parsing the answer) becomes a share of the latency it reports and of the interpreter lock its threads share.
Here each request's bytes are made once and sent again over one kept-alive HTTP/1.1 connection per thread;
an answer is read as status line, headers and a ``Content-Length`` body. Region registration, statistics and
every other call stay with tritonclient. It speaks only what Triton's HTTP endpoint answers to an inference
request (no chunked bodies, no binary tensor data), and says so when it meets anything else.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import quote

HEAD_LIMIT = 64 << 10  # an answer's status line and headers; Triton's are a few hundred bytes


class HttpError(RuntimeError):
    """The server answered with an error (its message), or the connection broke."""


def shm_tensor(name: str, shape: list[int] | None, datatype: str | None, region: str, size: int, offset: int) -> dict:
    """One input (``shape`` and ``datatype`` given) or requested output of a request, read from or written to
    ``size`` bytes at ``offset`` of a registered system shared-memory region, as KServe v2's JSON names them."""
    params: dict[str, Any] = {"shared_memory_region": region, "shared_memory_byte_size": size}
    if offset:
        params["shared_memory_offset"] = offset
    tensor: dict[str, Any] = {"name": name}
    if shape is not None:
        tensor |= {"shape": shape, "datatype": datatype}
    return tensor | {"parameters": params}


def infer_request(
    address: str, model: str, inputs: list[dict], outputs: list[dict], parameters: dict[str, Any] | None = None
) -> bytes:
    """The whole HTTP request (head and JSON body) of one inference of ``model``; ``parameters``: the request's
    own (KServe v2's request parameters, which Triton hands to the model)."""
    request: dict[str, Any] = {"parameters": parameters} if parameters else {}
    body = json.dumps(request | {"inputs": inputs, "outputs": outputs}, separators=(",", ":")).encode()
    head = (
        f"POST /v2/models/{quote(model, safe='')}/infer HTTP/1.1\r\nHost: {address}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class HttpClient:
    """One kept-alive connection to ``address`` ("host:port"); :meth:`send` one request's bytes, get its JSON."""

    def __init__(self, address: str, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        self.address, self.timeout_s = (host, int(port)), timeout_s
        self.sock: socket.socket | None = None
        self.pending = bytearray()

    def send(self, request: bytes) -> dict[str, Any]:
        """The server's JSON answer to ``request``; :class:`HttpError` with the server's message for an error
        status, or when the connection fails (the next call opens a new one)."""
        try:
            if self.sock is None:
                self.sock = socket.create_connection(self.address, timeout=self.timeout_s)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.pending = bytearray()
            self.sock.sendall(request)
            status, body = self._answer()
        except (OSError, ValueError, IndexError) as exc:  # unread bytes would precede the next answer: start over
            self.close()
            raise HttpError(f"connection to {self.address[0]}:{self.address[1]} failed: {exc}") from None
        try:
            answer = json.loads(body) if body else {}
        except ValueError:
            answer = None
        if status != 200 or not isinstance(answer, dict):
            said = answer.get("error") if isinstance(answer, dict) else None
            raise HttpError(said or f"HTTP {status}: {body[:200]!r}")
        return answer

    def _answer(self) -> tuple[int, bytes]:
        end = self._until(b"\r\n\r\n")
        head = bytes(self.pending[:end]).decode("latin-1").split("\r\n")
        del self.pending[: end + 4]
        status = int(head[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if "content-length" not in fields:  # chunked or close-delimited: not what Triton sends for an inference
            raise OSError(f"an answer without Content-Length ({fields.get('transfer-encoding', 'no length')})")
        size = int(fields["content-length"])
        while len(self.pending) < size:
            self._receive()
        body = bytes(self.pending[:size])
        del self.pending[:size]
        if fields.get("connection", "").lower() == "close":
            self.close()
        return status, body

    def _until(self, mark: bytes) -> int:
        while (end := self.pending.find(mark)) < 0:
            if len(self.pending) > HEAD_LIMIT:
                raise OSError("an answer's headers ran past 64 KiB")
            self._receive()
        return end

    def _receive(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise OSError("the server closed the connection")
        self.pending += chunk

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
