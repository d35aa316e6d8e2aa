"""A small tool-calling accuracy set (issue 66): six tools an assistant might have and 24 one-turn requests, half of
which one of the tools answers and half no tool (a question, code to write, small talk). Written once, not tuned on
a model's answers. ``score`` reads OpenAI chat answers: whether each call parses and is valid under its tool's
parameters, and how often the expected tool (or no tool) was chosen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [
    _tool(
        "get_weather",
        "Current weather in a city.",
        {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    _tool(
        "convert_currency",
        "Convert an amount of money from one currency to another at today's rate.",
        {
            "amount": {"type": "number"},
            "source": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "ISO 4217 code"},
            "target": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "ISO 4217 code"},
        },
        ["amount", "source", "target"],
    ),
    _tool(
        "search_files",
        "Find files whose names match a glob pattern under a directory.",
        {"pattern": {"type": "string"}, "directory": {"type": "string"}},
        ["pattern"],
    ),
    _tool(
        "create_event",
        "Add an event to the user's calendar.",
        {
            "title": {"type": "string"},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "duration_minutes": {"type": "integer", "minimum": 1, "maximum": 1440},
        },
        ["title", "date"],
    ),
    _tool(
        "send_email",
        "Send an email on the user's behalf.",
        {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        ["to", "subject", "body"],
    ),
    _tool(
        "run_python",
        "Run Python code in a sandbox and return what it prints.",
        {"code": {"type": "string"}},
        ["code"],
    ),
]


@dataclass(frozen=True)
class ToolRequest:
    text: str
    tool: str | None  # the tool that answers it, None: no tool


REQUESTS = [
    ToolRequest("What's the weather like in Lisbon right now?", "get_weather"),
    ToolRequest("Is it cold in Oslo today? Give me the temperature in Fahrenheit.", "get_weather"),
    ToolRequest("How many euros do I get for 250 US dollars?", "convert_currency"),
    ToolRequest("Convert 1000 Japanese yen to British pounds.", "convert_currency"),
    ToolRequest("Find all the Python test files under the src directory.", "search_files"),
    ToolRequest("Is there a file called config.yaml anywhere in /etc?", "search_files"),
    ToolRequest("Put a 45-minute 'Design review' on my calendar for 2025-03-14.", "create_event"),
    ToolRequest("Schedule a dentist appointment on 2025-07-02, one hour long.", "create_event"),
    ToolRequest("Email alice@example.com with the subject 'Lunch' and ask if she is free on Friday.", "send_email"),
    ToolRequest("Send bob@example.org a note titled 'Report' saying the report is attached.", "send_email"),
    ToolRequest("Run some Python to compute the 30th Fibonacci number and tell me the result.", "run_python"),
    ToolRequest("Execute a Python snippet that prints the sum of the squares of 1 to 100.", "run_python"),
    ToolRequest("Write a Python function that reverses a string.", None),
    ToolRequest("What does the yield keyword do in Python?", None),
    ToolRequest("Explain the difference between a list and a tuple in one paragraph.", None),
    ToolRequest("Translate 'good morning' into Spanish.", None),
    ToolRequest("Write a haiku about autumn.", None),
    ToolRequest("What is the capital of Australia?", None),
    ToolRequest("Give me a regular expression that matches a US zip code.", None),
    ToolRequest("Summarize what a REST API is in two sentences.", None),
    ToolRequest("Fix this bug: def add(a, b): return a - b", None),
    ToolRequest("What is the time complexity of binary search?", None),
    ToolRequest("Thanks, that's all for now!", None),
    ToolRequest("Which is larger, a kilobyte or a kibibyte?", None),
]


@dataclass(frozen=True)
class Score:
    requests: int
    calls: int  # calls made, over every answer
    valid: int  # calls whose arguments parse as JSON and are valid under their tool's parameters
    right: int  # answers that called the expected tool (only it), or no tool when none was expected

    @property
    def accuracy(self) -> float:
        return self.right / self.requests


def score(requests: list[ToolRequest], messages: list[dict[str, Any]]) -> Score:
    """The set's figures for the assistant ``messages`` (OpenAI's shape, one per request); needs jsonschema."""
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    calls = valid = right = 0
    for request, message in zip(requests, messages, strict=True):
        names = []
        for call in message.get("tool_calls") or ():
            calls += 1
            name = call["function"]["name"]
            names.append(name)
            try:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
            except (ValueError, KeyError, jsonschema.ValidationError):
                continue
            valid += 1
        right += names == ([] if request.tool is None else [request.tool] * len(names)) and (
            bool(names) == (request.tool is not None)
        )
    return Score(len(requests), calls, valid, right)
