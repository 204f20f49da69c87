"""Test helpers for the server: a real uvicorn server on 127.0.0.1 and a free port, on a thread of the test process
(so tests can look at its engine), raw HTTP for what the openai client will not send, the metrics page read back,
and each answer's reference (`Llama.generate` alone)."""

from __future__ import annotations

import http.client
import json
import queue
import re
import subprocess
import threading
import time
from dataclasses import dataclass

from helpers import flat_cost
from lookahead.models import Llama, engine_for
from lookahead.serve import Server, create_app

TIMEOUT = 60  # seconds any one request, or any wait for the server, may take


class Running:
    """`create_app` over `engine_for(Llama.from_pretrained(folder))`, served on a thread: `url`, `engine`,
    `tokenizer`, `client()`; `stop()` ends it. cost: the engine's cost model (default: every step size costs the
    same, so multi-token steps happen whatever the machine's load)."""

    def __init__(self, folder, name: str = "tiny", *, lookahead="auto", cost=None, api_key: str | None = None,
                 max_body_bytes: int = 1 << 16, sampling_defaults: dict | None = None,
                 allowed_origins: list[str] | None = None, server_options: dict | None = None,
                 **engine_options) -> None:
        from transformers import AutoTokenizer

        self.name = name
        model = Llama.from_pretrained(folder)
        model.cost_model = flat_cost()  # a cost model of the user's: used as it is, never measured
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.engine = engine_for(model, lookahead=lookahead, **engine_options)
        if cost is not None:
            self.engine.cost = cost
        self.app = create_app(self.engine, self.tokenizer, name, api_key=api_key,
                              eos_token_ids=model.config.eos_token_id, vocab_size=model.config.vocab_size,
                              max_body_bytes=max_body_bytes, sampling_defaults=sampling_defaults,
                              allowed_origins=allowed_origins)
        self.server = Server(self.app, "127.0.0.1", 0, log_level="warning", **(server_options or {})).start(TIMEOUT)
        self.url, self.port = self.server.url, self.server.port

    def client(self, api_key: str = "none"):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT)

    def stop(self) -> None:
        self.server.stop(TIMEOUT)
        assert not self.server._thread.is_alive(), "the server did not stop"

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        """POST raw bytes (or a JSON-able body): (status, headers, the JSON answer)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return request(self.port, "POST", path, data, {"Content-Type": "application/json", **(headers or {})})

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, dict | str]:
        return request(self.port, "GET", path, None, headers or {})

    def metric(self, name: str, **labels) -> float:
        """A sample of /metrics: `lookahead:<name>` with these labels (summed over the others); 0 if absent."""
        return metric(self.get("/metrics")[2], name, **labels)

    def wait_for(self, condition, what: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)


class ServeProcess:
    """`lookahead serve` as a subprocess (`command`: its command line up to its options), on a port of its own choosing:
    started with --port 0, its port is the one its "serving NAME (...) on http://127.0.0.1:PORT/v1" line names. A port
    a test picks and frees for the server could be taken by another test's server meanwhile (tests run two at once),
    whose answers would then be taken for this one's. `said`: its standard error up to that line; `name`: the model
    name it serves under; `stop()` kills it if it still runs."""

    def __init__(self, command: list[str], env: dict, timeout: float = 180) -> None:
        self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", "0"], env=env,
                                        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stderr], daemon=True).start()
        self.said: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                assert self.process.poll() is None and time.monotonic() < deadline, "".join(self.said)
                try:
                    self.said.append(self.lines.get(timeout=1))
                except queue.Empty:
                    continue
                found = re.search(r"serving (\S+) .* on http://127\.0\.0\.1:(\d+)/v1", self.said[-1])
                if found:
                    self.name, self.port = found[1], int(found[2])
                    return
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def request(port: int, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request(method, path, body, headers)
        response = conn.getresponse()
        raw = response.read().decode("utf-8", "replace")
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw
        return response.status, {k.lower(): v for k, v in response.getheaders()}, payload
    finally:
        conn.close()


def open_stream(port: int, path: str, body: dict, headers: dict | None = None):
    """Start a streaming POST; returns (connection, response) to read `data:` lines from."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return conn, response


def read_event(response) -> str | None:
    """The next server-sent event's data (None at the end of the stream)."""
    while True:
        line = response.fp.readline()
        if not line:
            return None
        line = line.decode().strip()
        if line.startswith("data: "):
            return line[len("data: "):]


def metric(page: str, name: str, **labels) -> float:
    total = 0.0
    for line in page.splitlines():
        match = re.fullmatch(rf"lookahead:{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match[1] or ""))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            total += float(match[2])
    return total


@dataclass
class Expected:
    text: str
    tokens: list[int]
    finish_reason: str


def expected(reference, tokenizer, prompt: list[int], max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: str | None = None,
             eos=None) -> Expected:
    """What `Llama.generate` gives for the request alone, decoded as a user decodes it (the text cut before `stop`,
    the tokens up to the one that completed it)."""
    result = reference.generate(prompt, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, eos_token_id=eos)
    tokens = list(result.tokens)
    eos_ids = reference.config.eos_token_id if eos is None else eos
    finish = "stop" if tokens and tokens[-1] in eos_ids else "length"
    if stop is not None:
        for k in range(1, len(tokens) + 1):
            if stop in tokenizer.decode(tokens[:k], skip_special_tokens=True):
                tokens, finish = tokens[:k], "stop"
                break
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if stop is not None and stop in text:
        text = text[: text.index(stop)]
    return Expected(text, tokens, finish)


PROMPTS = ["Tell me a story about a cat.", "hello world, how are you?", "¿Qué tal? ünïcödé ✓ 日本",
           "List three colors:", "1, 2, 3, 4,", "The quick brown fox", "a b a b a b", "Why is the sky blue?"]

def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def ask(client, model: str, endpoint: str, prompt: str, stream: bool, **options) -> dict:
    """One request with the openai client: the text, usage and finish reason (a stream's chunks concatenated)."""
    if endpoint == "chat":
        call = client.chat.completions.create
        kwargs = dict(messages=[{"role": "user", "content": prompt}])
    else:
        call = client.completions.create
        kwargs = dict(prompt=prompt)
    if not stream:
        answer = call(model=model, **kwargs, **options)
        choice = answer.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        return dict(text=text, usage=answer.usage, finish_reason=choice.finish_reason, chunks=1)
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in call(model=model, **kwargs, **options, stream=True, stream_options={"include_usage": True}):
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append((choice.delta.content if endpoint == "chat" else choice.text) or "")
            finish = choice.finish_reason or finish
    return dict(text="".join(pieces), usage=usage, finish_reason=finish, chunks=chunks)


def prompt_ids(tokenizer, endpoint: str, prompt: str) -> list[int]:
    return chat_ids(tokenizer, prompt) if endpoint == "chat" else tokenizer(prompt)["input_ids"]


def tool_answer(client, stream: bool, **options) -> tuple[str | None, list, str]:
    """A chat completion with tools, streamed or not: (its text, its tool calls, its finish reason)."""
    if stream:
        chunks = list(client.chat.completions.create(**options, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        return content, calls, chunks[-1].choices[0].finish_reason
    choice = client.chat.completions.create(**options).choices[0]
    return choice.message.content, choice.message.tool_calls or [], choice.finish_reason


def streamed_plain_answer(client, **options) -> tuple[str, list[str]]:
    """A plain (text) answer with tools present, found by trying seeds 0-19 at temperature 1 until the model answers
    in text (4 characters at least), then the same request streamed: (the whole answer's text, the stream's text
    pieces). Fails the test where every seed called a tool."""
    import pytest

    for seed in range(20):
        whole = client.chat.completions.create(**options, temperature=1, seed=seed).choices[0]
        if whole.message.tool_calls is None and len(whole.message.content) >= 4:
            break
    else:
        pytest.fail("the tiny model called the tool for 20 seeds: no plain answer to stream")
    chunks = list(client.chat.completions.create(**options, temperature=1, seed=seed, stream=True))
    return whole.message.content, [c.choices[0].delta.content for c in chunks
                                   if c.choices and c.choices[0].delta.content]
