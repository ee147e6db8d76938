"""A stand-in HTTP server's handler base for the serving tests: JSON answers, no request log on stderr."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JsonHandler(BaseHTTPRequestHandler):
    """Answers with :meth:`reply`; its access log stays quiet (a test's output is the test's)."""

    def reply(self, status: int, answer: object) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass
