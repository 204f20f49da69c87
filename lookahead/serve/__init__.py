"""`lookahead serve`'s HTTP layer: an OpenAI-compatible server over the engine (`lookahead.loop.Engine`).

It only translates: HTTP requests become engine submissions, the engine's deltas become responses and server-sent
events; the engine's thread alone runs the model. Every answer is what `Llama.generate` gives for its request alone
(greedy in float32; seeded sampling with its seed), whatever else is being served.

    from lookahead.models import Llama, engine_for
    from lookahead.serve import create_app, serve

    model = Llama.from_pretrained(folder)
    app = create_app(engine_for(model), tokenizer, "my-model")   # the app starts and stops the engine
    serve(app, "127.0.0.1", 8000)                                # until SIGTERM or SIGINT

Rooms: `protocol` (the request bodies, pydantic), `fields` (which fields it honours), `app` (routes, the API key, body
limits, the engine's life), `completions` (the two generating endpoints: prompts, responses, streams), `submission`
(one request in the engine), `text` (incremental detokenization and stop strings), `metrics` (Prometheus), `errors`
(OpenAI's error shape), `server` (uvicorn and the shutdown). docs/serving.md is the user's page.
"""

from __future__ import annotations

from .app import MAX_BODY_BYTES, create_app, sampling_defaults
from .server import Server, serve
from .text import TextStream

__all__ = ["MAX_BODY_BYTES", "Server", "TextStream", "create_app", "sampling_defaults", "serve"]
