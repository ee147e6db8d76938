"""Kiln's lean HTTP client against a real HTTP/1.1 server on this machine (the standard library's)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from kiln.serve.http_client import HttpClient, HttpError, infer_request, shm_tensor
from tests.serve.json_handler import JsonHandler


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Triton
    seen: list[tuple[str, dict, int]] = []  # (path, body, client port): what arrived, and over which connection

    def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, body, self.client_address[1]))
        if body["inputs"][0]["name"] == "bad":
            self.reply(400, {"error": "unexpected inference input 'bad' for model 'm'"})
        elif body["inputs"][0]["name"] == "garbled":  # a length that is no number, and a body after it
            self.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 1 7\r\n\r\n{"error": "x y"}')
        elif body["inputs"][0]["name"] == "text":  # an error whose body is not JSON
            data = b"internal error: out of memory"
            self.send_response(500)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif body["inputs"][0]["name"] == "chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.reply(200, {"model_name": "m", "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2]}]})


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _request(address: str, name: str = "x") -> bytes:
    inputs = [shm_tensor(name, [1, 4], "FP32", "kiln_in", 16, 32)]
    return infer_request(address, "my model", inputs, [shm_tensor("y", None, None, "kiln_out0", 8, 0)])


def test_requests_reuse_one_connection_and_say_their_shared_memory_as_kserve_does(server: str) -> None:
    client = HttpClient(server, timeout_s=10)
    for _ in range(3):
        answer = client.send(_request(server))
        assert answer["outputs"][0]["shape"] == [1, 2]
    client.close()
    paths, bodies, ports = zip(*_Handler.seen)
    assert set(paths) == {"/v2/models/my%20model/infer"} and len(set(ports)) == 1  # one kept-alive connection
    assert bodies[0] == {
        "inputs": [
            {
                "name": "x",
                "shape": [1, 4],
                "datatype": "FP32",
                "parameters": {
                    "shared_memory_region": "kiln_in",
                    "shared_memory_byte_size": 16,
                    "shared_memory_offset": 32,
                },
            }
        ],
        "outputs": [{"name": "y", "parameters": {"shared_memory_region": "kiln_out0", "shared_memory_byte_size": 8}}],
    }


def test_a_requests_own_parameters_go_in_its_body(server: str) -> None:
    client = HttpClient(server, timeout_s=10)
    inputs = [shm_tensor("x", [1, 4], "FP32", "kiln_in", 16, 0)]
    client.send(infer_request(server, "m", inputs, [], {"kiln_sent_ns": 123}))
    client.close()
    assert _Handler.seen[-1][1]["parameters"] == {"kiln_sent_ns": 123}


def test_an_error_answer_gives_the_servers_message_and_the_connection_goes_on(server: str) -> None:
    client = HttpClient(server, timeout_s=10)
    with pytest.raises(HttpError, match="unexpected inference input 'bad'"):
        client.send(_request(server, "bad"))
    assert client.send(_request(server))["model_name"] == "m"
    assert len({port for _, _, port in _Handler.seen}) == 1


def test_an_answer_it_cannot_read_or_a_closed_server_is_an_error_then_a_new_connection(server: str) -> None:
    client = HttpClient(server, timeout_s=10)
    with pytest.raises(HttpError, match="without Content-Length"):
        client.send(_request(server, "chunked"))
    assert client.send(_request(server))["model_name"] == "m"  # a new connection
    assert len({port for _, _, port in _Handler.seen}) == 2
    closed = HttpClient("127.0.0.1:1", timeout_s=10)
    with pytest.raises(HttpError, match="connection to 127.0.0.1:1 failed"):
        closed.send(_request("127.0.0.1:1"))


def test_a_garbled_answer_costs_that_request_only_and_a_text_error_keeps_its_words(server: str) -> None:
    client = HttpClient(server, timeout_s=10)
    with pytest.raises(HttpError, match="failed"):
        client.send(_request(server, "garbled"))
    for _ in range(2):  # its unread bytes do not reach the next answers: they come on a new connection
        assert client.send(_request(server))["model_name"] == "m"
    with pytest.raises(HttpError, match="HTTP 500: b'internal error: out of memory'"):
        client.send(_request(server, "text"))
    assert client.send(_request(server))["model_name"] == "m"
