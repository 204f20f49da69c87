"""What an attacker or a newcomer's client met at the server's edges (issue 49, items 6, 10, 11): a deeply nested body
is refused as nested too deeply (not as invalid JSON), an oversized request head gets OpenAI's error shape, HEAD on a
page behind the API key is a 401, a head that dribbles in is cut sooner than a body (and a slow head leaves the body
only what is left of the request's time), the openai JS SDK's CORS preflight passes, /v1/responses says where to go,
the first structured request does not hold up the plain ones beside it, and a hub id is told `hf download`."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from served import TIMEOUT, Running, request

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(served_dir):
    server = Running(served_dir, api_key="sesame", max_batch=2, allowed_origins=["http://app.example"],
                     server_options=dict(receive_timeout_s=4.0, header_timeout_s=0.5))
    yield server
    server.stop()


KEY = {"Authorization": "Bearer sesame"}


def deep_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_body_nested_too_deeply_is_told_so_with_the_limit(keyed):
    from lookahead.serve.app import MAX_JSON_DEPTH

    schema = {"name": "x", "schema": deep_schema(100)}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": schema}}
    status, _, answer = keyed.post("/v1/chat/completions", body, KEY)
    assert status == 400 and answer["error"]["code"] == "json_too_deep", answer
    assert "nested too deeply" in answer["error"]["message"] and str(MAX_JSON_DEPTH) in answer["error"]["message"]
    status, _, answer = keyed.post("/v1/chat/completions", b'{"model": ', KEY)  # invalid JSON is still told so
    assert status == 400 and answer["error"]["code"] == "invalid_json"


def read_until_closed(sock) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before the end
            pass
        try:
            return read_until_closed(sock)
        except ConnectionResetError:
            return b""


def test_an_oversized_or_malformed_head_gets_the_json_error_shape(keyed):
    # (a head past the limit that is still arriving: the whole of it sent, the server would close on unread bytes)
    for data, words in ((b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000, b"larger than"),
                        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", b"malformed")):
        said = raw_exchange(keyed.port, data)
        head, _, body = said.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), said[:300]
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and words in error["message"].encode(), error
    assert keyed.get("/health")[0] == 200


def test_head_on_a_page_behind_the_key_is_a_401(keyed):
    for path in ("/docs", "/openapi.json"):
        assert request(keyed.port, "HEAD", path, None, {})[0] == 401, path  # (was 405: the route has GET only)
        assert keyed.get(path)[0] == 401
    assert keyed.get("/docs", KEY)[0] == 200


def test_the_openai_js_sdks_preflight_passes(keyed):
    sent = "authorization, content-type, x-stainless-os, x-stainless-lang, x-stainless-package-version, " \
           "x-stainless-runtime, x-stainless-runtime-version, x-stainless-arch, x-stainless-retry-count, " \
           "x-stainless-timeout"
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": sent}
    status, headers, _ = request(keyed.port, "OPTIONS", "/v1/chat/completions", None, preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example", headers
    allowed = {h.strip() for h in headers["access-control-allow-headers"].lower().split(",")}
    assert {h.strip() for h in sent.split(",")} <= allowed, allowed
    status, headers, _ = request(keyed.port, "OPTIONS", "/v1/chat/completions", None,
                                 {**preflight, "Origin": "http://other.example"})
    assert "access-control-allow-origin" not in headers


def test_the_responses_api_is_refused_naming_chat_completions(keyed):
    body = {"model": "tiny", "input": "hi"}
    assert keyed.post("/v1/responses", body)[0] == 401  # behind the key like every /v1 route
    for path in ("/v1/responses", "/v1/responses/resp_1"):
        status, headers, answer = keyed.post(path, body, KEY) if path == "/v1/responses" else keyed.get(path, KEY)
        assert status == 404 and headers["content-type"] == "application/json", answer
        assert "/v1/chat/completions" in answer["error"]["message"], answer


def test_a_head_that_dribbles_is_cut_before_a_body_that_does(keyed):
    """header_timeout_s 0.5, receive_timeout_s 4: half a head gets 408 at about 0.5 s; a whole head whose body
    dribbles is held to the request's 4 s."""
    data = json.dumps(CHAT).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer sesame\r\nContent-Length: %d\r\n\r\n" % len(data))
    closed = {}

    def dribble(name: str, first: bytes) -> None:
        with socket.create_connection(("127.0.0.1", keyed.port), timeout=TIMEOUT) as sock:
            start = time.monotonic()
            sock.sendall(first)
            said = read_until_closed(sock)
            closed[name] = (time.monotonic() - start, said)

    threads = [threading.Thread(target=dribble, args=("head", head[:40])),
               threading.Thread(target=dribble, args=("body", head + data[:5]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    for name, (_, said) in closed.items():
        assert said.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in said, (name, said[:200])
    assert closed["head"][0] < 2.0 and closed["body"][0] > 3.0, closed


def test_a_slow_head_leaves_its_body_what_is_left_of_the_requests_deadline(served_dir):
    """The whole request's deadline runs from its first byte, not from its head's last: with header_timeout_s 3 and
    receive_timeout_s 5, a head that takes 2 s leaves a dribbling body 3 s, so the 408 comes about 5 s after the
    first byte (a deadline started again once the head was in would give the request 7 s; 1.5 s of room for a busy
    machine between the two)."""
    server = Running(served_dir, max_batch=1, server_options=dict(receive_timeout_s=5.0, header_timeout_s=3.0))
    try:
        data = json.dumps(CHAT).encode()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(data))
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
            start = time.monotonic()
            sock.sendall(head[:40])
            time.sleep(2.0)
            sock.sendall(head[40:] + data[:5])
            said = read_until_closed(sock)
            took = time.monotonic() - start
    finally:
        server.stop()
    assert said.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in said, said[:200]
    assert 4.8 < took < 6.5, took


def test_the_first_structured_request_does_not_hold_up_plain_ones(served_dir, monkeypatch):
    """The first grammar reads the tokenizer's whole vocabulary (seconds for a real one: made slow here); a plain
    request sent meanwhile is answered without waiting for it (it waited 1.9 s behind it on the prompts' thread)."""
    import lookahead.serve.app as app_module

    reading = threading.Event()

    class SlowGrammars(app_module.Grammars):
        def __init__(self, *args, **kwargs) -> None:
            reading.set()
            time.sleep(3.0)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(app_module, "Grammars", SlowGrammars)
    server = Running(served_dir, max_batch=2)
    try:
        assert server.post("/v1/chat/completions", CHAT)[0] == 200  # the engine's own first-request costs, first
        structured = {**CHAT, "max_tokens": 8, "response_format": {"type": "json_object"}}
        first = threading.Thread(target=server.post, args=("/v1/chat/completions", structured))
        first.start()
        assert reading.wait(TIMEOUT)
        start = time.monotonic()
        assert server.post("/v1/chat/completions", CHAT)[0] == 200
        waited = time.monotonic() - start
        first.join(TIMEOUT)
        assert waited < 2.0, f"a plain request waited {waited:.1f} s behind the first grammar"
    finally:
        server.stop()


def test_a_hub_id_is_told_the_hf_command(capsys):
    from lookahead.cli import main

    assert main(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 2
    err = capsys.readouterr().err
    assert "'hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR'" in err and "huggingface-cli" not in err
