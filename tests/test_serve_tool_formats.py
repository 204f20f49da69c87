"""Tool calls in a chat template's own format (issue 49, item 2): a template that mentions `<tool_call>` (Qwen2.5's,
Hermes') is given the tools itself and its earlier calls and results as it expects them, the answer takes the
`<tool_call>` form under a grammar and comes back as OpenAI's `tool_calls`; a Llama-3.1-style template likewise with
its `{"name": ..., "parameters": ...}` JSON; LangChain's `bind_tools` loop against such a server ends."""

from __future__ import annotations

import json

import pytest

from lookahead.serve.tool_formats import HERMES, LLAMA3_JSON, detect, template_input
from lookahead.serve.tools import ToolMode
from served import streamed_plain_answer, tool_answer

TOOL = {"type": "function", "function": {"name": "w", "description": "Weather.", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 2}}, "required": ["c"]}}}
CHECKED = [{"name": "w", "description": "Weather.", "parameters": TOOL["function"]["parameters"]}]
ASK = [{"role": "user", "content": "Paris?"}]

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json has it
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# Llama 3.1's template's tool part, shortened (no dates, built-in tools or headers of its own special tokens)
LLAMA31_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'user' and loop.first and tools %}<|im_start|>user\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}. Do not use variables.\n\n"
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{{ message.content }}<|im_end|>\n"
    "{% elif 'tool_calls' in message %}<|im_start|>assistant\n"
    "{% set call = message.tool_calls[0].function %}"
    "{\"name\": \"{{ call.name }}\", \"parameters\": {{ call.arguments | tojson }}}<|im_end|>\n"
    "{% elif message.role == 'tool' or message.role == 'ipython' %}<|im_start|>ipython\n"
    "{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _folder(tmp_path_factory, name: str, template: str):
    """The tiny served model (byte-level tokenizer) with `template` and room for a template's tool prose."""
    from helpers import save_tiny_checkpoint, save_tiny_tokenizer

    folder = tmp_path_factory.mktemp(name)
    save_tiny_checkpoint(folder, vocab_size=260, bos_token_id=256, eos_token_id=257, pad_token_id=257,
                         max_position_embeddings=2048)
    save_tiny_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    from served import Running

    running = Running(_folder(tmp_path_factory, "tiny-hermes", QWEN25_TEMPLATE), max_batch=2, max_queue=8)
    yield running
    running.stop()


def _prompt(tokenizer, messages, **options) -> str:
    from lookahead.serve.completions import _chat_prompt
    from lookahead.serve.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages, **options})
    tools = ToolMode.of(body.tools, body.tool_choice, body.parallel_tool_calls, frozenset(),
                        detect(tokenizer.chat_template))
    return tokenizer.decode(_chat_prompt(tokenizer, body, tools))


def _generated(choice) -> str:
    """The answer's text as generated (its tokens' bytes, from logprobs), before it was read into tool_calls."""
    return b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode().removesuffix("<|im_end|>")


def test_formats_are_told_apart_by_the_template():
    assert detect(QWEN25_TEMPLATE) is HERMES and detect(LLAMA31_TEMPLATE) is LLAMA3_JSON
    from helpers import TINY_CHAT_TEMPLATE

    assert detect(TINY_CHAT_TEMPLATE) is None and detect(None) is None


def test_the_hermes_answer_is_read_back():
    one, two = '{"name": "w", "arguments": {"c": "ab"}}', '{"name": "w", "arguments": {"c": "x"}}'
    block = "<tool_call>\n{}\n</tool_call>"
    reader = HERMES.reader()
    assert reader.feed("\n".join(block.format(c) for c in (one, one, two))) == ""
    content, calls = reader.finish()
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"c": "ab"}', '{"c": "x"}']
    for cut in (block.format(one) + "\n" + block.format(two)[:30], block.format(one)[:-3]):  # complete calls only
        reader = HERMES.reader()
        reader.feed(cut)
        assert [c["function"]["name"] for c in reader.finish()[1] or ()] == (["w"] if len(cut) > 60 else [])
    reader, pieces = HERMES.reader(), []
    for char in "<b>Hello":  # plain text goes out once it cannot be a call
        pieces.append(reader.feed(char))
    assert pieces == ["", "<b", ">", "H", "e", "l", "l", "o"] and reader.finish() == ("", None)
    reader = LLAMA3_JSON.reader()
    reader.feed('{"name": "w", "parameters": {"c": "P"}}')
    assert reader.finish()[1][0]["function"] == {"name": "w", "arguments": '{"c": "P"}'}


def test_the_call_list_ends():
    for parallel, most in ((None, 1), (True, 8)):
        grammar = HERMES.grammar(ToolMode.of(CHECKED, "required", parallel))
        assert (f"{{0,{most - 1}}}" in grammar) == (most > 1) and "start: calls\n" in grammar
    grammar = LLAMA3_JSON.grammar(ToolMode.of(CHECKED, "auto", True))  # (its template renders one call)
    assert "start: calls | TEXT" in grammar and "{0," not in grammar
    assert "start: TEXT" in HERMES.grammar(ToolMode.of(CHECKED, "auto", None).text_only())


def test_the_hermes_template_gets_the_tools_calls_and_results_its_own_way(hermes):
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c":"P"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    text = _prompt(hermes.tokenizer, messages, tools=[TOOL])
    assert "# Tools" in text and "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in text, text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "w", "arguments": {"c": "P"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>" in text
    assert '{"tool_calls"' not in text and "Tool result" not in text  # (the generic format's)
    assert "# Tools" not in _prompt(hermes.tokenizer, messages, tools=[TOOL], tool_choice="none")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_takes_the_hermes_form(hermes, choice):
    client = hermes.client()
    tool_choice = {"type": "function", "function": {"name": "w"}} if choice == "named" else "required"
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[TOOL], tool_choice=tool_choice,
                                                temperature=1, seed=seed, logprobs=True)
        choice_ = answer.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None, choice_
        (call,) = choice_.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "w" and call.id.startswith("call_") and call.type == "function"
        assert set(arguments) == {"c"} and isinstance(arguments["c"], str) and len(arguments["c"]) <= 2
        generated = _generated(choice_)
        assert generated == f'<tool_call>\n{{"name": "w", "arguments": {call.function.arguments}}}\n</tool_call>'
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[TOOL], stream=True,
                                                     tool_choice=tool_choice, temperature=1, seed=seed))
        (streamed,) = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        assert (streamed.function.name, streamed.function.arguments) == ("w", call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_hermes_parallel_calls_end_and_a_cut_keeps_complete_calls(hermes):
    client = hermes.client()
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[TOOL], tool_choice="required",
                                                parallel_tool_calls=True, temperature=1, seed=seed, logprobs=True)
        choice = answer.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls" and 1 <= len(calls) <= 8 and len(set(calls)) == len(calls)
        assert _generated(choice).count("<tool_call>\n") <= 8
    for stream in (False, True):
        options = dict(model="tiny", messages=ASK, tools=[TOOL], tool_choice="required", max_tokens=20)
        content, calls, finish = tool_answer(client, stream, **options)
        assert finish == "length" and not calls and not content, (stream, content)


def test_a_hermes_plain_answer_streams_and_never_holds_a_call(hermes):
    whole, pieces = streamed_plain_answer(hermes.client(), model="tiny", messages=ASK, tools=[TOOL], max_tokens=40)
    assert "<tool_call>" not in whole
    assert "".join(pieces) == whole and len(pieces) >= 2, pieces


def test_the_llama31_template_gets_its_json_form(tmp_path_factory):
    from served import Running

    running = Running(_folder(tmp_path_factory, "tiny-llama31", LLAMA31_TEMPLATE), max_batch=2, max_queue=8)
    try:
        call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}
        messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18"}]
        text = _prompt(running.tokenizer, messages, tools=[TOOL])
        assert '"parameters": dictionary' in text and '"name": "w"' in text
        assert '<|im_start|>assistant\n{"name": "w", "parameters": {"c": "P"}}<|im_end|>' in text
        assert "<|im_start|>ipython\n18<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
        answer = running.client().chat.completions.create(model="tiny", messages=ASK, tools=[TOOL],
                                                          tool_choice="required", parallel_tool_calls=True,
                                                          temperature=1, seed=0, logprobs=True)
        choice = answer.choices[0]
        (call,) = choice.message.tool_calls  # one call: the template renders no more
        assert choice.finish_reason == "tool_calls" and call.function.name == "w"
        assert _generated(choice) == f'{{"name": "w", "parameters": {call.function.arguments}}}'
    finally:
        running.stop()


def test_template_input_leaves_a_template_without_a_format_to_the_generic_one(served_dir):
    from transformers import AutoTokenizer

    from lookahead.serve.protocol import ChatCompletionRequest

    tokenizer = AutoTokenizer.from_pretrained(served_dir)
    body = ChatCompletionRequest.model_validate({"model": "t", "messages": ASK, "tools": [TOOL]})
    messages, own = template_input(tokenizer.chat_template, body.messages, ToolMode.of(body.tools, "auto", None))
    assert own == {} and '{"tool_calls"' in messages[0]["content"]


def test_a_langchain_agent_loop_ends(hermes):
    """bind_tools: a call, its result, then an answer that ends (stop, or a call) within max_tokens."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    from lookahead.serve import tool_formats

    generated = []
    finish = tool_formats.FormatReader.finish

    def recording(reader):
        generated.append(reader.text)
        return finish(reader)

    tool_formats.FormatReader.finish = recording
    try:
        llm = ChatOpenAI(model="tiny", base_url=f"{hermes.url}/v1", api_key="none", max_retries=0, timeout=60,
                         temperature=1, seed=1, max_tokens=100)
        bound = llm.bind_tools([TOOL], tool_choice="w")
        messages = [HumanMessage("Paris?")]
        first = bound.invoke(messages)
        assert len(first.tool_calls) == 1 and first.tool_calls[0]["name"] == "w", first
        assert generated and generated[-1].startswith("<tool_call>\n")
        messages += [first, ToolMessage("18 degrees", tool_call_id=first.tool_calls[0]["id"])]
        final = llm.bind_tools([TOOL]).invoke(messages)
        reason = final.response_metadata["finish_reason"]
        assert reason in ("stop", "tool_calls"), final.response_metadata
        assert final.usage_metadata["output_tokens"] <= 100
    finally:
        tool_formats.FormatReader.finish = finish
