"""The FastAPI app: its routes, the API key, the body's size limit, the engine's life.

`create_app` takes an `Engine` over a model (`lookahead.models.engine_for`) and the model's tokenizer and returns the
app; the app starts the engine's thread when it starts and stops it (cancelling what is left) when it stops. The
routes only translate (`completions.py` for the two generating endpoints): no handler touches the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from lookahead.loop import Engine
from lookahead.request import SamplingParams
from lookahead.structured import Grammars

from .completions import chat, complete
from .errors import APIError, bad_request, client_closed, install, overloaded
from .fields import short
from .metrics import CONTENT_TYPE, Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, FieldError
from .text import TokenText

log = logging.getLogger("lookahead.serve")

MAX_BODY_BYTES = 4 * 1024 * 1024  # a request body's default limit (413 beyond)
MAX_JSON_DEPTH = 200  # levels of nesting a JSON body may have: pydantic-core's parser's recursion limit
# what a browser client may send (CORS): the openai JS SDK adds its x-stainless-* headers (os, arch, runtime, retry
# count, timeout, ...), more with each release, so any header is allowed, as vLLM allows them by default
CORS_HEADERS = ["*"]
STOP_TIMEOUT_S = 10.0  # how long the app waits for the engine's thread to end when it stops


@dataclass
class Served:
    """What the handlers need: the engine, the tokenizers (one for prompts, used on a thread of its own (`tokenize`),
    a copy for the engine's thread and one for the loop's logprobs: a fast tokenizer must not be used by two threads at
    once), the model's name and limits, the stop tokens every request gets, the metrics. (What every request decodes
    with, lookahead or plain, is the engine's: `engine.lookahead`, the configuration it was sized for.)"""

    engine: Engine
    tokenizer: object
    model_name: str
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_positions: int | None
    api_key: str | None
    max_body_bytes: int
    metrics: Metrics
    sampling_defaults: dict
    engine_tokenizer: object = field(init=False)
    token_text: TokenText = field(init=False)
    longest_token: int = field(init=False)  # characters of the vocabulary's longest token: a prompt's at most per token
    created: int = field(default_factory=lambda: int(time.time()))
    serving: bool = False
    ignored: set[str] = field(default_factory=set)  # ignored request fields logged so far (each is logged once)
    grammars: Grammars | None = None  # compiles structured outputs' grammars (made at the first such request)

    def __post_init__(self) -> None:
        self.engine_tokenizer = copy.deepcopy(self.tokenizer)  # fast tokenizers must not be shared between threads
        self.token_text = TokenText(copy.deepcopy(self.tokenizer))
        self.longest_token = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        # prompts are tokenized and templated here, one at a time, never on the event loop: a 4 MB prompt takes
        # seconds, and every stream would stop meanwhile
        self._prompts = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lookahead-prompts")
        # grammars are compiled on a thread of their own, with a tokenizer of their own: the first reads the whole
        # vocabulary (seconds), which must not hold up the prompts of plain requests behind it
        self._grammars = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lookahead-grammars")
        self._grammar_tokenizer = copy.deepcopy(self.tokenizer)

    async def tokenize(self, function, *args):
        """`function(self.tokenizer, *args)` on the prompts' thread."""
        return await asyncio.get_running_loop().run_in_executor(self._prompts, function, self.tokenizer, *args)

    async def grammar(self, schema: dict | str):
        """A fresh grammar of the JSON valid under `schema` (or of a Lark grammar's text), for one request, compiled
        (and its first mask probed) on the grammars' thread, off the engine's and the prompts' (the first one reads
        the tokenizer's vocabulary for the grammar engine, a few seconds). Raises GrammarError."""
        return await asyncio.get_running_loop().run_in_executor(self._grammars, self._compile, schema)

    def _compile(self, schema: dict | str):
        if self.grammars is None:
            self.grammars = Grammars(self._grammar_tokenizer, self.vocab_size, self.eos_token_ids)
        return self.grammars.lark(schema) if isinstance(schema, str) else self.grammars.json_schema(schema)

    def close(self) -> None:
        self._prompts.shutdown(wait=False, cancel_futures=True)
        self._grammars.shutdown(wait=False, cancel_futures=True)

    def refuse_new(self) -> None:
        """Refuse new requests from now on (503 "shutting down"), the moment a signal arrives: uvicorn accepts
        connections until its shutdown begins, and a request let in then would be cut at once."""
        self.serving = False

    def begin_shutdown(self) -> None:
        """Stop serving: refuse new requests and cancel every one in flight (each ends at the next step boundary;
        streams get their last chunk). The engine's thread is joined when the app stops."""
        self.serving = False
        self.engine.stop(0)


def create_app(engine: Engine, tokenizer, model_name: str, *, api_key: str | None = None,
               eos_token_ids=None, vocab_size: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, sampling_defaults: dict | None = None,
               allowed_origins: list[str] | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine` (not started: the app starts and stops it).

    tokenizer: the model's (a transformers tokenizer with its chat template). model_name: the `model` requests name
    (others get 404). api_key: required as `Authorization: Bearer KEY` on /v1/*, /openapi.json and /docs when set
    (/health and /metrics stay open; an unknown route under it is a 401 before a 404). Every request decodes with the
    engine's configuration (`engine.lookahead`, what `engine_for` sized it for; None: plain decoding). eos_token_ids:
    the tokens that end an answer (default: the tokenizer's EOS; the server passes the model config's, as
    `Llama.generate` does). vocab_size: token ids a prompt may hold (default: the engine's, else the tokenizer's
    length). max_body_bytes: a larger request body gets 413. sampling_defaults: the temperature, top_p and top_k a
    request that leaves them unset gets (`sampling_defaults(folder)`: the model's generation_config.json's; None:
    OpenAI's, temperature 1 and top_p 1). allowed_origins: the browser origins allowed to call it (CORS; None: none,
    ["*"]: any).
    """
    eos = tokenizer.eos_token_id if eos_token_ids is None else eos_token_ids
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty; give a key or None")
    vocab_size = vocab_size or engine.vocab_size or len(tokenizer)  # the model's when the engine knows it
    sampling_defaults = dict(sampling_defaults or {})
    unknown = sorted(set(sampling_defaults) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ValueError(f"sampling_defaults may set {', '.join(SAMPLING_DEFAULTS)}; got {', '.join(unknown)}")
    SamplingParams(**sampling_defaults)  # checked now, not at the first request
    served = Served(engine, tokenizer, model_name, eos, vocab_size,
                    engine.max_positions, api_key, max_body_bytes, Metrics(engine, model_name), sampling_defaults)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        previous = engine.on_step
        engine.on_step = served.metrics.on_step if previous is None else _both(previous, served.metrics.on_step)
        engine.start()
        served.serving = True
        try:
            yield
        finally:
            served.serving = False
            served.close()
            await asyncio.to_thread(engine.stop, STOP_TIMEOUT_S)

    app = FastAPI(title="lookahead", summary="OpenAI-compatible serving with exact lookahead decoding",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)  # ours, behind the key
    app.state.served = served
    install(app, served.metrics.reject, lambda request: _check_key(served, request) if _keyed(request) else None)
    app.include_router(_routes(served))
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=CORS_HEADERS)
    return app


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")  # what a model's generation_config sets for the server


def sampling_defaults(folder: str | Path) -> dict:
    """The temperature, top_p and top_k a checkpoint folder's generation_config.json sets (those it sets), which a
    request that leaves them unset gets, as vLLM serves them by default; {} without the file."""
    path = Path(folder) / "generation_config.json"  # (a GGUF file has none: {})
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None
    return {name: config[name] for name in SAMPLING_DEFAULTS if config.get(name) is not None}


def _routes(served: Served) -> APIRouter:
    router = APIRouter()
    keyed = [Depends(_authorizer(served))]
    v1 = APIRouter(prefix="/v1", dependencies=keyed)

    @router.get("/health")
    @router.head("/health", include_in_schema=False)  # load balancers' probes
    async def health() -> JSONResponse:
        if not served.serving:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(served)]}

    @v1.get("/models/{model:path}")
    async def model(model: str) -> dict:
        _check_model(served, model)
        return _model_card(served)

    @v1.post("/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await chat(served, request, await _parse(request, served, ChatCompletionRequest))

    @v1.post("/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await complete(served, request, await _parse(request, served, CompletionRequest))

    @v1.api_route("/responses", methods=["GET", "POST"], include_in_schema=False)
    @v1.api_route("/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def responses() -> Response:
        raise APIError(404, "the Responses API (/v1/responses) is not served here: send the conversation as messages "
                       "to POST /v1/chat/completions (the Chat Completions API), which every OpenAI client and agent "
                       "SDK can use", code="not_found")

    router.include_router(v1)

    @router.get("/openapi.json", dependencies=keyed, include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(_openapi(request.app))

    @router.get("/docs", dependencies=keyed, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="lookahead")

    return router


BODIES = (ChatCompletionRequest, CompletionRequest)  # the request bodies the schema declares (parsed by hand)


def _body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that reads its body itself (within the size limit, before pydantic)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict:
    """The app's OpenAPI schema, with the request bodies' models among its components (made once)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in BODIES:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


def _authorizer(served: Served):
    async def authorize(request: Request) -> None:
        _check_key(served, request)

    return authorize


KEYED_PAGES = ("/openapi.json", "/docs")  # beside /v1/*: what the API key guards


def _keyed(request: Request) -> bool:
    """Whether the API key guards the request's path (whatever its method: a HEAD, an unknown route under /v1)."""
    path = request.url.path
    return path == "/v1" or path.startswith("/v1/") or path in KEYED_PAGES


def _check_key(served: Served, request: Request) -> None:
    """401 unless the request carries the API key (when one is set)."""
    if served.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), served.api_key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'",
                       code="invalid_api_key")  # (compared in constant time)


async def _parse(request: Request, served: Served, model: type[BaseModel]):
    """The body, read within the size limit and validated: 413 past the limit, 400 naming the field, 404 for
    another model."""
    if not served.serving:
        raise overloaded("the server is shutting down")
    raw = await _read_body(request, served.max_body_bytes)
    if not served.serving:  # (a signal arrived while the body did)
        raise overloaded("the server is shutting down")
    try:
        body = model.model_validate_json(raw)
    except FieldError as e:
        raise bad_request(e.message, e.param) from None
    except ValidationError as e:
        raise _validation_error(e, raw) from None
    _check_model(served, body.model)
    for name in body.ignored:
        if name not in served.ignored:
            served.ignored.add(name)
            log.info("ignoring the request field %r (it cannot change the answer); logged once", name)
    return body


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request(f"Content-Length is not a number: {length[:40]!r}")
        if int(length) > limit:
            raise APIError(413, f"the request body ({length} bytes) is larger than the server's limit of {limit} "
                           "bytes", code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():  # a body sent in chunks, without a length, is held to the limit too
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                               code="request_too_large")
    except ClientDisconnect:  # the client gave up while sending: its mistake or its choice, not the server's failure
        raise client_closed("the client disconnected before sending the whole body") from None
    return bytes(body)


def _validation_error(error: ValidationError, raw: bytes) -> APIError:
    """pydantic's first complaint as OpenAI's error, naming the field as a path (messages[0].role)."""
    first = error.errors(include_url=False)[0]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".") or None
    kind, message = first["type"], first["msg"].removeprefix("Value error, ")
    if kind == "json_invalid" and "recursion limit" in message:  # valid JSON, maybe: deeper than the parser goes
        return bad_request(f"the body is nested too deeply: JSON of at most {MAX_JSON_DEPTH} levels of nesting is "
                           "read (a JSON schema takes two levels per level of its own)", code="json_too_deep")
    if kind == "json_invalid":
        return bad_request(f"the body is not valid JSON ({message}); send a JSON object",
                           code="invalid_json" if raw.strip() else "empty_body")
    if kind == "model_type" and param is None:
        return bad_request(f"the body must be a JSON object, got {_json_kind(raw)}")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return bad_request(f"{param}: a required field is missing", param)
    got = first.get("input")
    suffix = "" if kind.startswith("value_error") or got is None else f", got {short(got)}"
    return bad_request(f"{param}: {message}{suffix}" if param else f"{message}{suffix}", param)


def _check_model(served: Served, name: str) -> None:
    if name != served.model_name:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{served.model_name}`",
                       param="model", code="model_not_found")


def _model_card(served: Served) -> dict:
    return {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "lookahead",
            "max_model_len": served.max_positions}


def _json_kind(raw: bytes) -> str:
    try:
        return type(json.loads(raw)).__name__
    except ValueError:
        return "something else"


def _both(first, second):
    def on_step(steps, seconds):
        first(steps, seconds)
        second(steps, seconds)

    return on_step
