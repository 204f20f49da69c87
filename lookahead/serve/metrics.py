"""The server's Prometheus metrics, on a registry of their own (not prometheus-client's global one), named as vLLM
names its own (`lookahead:` for `vllm:`), so dashboards made for vLLM read them.

Three sources feed them: the engine's `on_step` hook (every packed step, on the engine's thread: rows, tokens, time),
each request's end (its `GenerationResult`: tokens, cached prompt tokens, forward passes, the tokens each step gave)
and its first token (time to first token), and the HTTP layer's refusals. Gauges of the running and waiting requests
are read from the engine when scraped. The table of names is in docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lookahead.loop import Engine, GenerationResult, RowStep

PREFIX = "lookahead:"
LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0)  # vLLM's buckets for time to first token
TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0)
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0)
STEP_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 256, 512)
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The metrics of one served model; `render()` is the /metrics page."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name, doc, extra=()):
            metric = Counter(PREFIX + name, doc, ["model_name", *extra], registry=registry)
            return metric if extra else metric.labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=registry).labels(**labels)

        def gauge(name, doc, read):
            Gauge(PREFIX + name, doc, ["model_name"], registry=registry).labels(**labels).set_function(read)

        self._labels = labels
        gauge("num_requests_running", "Requests with a row in the engine (prefilling or decoding).",
              lambda: len(engine.active))
        gauge("num_requests_waiting", "Requests waiting for a row.", lambda: engine.queued)
        self.finished = counter("request_success", "Finished requests, by finish reason (stop, length, cancelled, "
                                "error).", ["finished_reason"])
        self.rejected = counter("request_rejected", "Requests refused before the engine (by HTTP status).",
                                ["status"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("prompt_tokens_cached", "Prompt tokens taken from cached KV entries "
                                     "(prefix cache hits), not prefilled.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.forward_passes = counter("request_forward_passes", "Forward passes of finished requests, each "
                                      "request's own (its prefill counts one): generation_tokens / this = S.")
        self.engine_steps = counter("engine_steps", "Packed steps the engine ran (one forward pass for all rows).")
        self.drafts = counter("spec_decode_num_drafts", "Decoding row steps that verified drafts (fed more than "
                              "one token).")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                                        "position of the accepted path (0: the first draft token).", ["position"])
        self.step_tokens = histogram("step_tokens", "Tokens fed per decoding row step (1: a plain step).",
                                     STEP_TOKENS)
        self.batch_size = histogram("batch_size", "Rows per packed step (decoding rows and prefill chunks).", ROWS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per packed step, all rows.",
                                          ITERATION_TOKENS)
        self.step_seconds = histogram("step_duration_seconds", "Time of one packed step.", TOKEN_LATENCY)
        self.ttft = histogram("time_to_first_token_seconds", "From a request's arrival to its first token.", LATENCY)
        self.tpot = histogram("time_per_output_token_seconds", "A request's mean time per output token after the "
                              "first.", TOKEN_LATENCY)
        self.latency = histogram("e2e_request_latency_seconds", "From a request's arrival to its end.",
                                 REQUEST_LATENCY)

    def on_step(self, steps: Sequence[RowStep], seconds: float) -> None:
        """The engine's hook: one packed step ran (on the engine's thread)."""
        self.engine_steps.inc()
        self.batch_size.observe(len(steps))
        self.iteration_tokens.observe(sum(len(s.tokens) for s in steps))
        self.step_seconds.observe(seconds)
        for step in steps:
            if not step.prefill:
                self.step_tokens.observe(len(step.tokens))

    def request_finished(self, result: GenerationResult, prompt_tokens: int, reason: str, seconds: float,
                         first_token_s: float | None) -> None:
        """A request ended. Accepted draft tokens per position come from the tokens each of its decoding steps gave
        (`step_tokens`, the prefill's first token aside): a step that gave k tokens accepted k - 1 draft tokens, the
        last being the model's own next token (a last step cut by a stop or the token limit counts what it kept)."""
        self.finished.labels(**self._labels, finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.generation_tokens.inc(len(result.tokens))
        self.forward_passes.inc(result.steps)
        self.latency.observe(seconds)
        for size in result.step_sizes:
            if size > 1:
                self.drafts.inc()
        for taken in result.step_tokens[1:]:
            for position in range(len(taken) - 1):
                self.accepted_per_pos.labels(**self._labels, position=str(position)).inc()
            if len(taken) > 1:
                self.accepted.inc(len(taken) - 1)
        if first_token_s is not None and len(result.tokens) > 1:
            self.tpot.observe((seconds - first_token_s) / (len(result.tokens) - 1))

    def reject(self, status: int) -> None:
        """A request refused before it reached the engine (400, 401, 404, 413, 503, ...)."""
        self.rejected.labels(**self._labels, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
