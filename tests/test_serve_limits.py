"""The server's limits and errors against the real openai client and raw HTTP: a client that disconnects (its row
leaves, the metrics count it), the API key, a full queue (503 with Retry-After), stopping with requests in flight,
malformed requests (4xx naming the field, never 5xx; the engine goes on), the metrics and the other endpoints."""

import http.client
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from served import PROMPTS, TIMEOUT, Running, ask, chat_ids, expected, open_stream, read_event, request


def test_a_client_that_disconnects_leaves_the_engine_and_others_are_unaffected(warm_server, served_reference):
    """Mid-stream and while waiting for a whole answer: the row leaves at the next step boundary, the metrics count
    the request as cancelled, and a request served beside it gets its exact answer."""
    server, reference = warm_server, served_reference
    cancelled = server.metric("request_success_total", finished_reason="cancelled")
    body = dict(model="tiny", prompt="abc", max_tokens=480, ignore_eos=True, temperature=0)
    beside = ThreadPoolExecutor(1).submit(ask, server.client(), "tiny", "chat", PROMPTS[3], False, max_tokens=40,
                                          temperature=0)
    conn, response = open_stream(server.port, "/v1/completions", {**body, "stream": True})
    for _ in range(3):
        assert read_event(response) not in (None, "[DONE]")
    conn.close()
    server.wait_for(lambda: server.metric("request_success_total", finished_reason="cancelled") == cancelled + 1,
                  "the stream's request to be cancelled")
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:  # not streamed
        data = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        server.wait_for(lambda: len(server.engine.active) + server.engine.queued >= 1, "the request to start")
    server.wait_for(lambda: server.metric("request_success_total", finished_reason="cancelled") == cancelled + 2,
                  "the whole-answer request to be cancelled")
    server.wait_for(lambda: not server.engine.active, "the engine to have no live rows")
    want = expected(reference, server.tokenizer, chat_ids(server.tokenizer, PROMPTS[3]), 40)
    assert beside.result(TIMEOUT)["text"] == want.text
    assert not server.engine.model.rows  # every row released


def test_a_client_that_gives_up_is_counted_as_499_and_not_logged_as_a_failure(warm_server, caplog):
    """A client that leaves while its body is arriving, or while it waits for a whole answer: no traceback, no 500
    (they were an InvalidStateError after cancel() and a ClientDisconnect, each a logged 500)."""
    server = warm_server
    cancelled = server.metric("request_success_total", finished_reason="cancelled")
    closed = server.metric("request_rejected_total", status="499")
    data = json.dumps(dict(model="tiny", prompt="abc", max_tokens=480, ignore_eos=True, temperature=0)).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:  # half a body, then gone
        sock.sendall(head % len(data) + data[:10])
    server.wait_for(lambda: server.metric("request_rejected_total", status="499") == closed + 1,
                    "the half-sent request to be counted as 499")
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:  # a whole body, then gone
        sock.sendall(head % len(data) + data)
        server.wait_for(lambda: len(server.engine.active) + server.engine.queued >= 1, "the request to start")
    server.wait_for(lambda: server.metric("request_success_total", finished_reason="cancelled") == cancelled + 1,
                    "the whole-answer request to be cancelled")
    ask(server.client(), "tiny", "completions", "after", False, max_tokens=4, temperature=0)  # handlers have ended
    assert server.metric("request_rejected_total", status="500") == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


THINKING = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"


def test_the_sdks_and_vllms_and_llama_servers_extra_fields(warm_server, served_reference, caplog):
    """The openai SDK's hints are accepted and ignored (logged once), chat_template_kwargs reaches the template,
    add_generation_prompt and n_predict are honoured; what would change the answer and is not supported is refused by
    name, and a field nobody defines is still unrecognized."""
    import logging

    server, tokenizer = warm_server, warm_server.tokenizer
    caplog.set_level(logging.INFO, logger="lookahead.serve")
    client = server.client()
    messages = [{"role": "user", "content": PROMPTS[0]}]
    template = tokenizer.chat_template
    tokenizer.chat_template = template + THINKING  # a template that reads a keyword, as Qwen3's enable_thinking
    try:
        for _ in range(2):
            answer = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0, prompt_cache_key="k",
                safety_identifier="user-1", verbosity="medium",
                extra_body={"cache_prompt": True, "chat_template_kwargs": {"enable_thinking": False}})
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, enable_thinking=False))
        assert ids != chat_ids(tokenizer, PROMPTS[0]) and answer.usage.prompt_tokens == len(ids)
        assert answer.choices[0].message.content == expected(served_reference, tokenizer, ids, 12).text
        bare = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                  return_dict=False))
        answer = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                extra_body={"add_generation_prompt": False, "n_predict": 5})
        assert answer.usage.prompt_tokens == len(bare) and answer.usage.completion_tokens <= 5
        assert answer.choices[0].message.content == expected(served_reference, tokenizer, bare, 5).text
    finally:
        tokenizer.chat_template = template
    logged = [r.getMessage() for r in caplog.records if "ignoring the request field" in r.getMessage()]
    assert sorted(logged) == sorted(f"ignoring the request field {name!r} (it cannot change the answer); logged once"
                                    for name in ("prompt_cache_key", "safety_identifier", "cache_prompt"))
    for change, param in [({"verbosity": "low"}, "verbosity"), ({"chat_template": "{{ x }}"}, "chat_template"),
                          ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
                          ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
                          ({"n_predict": 7, "max_tokens": 8}, "n_predict"), ({"flavour": 1}, "flavour")]:
        status, _, body = server.post("/v1/chat/completions", {"model": "tiny", "messages": messages, **change})
        assert status == 400 and body["error"]["param"] == param, (change, body)


def test_prompts_are_tokenized_off_the_event_loop_and_what_cannot_fit_is_refused_untokenized(warm_server,
                                                                                           served_reference):
    """While a prompt is being tokenized (held here), the server answers others; a prompt whose characters alone
    need more tokens than the model's positions is refused without tokenizing it (a 4 MB prompt took seconds to be
    refused, every stream stopped meanwhile)."""
    server = warm_server
    served = server.app.state.served
    tokenizer, entered, release, calls = served.tokenizer, threading.Event(), threading.Event(), []

    class Held:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *args, **kwargs):
            calls.append(args)
            entered.set()
            release.wait(TIMEOUT)
            return tokenizer(*args, **kwargs)

    served.tokenizer = Held()
    try:
        too_long = "a" * (512 * served.longest_token + 1)
        status, _, answer = server.post("/v1/completions", {**COMPLETION, "prompt": too_long})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded" and not calls
        held = ThreadPoolExecutor(1).submit(ask, server.client(), "tiny", "completions", "xyz", False, max_tokens=8,
                                            temperature=0)
        assert entered.wait(TIMEOUT)
        assert server.get("/health")[0] == 200  # the loop is free while the prompt is tokenized
        ids = chat_ids(tokenizer, PROMPTS[1])  # token ids: no tokenizing, so it need not wait for the held one
        answer = server.client().completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
        assert answer.choices[0].text == expected(served_reference, tokenizer, ids, 8).text
        assert not held.done()
    finally:
        release.set()
        served.tokenizer = tokenizer
    want = expected(served_reference, tokenizer, tokenizer("xyz")["input_ids"], 8)
    assert held.result(TIMEOUT)["text"] == want.text


def test_unset_sampling_fields_take_the_models_generation_config(served_dir, served_reference, tmp_path):
    """A generation_config.json with temperature 0: a request that sets no temperature is greedy (not OpenAI's
    temperature 1); one that sets it samples; a folder without the file gives OpenAI's defaults."""
    import shutil

    from lookahead.serve import sampling_defaults

    folder = shutil.copytree(served_dir, tmp_path / "model")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 257, "temperature": 0.0,
                                                               "top_p": 0.9, "top_k": 20}))
    assert sampling_defaults(folder) == {"temperature": 0.0, "top_p": 0.9, "top_k": 20}
    (tmp_path / "bare").mkdir()
    assert sampling_defaults(tmp_path / "bare") == {}
    server = Running(folder, sampling_defaults=sampling_defaults(folder))
    try:
        ids = server.tokenizer("xyz")["input_ids"]
        greedy = expected(served_reference, server.tokenizer, ids, 16)
        sampled = expected(served_reference, server.tokenizer, ids, 16, temperature=1.0, top_p=0.9, top_k=20, seed=3)
        assert greedy.text != sampled.text  # (the test's premise)
        unset = server.client().completions.create(model="tiny", prompt="xyz", max_tokens=16, seed=3)
        assert unset.choices[0].text == greedy.text
        hot = server.client().completions.create(model="tiny", prompt="xyz", max_tokens=16, seed=3, temperature=1.0)
        assert hot.choices[0].text == sampled.text  # top_p and top_k from the file still
    finally:
        server.stop()


def test_the_api_key(served_dir):
    from openai import AuthenticationError

    server = Running(served_dir, api_key="sesame", max_batch=1)
    try:
        body = dict(model="tiny", prompt="hi", max_tokens=2, temperature=0)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, _, answer = server.post("/v1/completions", body, headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        assert server.get("/v1/models")[0] == 401
        assert server.post("/v1/completions", body, {"Authorization": "Bearer sesame"})[0] == 200
        assert server.get("/health")[0] == 200 and server.get("/metrics")[0] == 200  # open
        with pytest.raises(AuthenticationError):
            server.client("wrong").models.list()
        assert [m.id for m in server.client("sesame").models.list()] == ["tiny"]
        # the schema and its page are behind the key, and so are unknown routes and methods under /v1
        key = {"Authorization": "Bearer sesame"}
        for path in ("/openapi.json", "/docs", "/v1/nowhere"):
            assert server.get(path)[0] == 401, path
        assert server.get("/v1/nowhere", key)[0] == 404 and server.get("/v1/completions", key)[0] == 405
        assert server.get("/docs", key)[0] == 200
    finally:
        server.stop()


def test_the_openapi_schema_declares_the_request_bodies_health_answers_head_and_cors(served_dir):
    server = Running(served_dir, max_batch=1, allowed_origins=["http://app.example"])
    try:
        status, _, schema = server.get("/openapi.json")
        assert status == 200
        components = schema["components"]["schemas"]
        for path, model, field in (("/v1/chat/completions", "ChatCompletionRequest", "messages"),
                                   ("/v1/completions", "CompletionRequest", "prompt")):
            body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": f"#/components/schemas/{model}"} and field in components[model]["properties"]
        assert "ChatMessage" in components  # what the bodies refer to is there too
        assert request(server.port, "HEAD", "/health", None, {})[0] == 200
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = request(server.port, "OPTIONS", "/v1/completions", None, preflight)
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
        status, headers, _ = request(server.port, "OPTIONS", "/v1/completions", None,
                                     {**preflight, "Origin": "http://other.example"})
        assert "access-control-allow-origin" not in headers
    finally:
        server.stop()


def read_until_closed(sock) -> bytes:
    """What the server sends until it closes the connection (bounded by the socket's timeout)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_slow_clients_get_408_and_lose_their_connection_and_others_are_served(served_dir, served_reference):
    """A request head, or a body, that stops arriving: after receive_timeout_s the client gets 408 and its
    connection closes (they used to be held open for ever: 1,100 of them locked every client out); an idle connection
    closes too; meanwhile and after, others are served. Past max_connections connections a request gets 503."""
    server = Running(served_dir, max_batch=2, server_options=dict(receive_timeout_s=1.0, max_connections=4))
    try:
        data = json.dumps(COMPLETION).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n")
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) for _ in range(3)]
        try:
            socks[0].sendall(head[:30])  # half a head
            socks[1].sendall(head % len(data) + data[:5])  # a head and part of its body
            # socks[2] sends nothing
            state = server.server._uvicorn.server_state
            server.wait_for(lambda: len(state.connections) >= 3, "the three connections to be open")
            status, _, answer = server.post("/v1/completions", COMPLETION)  # the fourth connection: at the cap
            assert status == 503
            for sock in socks:
                said = read_until_closed(sock)
                assert said.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in said, said[:200]
        finally:
            for sock in socks:
                sock.close()
        server.wait_for(lambda: len(state.connections) == 0, "the slow connections to be closed")
        answer = ask(server.client(), "tiny", "completions", "xyz", False, max_tokens=8, temperature=0)
        ids = server.tokenizer("xyz")["input_ids"]
        assert answer["text"] == expected(served_reference, server.tokenizer, ids, 8).text
    finally:
        server.stop()


def test_full_rows_and_queue_answer_503_with_retry_after(served_dir, served_reference):
    reference = served_reference
    server = Running(served_dir, max_batch=1, max_queue=1)
    try:
        conn, response = open_stream(server.port, "/v1/completions", dict(
            model="tiny", prompt="abc", max_tokens=480, ignore_eos=True, temperature=0, stream=True))
        assert read_event(response) is not None  # the one row is taken
        waiting = ThreadPoolExecutor(1).submit(ask, server.client(), "tiny", "completions", "xyz", False,
                                               max_tokens=8, temperature=0)
        server.wait_for(lambda: server.engine.queued == 1, "the second request to wait")
        assert server.metric("num_requests_waiting") == 1 and server.metric("num_requests_running") == 1
        status, headers, answer = server.post("/v1/completions", dict(model="tiny", prompt="q", max_tokens=2))
        assert status == 503 and headers["retry-after"] == "1" and answer["error"]["code"] == "overloaded"
        conn.close()  # the first leaves; the waiting one gets its row and its exact answer
        want = expected(reference, server.tokenizer, server.tokenizer("xyz")["input_ids"], 8)
        assert waiting.result(TIMEOUT)["text"] == want.text
        assert server.metric("request_rejected_total", status=503) == 1
    finally:
        server.stop()


def test_stopping_ends_requests_in_flight_with_abort_which_the_openai_client_reads(served_dir):
    """What SIGTERM does (the subprocess test sends one): a stream gets a last chunk, finish_reason "abort", then
    [DONE]; a request waiting for its whole answer gets a 503 that says it was cut (a 200 with part of the answer
    passed for the whole with clients that ignore finish_reason); the server's thread ends."""
    from openai import APIStatusError

    server = Running(served_dir, max_batch=2)
    body = dict(model="tiny", max_tokens=480, temperature=0, extra_body={"ignore_eos": True})
    whole = ThreadPoolExecutor(1).submit(server.client().completions.create, prompt="xyz", **body)
    chunks = iter(server.client().completions.create(prompt="abc", stream=True, **body))
    next(chunks)
    server.wait_for(lambda: len(server.engine.active) == 2, "both requests to decode")
    stopping = threading.Thread(target=server.server.stop, args=(TIMEOUT,))
    stopping.start()
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "abort" and all(c.choices[0].finish_reason is None for c in rest[:-1])
    with pytest.raises(APIStatusError, match="shutting down: the answer was cut after") as cut:
        whole.result(TIMEOUT)
    assert cut.value.status_code == 503
    stopping.join(TIMEOUT)
    assert not server.server._thread.is_alive() and not server.engine.active


def test_a_request_that_arrives_after_the_signal_gets_503_shutting_down(served_dir):
    """Between the signal and uvicorn's shutdown (its next tick; held open here) a new request is refused: it used to
    be let in and then cut, a 200 with no text."""
    import asyncio
    import signal

    server = Running(served_dir, max_batch=2)
    uv = server.server._uvicorn
    shutdown, release = uv.shutdown, threading.Event()

    async def held(sockets=None):
        await asyncio.to_thread(release.wait, TIMEOUT)
        await shutdown(sockets)

    uv.shutdown = held
    try:
        uv.handle_exit(signal.SIGTERM, None)
        for body in ({**COMPLETION}, {**COMPLETION, "stream": True}):
            status, _, answer = server.post("/v1/completions", body)
            assert status == 503 and "shutting down" in answer["error"]["message"], answer
        assert server.get("/health")[0] == 503
    finally:
        release.set()
        server.stop()


CHAT = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
COMPLETION = dict(model="tiny", prompt="hi", max_tokens=4, temperature=0)
# (id, path, body: a dict merged into CHAT/COMPLETION, None to drop a key, or raw bytes; status, param)
MALFORMED = [
    ("not-json", "chat", b"{not json", 400, None),
    ("empty-body", "chat", b"", 400, None),
    ("a-list", "chat", b"[1, 2]", 400, None),
    ("invalid-utf8", "chat", b'{"model": "\xff"}', 400, None),
    ("no-model", "chat", {"model": None}, 400, "model"),
    ("no-messages", "chat", {"messages": None}, 400, "messages"),
    ("empty-messages", "chat", {"messages": []}, 400, "messages"),
    ("messages-a-string", "chat", {"messages": "hi"}, 400, "messages"),
    ("bad-role", "chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("tool-without-call-id", "chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ("function-role", "chat", {"messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
    ("content-int", "chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("image-part", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content"),
    ("no-content", "chat", {"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("temperature-string", "chat", {"temperature": "hot"}, 400, "temperature"),
    ("temperature-nan", "chat", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                                b'"temperature": NaN}', 400, "temperature"),
    ("temperature-5", "chat", {"temperature": 5}, 400, "temperature"),
    ("temperature-negative", "chat", {"temperature": -1}, 400, "temperature"),
    ("top-p-0", "chat", {"top_p": 0}, 400, "top_p"),
    ("max-tokens-negative", "chat", {"max_tokens": -5}, 400, "max_tokens"),
    ("max-tokens-0", "chat", {"max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-float", "chat", {"max_tokens": 1.5}, 400, "max_tokens"),
    ("max-tokens-bool", "chat", {"max_tokens": True}, 400, "max_tokens"),
    ("max-tokens-huge", "chat", {"max_tokens": 10**12}, 400, "max_tokens"),
    ("n-2", "chat", {"n": 2}, 400, "n"),
    ("stop-5", "chat", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("stop-empty", "chat", {"stop": [""]}, 400, "stop"),
    ("stop-int", "chat", {"stop": 7}, 400, "stop"),
    ("stop-too-long", "chat", {"stop": ["x" * 1025]}, 400, "stop"),
    ("top-logprobs-21", "chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top-logprobs-alone", "chat", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("seed-string", "chat", {"seed": "x"}, 400, "seed"),
    ("seed-huge", "chat", {"seed": 2**64}, 400, "seed"),
    ("unknown-field", "chat", {"flavour": "vanilla"}, 400, "flavour"),
    ("tools-not-a-list", "chat", {"tools": {"type": "function", "function": {"name": "f"}}}, 400, "tools"),
    ("functions", "chat", {"functions": [{"name": "f"}]}, 400, "functions"),
    ("response-format-xml", "chat", {"response_format": {"type": "xml"}}, 400, "response_format"),
    ("tools-on-completions", "completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("logit-bias", "chat", {"logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("presence-penalty", "chat", {"presence_penalty": 0.5}, 400, "presence_penalty"),
    ("stream-options-alone", "chat", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("ignore-eos-string", "chat", {"ignore_eos": "yes"}, 400, "ignore_eos"),
    ("unknown-model", "chat", {"model": "gpt-4"}, 404, "model"),
    ("completion-logprobs-21", "completions", {"logprobs": 21}, 400, "logprobs"),
    ("best-of-2", "completions", {"best_of": 2}, 400, "best_of"),
    ("echo", "completions", {"echo": True}, 400, "echo"),
    ("suffix", "completions", {"suffix": "x"}, 400, "suffix"),
    ("two-prompts", "completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("empty-prompt", "completions", {"prompt": ""}, 400, "prompt"),
    ("negative-token", "completions", {"prompt": [1, -1]}, 400, "prompt"),
    ("token-past-vocab", "completions", {"prompt": [1, 100000]}, 400, "prompt"),
    ("prompt-too-long", "completions", {"prompt": [65] * 600}, 400, "prompt"),
    ("stop-token-past-vocab", "completions", {"stop_token_ids": [999]}, 400, "stop_token_ids"),
]


def test_malformed_requests_get_4xx_naming_the_field_and_the_server_goes_on(warm_server, served_reference):
    server, reference = warm_server, served_reference
    rejected = server.metric("request_rejected_total")
    for case, endpoint, change, status, param in MALFORMED:
        if isinstance(change, bytes):
            body = change
        else:
            body = {**(CHAT if endpoint == "chat" else COMPLETION), **change}
            body = {k: v for k, v in body.items() if v is not None}
        got, headers, answer = server.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions", body)
        assert got == status, (case, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], case
        assert error["param"] == param, (case, error)
        assert error["type"] == "invalid_request_error" and headers["content-type"] == "application/json", case
    assert server.metric("request_rejected_total") - rejected == len(MALFORMED)
    assert server.post("/v1/nowhere", CHAT)[0] == 404 and server.get("/v1/chat/completions")[0] == 405
    # the body limit: a declared length past it, and a chunked body without one
    big = json.dumps({**COMPLETION, "prompt": "x" * 70000}).encode()
    assert server.post("/v1/completions", big)[0] == 413
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", iter([big[:40000], big[40000:]]),
                 {"Content-Type": "application/json"}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    conn.close()
    # the engine's thread survived every one: it still serves exact answers
    assert server.engine._thread.is_alive()
    answer = ask(server.client(), "tiny", "chat", PROMPTS[5], False, max_tokens=24, temperature=0)
    assert answer["text"] == expected(reference, server.tokenizer, chat_ids(server.tokenizer, PROMPTS[5]), 24).text


def test_models_health_and_metrics(warm_server):
    server = warm_server
    assert [m.id for m in server.client().models.list()] == ["tiny"]
    status, _, card = server.get("/v1/models/tiny")
    assert status == 200 and card["max_model_len"] == 512
    assert server.get("/v1/models/other")[0] == 404
    status, _, health = server.get("/health")
    assert status == 200 and health == {"status": "ok"}
    ask(server.client(), "tiny", "completions", "metrics", False, max_tokens=12, temperature=0)
    page = server.get("/metrics")[2]
    for name in ("num_requests_running", "num_requests_waiting", "request_success_total", "prompt_tokens_total",
                 "generation_tokens_total", "prompt_tokens_cached_total", "request_forward_passes_total",
                 "engine_steps_total", "spec_decode_num_accepted_tokens_per_pos_total", "step_tokens_bucket",
                 "batch_size_bucket", "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "iteration_tokens_total_bucket"):
        assert f"lookahead:{name}" in page, name
    assert server.metric("generation_tokens_total") >= 12 and server.metric("engine_steps_total") > 0
    assert server.metric("spec_decode_num_accepted_tokens_per_pos_total", position=0) > 0
