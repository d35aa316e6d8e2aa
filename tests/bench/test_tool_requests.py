"""The tool-calling accuracy set (issue 66): at least 20 requests over at least 5 tools, half needing none, every
tool's parameters a schema the grammar compiles; ``score`` counts calls, valid calls and right choices."""

from __future__ import annotations

import json

from specdecode.bench.tool_requests import REQUESTS, TOOLS, score
from specdecode.structured import Grammar


def test_the_set_has_twenty_requests_over_five_tools_half_needing_none():
    names = {tool["function"]["name"] for tool in TOOLS}
    assert len(REQUESTS) >= 20 and len(names) >= 5
    assert sum(r.tool is None for r in REQUESTS) == len(REQUESTS) // 2
    assert {r.tool for r in REQUESTS if r.tool} == names  # every tool is asked for
    for tool in TOOLS:
        Grammar.json_schema(tool["function"]["parameters"])


def call(name: str, arguments: dict | str) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": text}}


def test_score_counts_valid_calls_and_right_choices():
    weather, none = REQUESTS[0], REQUESTS[-1]
    assert weather.tool == "get_weather" and none.tool is None
    messages = [
        {"content": None, "tool_calls": [call("get_weather", {"city": "Lisbon"})]},  # right, valid
        {"content": "It is sunny."},  # wrong: a tool was needed
        {"content": None, "tool_calls": [call("run_python", {"code": "1"})]},  # wrong: none was needed
        {"content": None, "tool_calls": [call("get_weather", {"town": "Lisbon"}), call("get_weather", "{")]},
    ]
    figures = score([weather, weather, none, weather], messages)
    assert (figures.requests, figures.calls, figures.valid, figures.right) == (4, 4, 2, 2)
    assert figures.accuracy == 0.5
