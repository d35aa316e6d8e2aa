"""Real clients on a real model (issue 66): the ``openai`` client (sync, async, its stream and parse helpers) and
``instructor`` (TOOLS and JSON_SCHEMA modes) against ``specdecode serve`` over the real pair (Qwen2.5-Coder-1.5B
with its 0.5B sibling drafting; its template's Hermes ``<tool_call>`` convention), greedy: ``"auto"`` calls a tool
when one answers and writes text when none does, calls validate, the answers are the same with and without
speculation, and a call's result goes back through the template. Slow; skipped without the pair (fetch it with
``python ../shared/tools/real_models.py``)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pydantic
import pytest
from helpers.serving import serve

from specdecode.bench.real_pair import find_real_pair
from specdecode.bench.tool_requests import TOOLS

PAIR = find_real_pair()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(isinstance(PAIR, str), reason=str(PAIR))]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather in Marseille at the moment?"}]
SETTINGS = {"model": "tiny", "temperature": 0, "max_tokens": 96}


@pytest.fixture(scope="module")
def url():
    with serve(str(PAIR.target), proposer="draft", draft=str(PAIR.draft), gamma=4) as running:
        yield f"{running.url}/v1"


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)


def calls_of(message) -> list[tuple[str, dict]]:
    """A message's calls as (name, arguments), each validated under its tool's parameters."""
    out = []
    for call in message.tool_calls or ():
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def test_auto_calls_the_tool_the_same_way_sync_async_streamed_and_without_speculation(client, url):
    whole = client.chat.completions.create(messages=WEATHER, tools=TOOLS, **SETTINGS)
    choice = whole.choices[0]
    calls = calls_of(choice.message)
    assert choice.finish_reason == "tool_calls" and [name for name, _ in calls] == ["get_weather"], choice
    assert "marseille" in calls[0][1]["city"].lower()
    assert whole.usage.accepted_tokens > 0  # model_extra: the draft's guesses were accepted
    plain = client.chat.completions.create(messages=WEATHER, tools=TOOLS, extra_body={"speculative": False}, **SETTINGS)
    assert calls_of(plain.choices[0].message) == calls and plain.usage.drafted_tokens == 0
    assert plain.choices[0].message.content == choice.message.content

    async def asynchronous():
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as async_client:
            return await async_client.chat.completions.create(messages=WEATHER, tools=TOOLS, **SETTINGS)

    assert calls_of(asyncio.run(asynchronous()).choices[0].message) == calls
    fragments = 0
    with client.chat.completions.stream(messages=WEATHER, tools=TOOLS, **SETTINGS) as stream:
        for event in stream:
            fragments += event.type == "tool_calls.function.arguments.delta"
        final = stream.get_final_completion()
    assert fragments > 1 and calls_of(final.choices[0].message) == calls
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_question_no_tool_answers_is_text(client):
    messages = [{"role": "user", "content": "What is the capital of Italy? One word."}]
    choice = client.chat.completions.create(messages=messages, tools=TOOLS, **SETTINGS).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "rome" in choice.message.content.lower()


def test_the_calls_result_goes_back_and_the_model_answers_from_it(client):
    answer = client.chat.completions.create(messages=WEATHER, tools=TOOLS, **SETTINGS).choices[0].message
    (call,) = answer.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 31, "sky": "clear"})}
    turn = [*WEATHER, answer.model_dump(exclude_none=True), result]
    reply = client.chat.completions.create(messages=turn, tools=TOOLS, **SETTINGS).choices[0]
    assert reply.finish_reason == "stop" and not reply.message.tool_calls
    assert "31" in reply.message.content
    stranger = {**result, "tool_call_id": "call_unknown"}
    with pytest.raises(openai.BadRequestError, match="matches no earlier assistant tool call"):
        client.chat.completions.create(messages=[*WEATHER, answer.model_dump(exclude_none=True), stranger], **SETTINGS)


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: str


PERSON = [{"role": "user", "content": "Extract the person: Ada Lovelace, 36, lives in London."}]


def test_the_parse_helpers_return_pydantic_objects(client):
    parsed = client.chat.completions.parse(messages=PERSON, response_format=Person, **SETTINGS).choices[0].message
    assert parsed.parsed == Person(name="Ada Lovelace", age=36, city="London")
    assert parsed.content == parsed.parsed.model_dump_json()  # compact JSON, as OpenAI writes it
    tool = openai.pydantic_function_tool(Person, name="save_person")
    called = client.chat.completions.parse(messages=PERSON, tools=[tool], tool_choice="required", **SETTINGS)
    (call,) = called.choices[0].message.tool_calls
    assert call.function.parsed_arguments == Person(name="Ada Lovelace", age=36, city="London")


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_pydantic_model(client, mode):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    person = patched.chat.completions.create(response_model=Person, messages=PERSON, max_retries=0, **SETTINGS)
    assert person == Person(name="Ada Lovelace", age=36, city="London")
