"""Tool-call conventions on real chat templates (issue 66; the templates as llama.cpp ships them, in
tests/helpers/templates): each template's convention is read from its text; the calls a template renders in an
assistant turn parse back to the same calls, match the convention's grammar with flexible whitespace (and not the
compact one: the templates write ``", "`` and ``": "``); ``"auto"`` lets text through and constrains a call once it
opens; a streamed answer's deltas assemble into the whole answer's message, in OpenAI's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.structured import char_tokenizer

from specdecode.serving.openai.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    CallParser,
    CallStream,
    Convention,
    call_grammar,
    convention_of,
)
from specdecode.serving.openai.tools import Tool, tool_plan
from specdecode.structured import Constraint

TEMPLATES = Path(__file__).parents[2] / "helpers" / "templates"
QWEN = "Qwen-Qwen2.5-7B-Instruct.jinja"
LLAMA_31 = "meta-llama-Llama-3.1-8B-Instruct.jinja"
LLAMA_32 = "meta-llama-Llama-3.2-3B-Instruct.jinja"
MISTRAL = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
FUNCTIONS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": s}} for n, s in FUNCTIONS.items()]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "Europe/Paris"})]
QUESTION = {"role": "user", "content": "Weather and time in Paris?"}


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.mark.parametrize(
    ("name", "convention"), [(QWEN, HERMES), (LLAMA_31, LLAMA3_JSON), (LLAMA_32, LLAMA3_JSON), (MISTRAL, None)]
)
def test_the_convention_is_read_from_the_template(name, convention):
    assert convention_of(template(name)) is convention
    assert convention_of(None) is None and convention_of({"default": template(name)}) is convention


def rendered_answer(tokenizer, name: str, calls: list[tuple[str, dict]]) -> str:
    """The assistant turn the template renders for ``calls`` (its own spelling of them), without its end marker."""
    tokenizer.chat_template = template(name)
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    turn = {"role": "assistant", "content": "", "tool_calls": tool_calls}
    before = tokenizer.apply_chat_template([QUESTION], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template([QUESTION, turn], tools=TOOLS, tokenize=False)
    assert after.startswith(before)
    end = "<|im_end|>" if name == QWEN else "<|eot_id|>"
    return after[len(before) : after.rindex(end)]


def accepts(tokenizer, grammar, text: str) -> bool:
    """Whether ``grammar`` allows ``text`` as a whole answer (its characters, then the EOS)."""
    constraint = Constraint(grammar, tokenizer, len(tokenizer), [0])
    for token in [*tokenizer.encode(text, add_special_tokens=False), 0]:
        if not bool(constraint.mask()[token]) or not constraint.consume(token):
            return False
    return True


def grammar(convention: Convention, tokenizer, auto: bool = True, compact: bool = True, parallel: bool = True):
    return call_grammar(convention, FUNCTIONS, tokenizer, auto=auto, parallel=parallel, strict=False, compact=compact)


@pytest.mark.parametrize(("name", "count"), [(QWEN, 2), (QWEN, 1), (LLAMA_31, 1), (LLAMA_32, 1)])
def test_a_templates_own_calls_parse_back_and_match_its_grammar(tokenizer, name, count):
    convention = convention_of(template(name))
    answer = rendered_answer(tokenizer, name, CALLS[:count])
    message, called = CallParser(convention).message(answer, cut=False)
    assert called and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == (
        CALLS[:count]
    )
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    assert accepts(tokenizer, grammar(convention, tokenizer, compact=False), answer)
    assert not accepts(tokenizer, grammar(convention, tokenizer), answer)  # the template's ": " is not compact
    compact = answer.replace('{"city": "Paris", "days": 2}', '{"city":"Paris","days":2}').replace(
        '{"zone": "Europe/Paris"}', '{"zone":"Europe/Paris"}'
    )
    assert accepts(tokenizer, grammar(convention, tokenizer), compact)
    if count == 2:  # one call only without parallel calls
        assert not accepts(tokenizer, grammar(convention, tokenizer, parallel=False), compact)


@pytest.mark.parametrize("convention", [HERMES, LLAMA3_JSON])
def test_auto_lets_text_through_and_constrains_a_call_once_it_opens(tokenizer, convention):
    auto, forced = grammar(convention, tokenizer), grammar(convention, tokenizer, auto=False)
    text = "It is sunny in Paris, {as ever}."
    assert accepts(tokenizer, auto, text) and accepts(tokenizer, auto, "")
    assert not accepts(tokenizer, forced, text)
    assert CallParser(convention).message(text, cut=False) == ({"role": "assistant", "content": text}, False)
    call = convention.open + convention.head + "get_weather" + convention.middle
    good = call + '{"city":"Rome"}' + convention.tail + convention.close
    assert accepts(tokenizer, auto, good) and accepts(tokenizer, forced, good)
    for bad in (
        good.replace("get_weather", "get_wind"),  # not a listed function
        good.replace('"Rome"', "7"),  # arguments invalid under the function's parameters
        good.replace('{"city":"Rome"}', '{"days":2}'),  # a required argument missing
        good.removesuffix(convention.close) + "and more" if convention.close else good + "and more",
    ):
        assert not accepts(tokenizer, auto, bad), bad
    if convention is HERMES:
        assert accepts(tokenizer, auto, "Let me look.\n" + good)
        assert not accepts(tokenizer, auto, "A call: <tool_call> is not text")  # the marker always opens a call


def test_a_stream_settles_text_and_streams_each_calls_arguments_in_fragments(tokenizer):
    answer = (
        'Looking it up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":2}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {"zone":"Europe/Paris"}}\n</tool_call>'
    )
    parser = CallParser(HERMES)
    whole, called = parser.message(answer, cut=False)
    assert called and whole["content"] == "Looking it up."
    stream, deltas = CallStream(parser), []
    for character in answer:
        deltas += stream.feed(character)
    deltas += stream.feed("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == whole["content"]  # the blank lines before the call were held back, never sent
    calls: list[dict] = []
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            if part["index"] == len(calls):
                assert set(part) == {"index", "id", "type", "function"} and part["function"]["arguments"] == ""
                calls.append({"name": part["function"]["name"], "arguments": ""})
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
    assert calls == [c["function"] for c in whole["tool_calls"]]
    assert sum(1 for d in deltas if "tool_calls" in d) > 10  # fragments as the characters came
    assert all(c["id"].startswith("call_") for c in whole["tool_calls"])


def test_text_that_could_open_a_call_is_held_back_until_it_does_not(tokenizer):
    stream = CallStream(CallParser(HERMES))
    assert stream.feed("Use <tool") == [{"content": "Use"}]
    assert stream.feed("box> here ") == [{"content": " <toolbox> here"}]
    assert stream.feed("", final=True) == [{"content": " "}]  # no call came: the text is the answer, whole


def test_a_cut_call_is_text_and_llama_takes_one_call(tokenizer):
    parser = CallParser(HERMES)
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Pa'
    assert parser.message(cut, cut=True) == ({"role": "assistant", "content": cut}, False)
    llama = CallParser(LLAMA3_JSON)
    message, called = llama.message('{"name": "get_time", "parameters": {"zone":"UTC"}}', cut=False)
    assert called and message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone":"UTC"}'}
    assert llama.message("Sure: {not a call}", cut=False)[1] is False


def test_tool_plans_follow_the_template(tokenizer):
    tools = [Tool.model_validate(t) for t in TOOLS]
    for name, auto_parses in ((QWEN, True), (LLAMA_32, True), (MISTRAL, False)):
        auto = tool_plan(tools, "auto", template(name), tokenizer)
        assert (auto.parser is not None) == auto_parses and not auto.forced
        required = tool_plan(tools, "required", template(name), tokenizer)
        assert required.parser is not None and required.forced and required.grammar is not None
    assert tool_plan(tools, None, template(QWEN), tokenizer).parser.convention is HERMES  # "auto" is the default
