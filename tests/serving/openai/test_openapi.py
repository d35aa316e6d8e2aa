"""/openapi.json documents what the server does: the error statuses each route answers (with OpenAI's error body),
the bounds and required fields the server enforces, GET /v1/speculation's answer, and 405 with an Allow header."""

from __future__ import annotations

import pytest

POST_ROUTES = ("/v1/completions", "/v1/chat/completions")
BODIES = {
    "/v1/completions": {"prompt": "w1 w2", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2},
}


@pytest.fixture(scope="module")
def spec(http) -> dict:
    response = http.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def resolve(spec: dict, schema: dict) -> dict:
    """``schema`` with its ``$ref`` (one level) looked up in the spec's components."""
    ref = schema.get("$ref")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def request_schema(spec: dict, path: str) -> dict:
    return resolve(spec, spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


@pytest.mark.parametrize("path", POST_ROUTES)
def test_post_routes_declare_their_error_statuses_with_openais_error_body(spec, path):
    responses = spec["paths"][path]["post"]["responses"]
    for status in ("400", "401", "404", "413", "500"):
        body = resolve(spec, responses[status]["content"]["application/json"]["schema"])
        error = resolve(spec, body["properties"]["error"])
        assert set(error["properties"]) == {"message", "type", "param", "code"}, status
    assert "422" not in responses  # validation errors are 400s here
    assert "text/event-stream" in responses["200"]["content"]  # stream: true


def test_get_routes_declare_401_and_speculation_documents_its_answer(spec, http):
    for path in ("/v1/models", "/metrics", "/v1/speculation"):
        assert "401" in spec["paths"][path]["get"]["responses"], path
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    answer = spec["paths"]["/v1/speculation"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    state = resolve(spec, answer)
    assert set(state["required"]) == set(http.get("/v1/speculation").json())


def test_refused_shapes_are_schema_invalid_and_keep_the_servers_messages(spec, http):
    chat, completions = request_schema(spec, "/v1/chat/completions"), request_schema(spec, "/v1/completions")
    assert chat["properties"]["messages"]["minItems"] == 1 and "messages" in chat["required"]
    assert "prompt" in completions["required"]
    missing = http.post("/v1/completions", json={"max_tokens": 2}).json()["error"]
    assert (missing["message"], missing["param"]) == ("prompt is required", "prompt")
    empty = http.post("/v1/chat/completions", json={"messages": []}).json()["error"]
    assert empty["message"].startswith("messages is empty") and empty["param"] == "messages"


def test_logprobs_and_sources_are_documented(spec):
    chat, completions = request_schema(spec, "/v1/chat/completions"), request_schema(spec, "/v1/completions")
    for fields in (completions["properties"]["logprobs"], chat["properties"]["top_logprobs"]):
        assert (fields["minimum"], fields["maximum"]) == (0, 20) and fields["description"]
    assert chat["properties"]["logprobs"]["description"]
    stream_options = spec["components"]["schemas"]["StreamOptions"]["properties"]
    assert completions["properties"]["include_sources"]["description"] and stream_options["include_sources"]


def _integer(field: dict) -> bool:
    return any(choice.get("type") == "integer" for choice in field.get("anyOf", [field]))


def _outside(field: dict) -> list:
    """Values just past each bound ``field`` documents."""
    values = []
    for key, step in (("minimum", -1), ("maximum", 1), ("exclusiveMinimum", 0), ("exclusiveMaximum", 0)):
        if key in field:
            bound = int(field[key]) if _integer(field) else field[key]
            values.append(bound + step)
    return values


@pytest.mark.parametrize("path", POST_ROUTES)
def test_every_documented_bound_is_one_the_server_enforces(spec, http, path):
    """A value just past a documented minimum or maximum gets a 400 naming that field, not a 200."""
    checked = 0
    for name, field in request_schema(spec, path)["properties"].items():
        for value in _outside(field):
            response = http.post(path, json={**BODIES[path], name: value})
            assert response.status_code == 400, (name, value, response.text)
            param = response.json()["error"]["param"]
            assert param == name, (name, value)
            checked += 1
    assert checked >= 10


def test_a_wrong_method_gets_405_with_allow(http):
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405 and "POST" in response.headers["allow"]
    assert response.json()["error"]["message"]
    assert "GET" in http.post("/v1/models").headers["allow"]


def test_the_schema_forbids_what_the_server_refuses(spec):
    """No field beyond those documented is taken (the server's 400 for any other: tests/serving/test_serving_fields.py),
    and the sampling fields say what they do."""
    schemas = spec["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "StreamOptions", "ChatMessage"):
        assert schemas[name]["additionalProperties"] is False, name
    chat = schemas["ChatCompletionRequest"]["properties"]
    for field in ("presence_penalty", "frequency_penalty", "logit_bias", "min_p", "repetition_penalty", "n"):
        assert chat[field]["description"], field
    assert "functions" not in chat and "json_schema" in chat["response_format"]["description"]
    assert "chat template" in chat["tools"]["description"] and '"auto"' in chat["tool_choice"]["description"]
