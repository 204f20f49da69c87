"""Tool calls that end (issue 49, item 2): one call unless `parallel_tool_calls` is true, then a bounded list with an
identical call kept once; an answer cut by the token limit gives the calls complete before the cut, never the
server's JSON wrapper; a plain answer with tools present streams as it comes; a tool's result reaches a chat template
that has no tool role as a user message that says what it is; an answer that only repeats a call answered already
(SmolLM2 calls again after every result) is answered in text, so an agent loop ends."""

from __future__ import annotations

import pytest

from lookahead.serve.tools import (
    MAX_CALLS,
    AnswerReader,
    ToolMode,
    answered_calls,
    call_key,
    fold_tool_results,
    parse_answer,
)
from served import streamed_plain_answer, tool_answer

# for the tiny model (512 positions of single bytes): a short tool
TOOL = {"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 2}}, "required": ["c"]}}}
CHECKED = [{"name": "w", "description": None, "parameters": TOOL["function"]["parameters"]}]
ASK = [{"role": "user", "content": "Paris?"}]


@pytest.fixture(scope="module")
def server(served_dir):
    from served import Running

    running = Running(served_dir, max_batch=2, max_queue=8)
    yield running
    running.stop()


# ----- the grammar and the reader -----

@pytest.mark.parametrize("parallel, most", [(None, 1), (False, 1), (True, MAX_CALLS)], ids=["unset", "false", "true"])
def test_the_list_of_calls_ends(parallel, most):
    for choice in ("auto", "required"):
        schema = ToolMode.of(CHECKED, choice, parallel).schema()
        calls = (schema["anyOf"][0] if choice == "auto" else schema)["properties"]["tool_calls"]
        assert (calls["minItems"], calls["maxItems"]) == (1, most), (choice, calls)


def test_an_identical_call_is_kept_once_and_a_cut_answer_keeps_its_complete_calls():
    one, two = '{"name": "w", "arguments": {"c": "ab"}}', '{"name": "w", "arguments": {"c": "x"}}'
    content, calls = parse_answer(f'{{"tool_calls": [{one}, {one}, {two}, {one}]}}')
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"c": "ab"}', '{"c": "x"}']
    for cut in (f'{{"tool_calls": [{one}, {two[:20]}', f'{{"tool_calls": [{one}, ', f'{{"tool_calls": [{one}]'):
        content, calls = parse_answer(cut)
        assert content is None and [c["function"]["name"] for c in calls] == ["w"], cut
    for cut in ('{"tool_calls": [{"name": "w", "argu', '{"tool_c', '{"', ""):  # nothing complete: no wrapper
        assert parse_answer(cut) == ("", None), cut


def test_a_call_repeated_with_its_arguments_in_another_order_is_kept_once():
    """An identical call is the same function with the same arguments, whatever order its arguments' keys come in
    (a JSON object's keys have none): {"c": "P", "d": "Q"} and {"d": "Q", "c": "P"} are one call, kept once, and a
    call with another value is another call."""
    same = ('{"name": "w", "arguments": {"c": "P", "d": "Q"}}', '{"name": "w", "arguments": {"d": "Q", "c": "P"}}',
            '{"arguments": {"c": "P", "d": "Q"}, "name": "w"}')
    other = '{"name": "w", "arguments": {"d": "R", "c": "P"}}'
    content, calls = parse_answer(f'{{"tool_calls": [{", ".join(same)}, {other}]}}')
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"c": "P", "d": "Q"}',
                                                                               '{"d": "R", "c": "P"}']


def test_a_plain_answer_is_read_as_it_arrives():
    text = r'Hi \"you\"\\ \u00e9t\u00e9 \ud83d\ude00 ok\n'  # a JSON string's text, escapes and all
    answer = '{"response": "' + text + '"}'
    reader, pieces = AnswerReader(), []
    for char in answer:  # one character at a time: escapes and a surrogate pair split everywhere
        pieces.append(reader.feed(char))
    rest, calls = reader.finish()
    assert calls is None and "".join(pieces) + rest == 'Hi "you"\\ été 😀 ok\n'
    assert sum(1 for piece in pieces if piece) > 10  # handed out as it came, not at the end
    reader = AnswerReader()  # cut by the token limit inside an escape: the text before it
    assert reader.feed('{"response": "abc\\u00') == "abc" and reader.finish() == ("", None)


def test_a_tool_result_reaches_a_template_without_a_tool_role(served_dir):
    from transformers import AutoTokenizer

    from lookahead.serve.completions import _chat_prompt
    from lookahead.serve.protocol import ChatCompletionRequest

    tokenizer = AutoTokenizer.from_pretrained(served_dir)
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}
    messages = [*ASK, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages})
    text = tokenizer.decode(_chat_prompt(tokenizer, body, None))
    assert "<|im_start|>tool" not in text  # ChatML's plain loop would show the model a role it never saw
    assert "<|im_start|>user\nTool result of w: 18 degrees\nTool result of w: sunny<|im_end|>" in text, text
    # a template with a tool role of its own gets the messages as they are
    own = [{"role": "tool", "content": "x", "tool_call_id": "c", "name": "w"}]
    assert fold_tool_results(own, "{% if m['role'] == 'tool' %}{% endif %}") == own


# ----- the server -----

def test_tool_calls_end_with_the_default_settings(server):
    """parallel_tool_calls unset: one call, the answer ends where the grammar does (no max_tokens: the context caps
    it, and the grammar ends it well before)."""
    client = server.client()
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[TOOL], tool_choice="required",
                                                temperature=1, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        assert answer.usage.completion_tokens < 60


def test_parallel_calls_are_a_list_that_ends_without_repeats(server):
    client = server.client()
    for seed in range(4):
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[TOOL], tool_choice="required",
                                                parallel_tool_calls=True, temperature=1, seed=seed)
        choice = answer.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert 1 <= len(calls) <= MAX_CALLS and len(set(calls)) == len(calls), calls
        # ended by the grammar, or by the context (512 positions: a random model's calls may fill it first)
        full = answer.usage.total_tokens == 512
        assert choice.finish_reason == "tool_calls" or (choice.finish_reason == "length" and full), choice


def test_a_cut_answer_is_never_the_wrapper(server):
    client = server.client()
    for stream in (False, True):
        options = dict(model="tiny", messages=ASK, tools=[TOOL], tool_choice="required", max_tokens=12,
                       temperature=0)
        content, calls, finish = tool_answer(client, stream, **options)
        assert finish == "length" and not calls and not content, (stream, content)


def test_a_plain_answer_with_tools_present_streams(server):
    """tool_choice auto, answered in text: the text goes out as it comes (it went out in one chunk at the end), and
    is the non-streamed answer's."""
    whole, pieces = streamed_plain_answer(server.client(), model="tiny", messages=ASK, tools=[TOOL], max_tokens=60)
    assert "".join(pieces) == whole and len(pieces) >= 2, pieces
    assert not any(p.startswith('{"response"') for p in pieces)


def test_a_call_answered_already_is_a_repeat():
    from lookahead.serve.protocol import ChatCompletionRequest

    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c":"P"}'}}
    messages = [*ASK, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18"}]
    answered = answered_calls(ChatCompletionRequest.model_validate({"model": "t", "messages": messages}).messages)
    assert answered == {call_key("w", '{"c": "P"}')}  # (spacing does not count)
    mode = ToolMode.of(CHECKED, "auto", None, answered)
    assert mode.repeats(parse_answer('{"tool_calls": [{"name": "w", "arguments": {"c": "P"}}]}')[1])
    assert not mode.repeats(parse_answer('{"tool_calls": [{"name": "w", "arguments": {"c": "Q"}}]}')[1])
    assert not ToolMode.of(CHECKED, "required", None, answered).repeats(parse_answer(
        '{"tool_calls": [{"name": "w", "arguments": {"c": "P"}}]}')[1])  # (a call is what the client asked for)
    assert mode.text_only().schema()["required"] == ["response"]


@pytest.mark.slow
def test_the_default_models_agent_loop_ends(default_model_dir):
    """SmolLM2 given the tool's result calls the same tool again, for ever (issue 49): the repeat is answered in
    text, streamed or not."""
    from served import Running

    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    running = Running(default_model_dir, "smol", max_batch=2, max_queue=4)
    try:
        client = running.client()
        messages = [{"role": "user", "content": "What is the weather in Tokyo?"}]
        answer = client.chat.completions.create(model="smol", messages=messages, tools=[weather], temperature=0)
        (call,) = answer.choices[0].message.tool_calls
        messages += [answer.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
        final = client.chat.completions.create(model="smol", messages=messages, tools=[weather], temperature=0)
        choice = final.choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None and choice.message.content
        chunks = list(client.chat.completions.create(model="smol", messages=messages, tools=[weather], temperature=0,
                                                     stream=True))
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
    finally:
        running.stop()
