"""Structured outputs (issue 39): constrained lookahead gives what constrained plain decoding gives, token for token
(greedy and seeded sampling, random step sizes); the grammar's forced tokens are drafted and save steps; every JSON
answer of the server parses and follows its schema, through the openai client and LangChain; tool calls round trip;
malformed schemas and tools get 400s naming the field."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers import fixed
from lookahead import Request, SamplingParams
from lookahead.drafts import ROOT, BestFirst
from lookahead.loop.grammar import allowed, constrain_draft

ROOT_DIR = Path(__file__).resolve().parents[1]
CASES = json.loads((ROOT_DIR / "bench" / "data" / "structured.json").read_text(encoding="utf-8"))["prompts"]
# a schema a tiny random model completes within a few dozen tokens: short strings, enums, small integers
SHORT = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4},
    "mood": {"type": "string", "enum": ["happy", "sad", "neutral"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["name", "mood", "count", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 6},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
# for the tiny model (512 positions of single bytes): a short tool
TOOL = {"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 2}}, "required": ["c"]}}}


def follows(value, schema: dict) -> bool:
    """Whether `value` is valid under `schema` (the subset of JSON schema these tests use)."""
    if "anyOf" in schema:
        return any(follows(value, s) for s in schema["anyOf"])
    if "const" in schema:
        return value == schema["const"]
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
                and all(follows(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
                and all(follows(v, schema.get("items", {})) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -(1 << 62)) <= value <= schema.get("maximum", 1 << 62))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


# ----- the loop, on the tiny model -----

@pytest.fixture(scope="module")
def tiny(served_dir):
    from transformers import AutoTokenizer

    from lookahead.models import Llama, engine_for
    from lookahead.structured import Grammars

    model = Llama.from_pretrained(served_dir)
    tokenizer = AutoTokenizer.from_pretrained(served_dir)
    engine = engine_for(model, lookahead=fixed(5, 4, 5), max_batch=2, warm=False)
    engine.cost = None  # full-size steps: the configurations below set the sizes
    return engine, tokenizer, Grammars(tokenizer, model.config.vocab_size, model.config.eos_token_id), model


def run(engine, prompt, grammar, lookahead, seed=None, limit=48, eos=(257,)):
    sampling = SamplingParams(0.0) if seed is None else SamplingParams(0.9, top_k=50)
    handle = engine.submit(Request([prompt], limit, sampling, lookahead, frozenset(eos), seed), grammar=grammar)
    while engine.step():
        pass
    return handle.result()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_constrained_lookahead_is_constrained_plain_decoding(tiny, seeded):
    """10 schema prompts, each at random step sizes (W, N, G), with and without forced drafts: the tokens are plain
    constrained decoding's. Negative control: unconstrained decoding of the same prompts leaves the grammar."""
    engine, tokenizer, grammars, _ = tiny
    rng = random.Random(39 + seeded)
    left = 0
    for i, case in enumerate(CASES):
        prompt = tokenizer(case["prompt"])["input_ids"]
        seed = 1000 + i if seeded else None
        plain = run(engine, prompt, grammars.json_schema(case["schema"]), None, seed)
        for forced in (False, True):
            cfg = fixed(rng.randint(1, 5), rng.randint(2, 4), rng.randint(0, 5))
            got = run(engine, prompt, grammars.json_schema(case["schema"], forced_drafts=forced), cfg, seed)
            assert got.tokens == plain.tokens, (case["name"], cfg, forced)
        free = run(engine, prompt, None, None, seed)
        left += grammars.json_schema(case["schema"]).valid(free.tokens) < len(free.tokens)
    assert left >= 8  # unconstrained, the random model leaves the grammar: the mask is what keeps it in


def test_forced_drafts_save_steps(tiny):
    """Schema boilerplate costs no steps of its own: a random model accepts almost nothing but forced tokens."""
    engine, tokenizer, grammars, _ = tiny
    steps = {True: 0, False: 0}
    for case in CASES[:4]:
        prompt = tokenizer(case["prompt"])["input_ids"]
        for forced in steps:
            steps[forced] += run(engine, prompt, grammars.json_schema(SHORT, forced_drafts=forced), fixed(2, 3, 2),
                                 limit=40).steps
    assert steps[True] * 2 < steps[False], steps


def test_drafts_the_grammar_rejects_are_cut():
    class Grammar:  # allows only the tokens 1, 2, 3 (in any order), forces nothing
        seconds = 0.0

        def valid(self, tokens):
            return next((i for i, t in enumerate(tokens) if t not in (1, 2, 3)), len(tokens))

        def forced(self):
            return [1, 2]

    draft = BestFirst([1, 9, 2, 3, 7, 5], [ROOT, ROOT, 0, 2, 2, 4], [0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    cut = constrain_draft(draft, Grammar(), budget=8)
    # the forced chain 1 -> 2 first (the draft's 1 -> 2 merged into it), then 3 under 2; 9, 7 and 5 (under 7) cut
    assert (cut.tokens, cut.parents) == ([1, 2, 3], [ROOT, 0, 1])
    assert cut.scores == [1.0, 1.0, 0.6]
    assert len(constrain_draft(draft, Grammar(), budget=2)) == 2


# ----- the server -----

@pytest.fixture(scope="module")
def server(served_dir):
    from served import Running

    running = Running(served_dir, max_batch=2, max_queue=8)
    yield running
    running.stop()


def test_json_schema_and_json_object_answers_parse_and_follow_the_schema(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SHORT}}
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Hi {seed}"}],
                                                response_format=fmt, max_tokens=120, seed=seed)
        assert answer.choices[0].finish_reason == "stop"
        assert follows(json.loads(answer.choices[0].message.content), SHORT)
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], response_format=fmt, max_tokens=120, seed=1,
        stream=True) if chunk.choices]
    assert follows(json.loads("".join(pieces)), SHORT)
    text = client.completions.create(model="tiny", prompt="{", max_tokens=70, temperature=0,
                                     extra_body={"response_format": fmt})
    assert follows(json.loads(text.choices[0].text), SHORT)
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    text = answer.choices[0].message.content
    assert text.startswith("{") and (answer.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def test_tool_calls_round_trip_with_the_openai_client(server):
    client = server.client()
    messages = [{"role": "user", "content": "Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "w"}}):
        answer = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], tool_choice=choice,
                                                parallel_tool_calls=False, max_tokens=70, temperature=0)
        (call,) = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and answer.choices[0].message.content is None
        assert call.id.startswith("call_") and call.function.name == "w"
        assert follows(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL],
                                                 tool_choice="required", max_tokens=70, temperature=0, stream=True,
                                                 parallel_tool_calls=False))
    streamed = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or ()]
    assert [c.function.name for c in streamed] == ["w"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert streamed[0].function.arguments == call.function.arguments  # greedy: the same call, streamed
    # the round trip: the call, the tool's answer, and a final answer (tool_choice none: free text)
    messages += [answer.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], max_tokens=90,
                                          temperature=0)
    message = auto.choices[0].message
    assert (message.tool_calls is None) != (message.content is None) or auto.choices[0].finish_reason == "length"


def test_langchain_bind_tools_and_with_structured_output(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="none", temperature=0, max_tokens=120,
                     max_retries=0, timeout=60)

    class Thing(BaseModel):
        mood: str = Field(json_schema_extra={"enum": ["happy", "sad"]})
        count: int = Field(ge=0, le=9)

    thing = llm.with_structured_output(Thing).invoke("Describe a thing.")
    assert isinstance(thing, Thing) and thing.mood in ("happy", "sad")
    bound = llm.bind_tools([TOOL], tool_choice="w")
    messages = [HumanMessage("Paris?")]
    reply = bound.invoke(messages)
    (call,) = reply.tool_calls
    assert call["name"] == "w" and follows(call["args"], TOOL["function"]["parameters"])
    messages += [reply, ToolMessage("18 degrees", tool_call_id=call["id"])]
    final = llm.bind_tools([TOOL], tool_choice="none").invoke(messages)
    assert isinstance(final.content, str) and not final.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(("}}}}, "response_format"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_schemas_and_tools_get_400_naming_the_field(server, body, param):
    status, _, answer = server.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    if param in ("response_format", "tools") and "type" in json.dumps(body):
        assert "compile" in answer["error"]["message"] or param == "response_format"


SELF = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}  # {"a": {"a": ...
# either of two objects, each of which must hold itself: the first mask is fine ({"), the model's key ("a" or "b")
# then leads the grammar into its error state whatever the model chooses
LOOPS = {"$defs": {name: {"type": "object", "properties": {name: {"$ref": f"#/$defs/{name}"}}, "required": [name],
                          "additionalProperties": False} for name in "ab"},
         "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("schema", [{"$ref": "#"}, SELF], ids=["root", "property"])
def test_an_unsatisfiable_schema_is_a_400_when_compiled(server, schema):
    """(It was a 200 with an empty answer, finish_reason "stop": llguidance's matcher fails at its first mask.)"""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    status, _, answer = server.post("/v1/chat/completions", {**chat, "response_format": schema_format(schema)})
    assert status == 400 and answer["error"]["param"] == "response_format", answer
    assert "unsatisfiable schema" in answer["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": SELF}}
    status, _, answer = server.post("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"})
    assert status == 400 and answer["error"]["param"] == "tools" and "unsatisfiable" in answer["error"]["message"]


def test_a_grammar_that_fails_while_decoding_ends_its_row_with_an_error(tiny, server):
    from served import open_stream, read_event

    _, tokenizer, grammars, _ = tiny
    grammar = grammars.json_schema({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}})
    for token in tokenizer('{"a": ')["input_ids"]:
        assert grammar.error is None
        grammar.mask()
        grammar.accept(token)
    assert allowed(grammar.mask(), 260).nonzero().flatten().tolist() == [257]  # only EOS: the row ends
    assert "failed after 6 tokens" in grammar.error
    # the server: an error that names the schema, not a 200 with "stop"; streamed, an error event; the engine goes on
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
            "response_format": schema_format(LOOPS)}
    status, _, answer = server.post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["code"] == "unsatisfiable_schema", answer
    assert "cannot be followed" in answer["error"]["message"] and answer["error"]["param"] == "response_format"
    conn, response = open_stream(server.port, "/v1/chat/completions", {**body, "stream": True})
    events = []
    while (event := read_event(response)) is not None:
        events.append(event)
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "unsatisfiable_schema", events
    answer = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     response_format=schema_format(SHORT), max_tokens=120, seed=1)
    assert follows(json.loads(answer.choices[0].message.content), SHORT)


def test_tools_on_completions_get_400(server):
    status, _, answer = server.post("/v1/completions", {"model": "tiny", "prompt": "hi", "tools": [TOOL]})
    assert status == 400 and answer["error"]["param"] == "tools"


# ----- the default model -----

@pytest.mark.slow
def test_default_model_answers_a_schema_and_calls_a_tool(default_model_dir):
    from served import Running

    running = Running(default_model_dir, "smol", max_batch=2, max_queue=4)
    try:
        client = running.client()
        case = CASES[0]
        answer = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": case["prompt"]}], temperature=0, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": case["schema"]}})
        person = json.loads(answer.choices[0].message.content)
        assert follows(person, case["schema"]) and person["age"] == 34, person
        assert answer.usage.lookahead["compression"] > 1.5  # forced tokens drafted: several tokens a step
        answer = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is the weather in Tokyo, in celsius?"}],
            tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
        (call,) = answer.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["unit"] == "celsius"
    finally:
        running.stop()
