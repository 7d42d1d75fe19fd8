"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) and OpenAI's Responses API (/v1/responses)
of `pipeinfer serve`, without ranks: the real app and generation thread over a scripted head session
(tests/api_fakes.py), read by the real `anthropic` and `openai` packages on a port; the error shapes by hand."""
from __future__ import annotations

import json

import pytest

from api_fakes import api, last_prompt, say, served  # noqa: F401  (api, served: fixtures)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
FN_WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
              "parameters": WEATHER["input_schema"]}


# ------------------------------------------------------------------------------------ Anthropic: messages
def test_a_message_whole_and_its_usage(api):
    m = api.claude.messages.create(model="fake", max_tokens=50, messages=say("Hello there"),
                                   system="be brief", extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5},
                                   extra_headers={"x-api-key": "anything"})
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "fake"
    assert [(b.type, b.text) for b in m.content] == [("text", "Hello there")]
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert last_prompt(api) == "<|system|>be brief<|user|>say:Hello there<|assistant|>"
    assert m.usage.input_tokens == len(api.session.requests[-1].prompt) and m.usage.output_tokens == 11
    sp = api.session.requests[-1].sampling
    assert (sp.temp, sp.top_p, sp.top_k) == (0.5, 0.9, 5)


def test_max_tokens_and_stop_sequences(api):
    m = api.claude.messages.create(model="fake", max_tokens=4, messages=say("Hello there"))
    assert (m.content[0].text, m.stop_reason) == ("Hell", "max_tokens")
    m = api.claude.messages.create(model="fake", max_tokens=50, messages=say("one, two. three"),
                                   stop_sequences=["zzz", ". ", "two"])
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == ("one, ", "stop_sequence", "two")


def test_a_message_streamed(api):
    with api.claude.messages.stream(model="fake", max_tokens=50, messages=say("Streamed words here")) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "Streamed words here" == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(text)


def test_the_raw_event_stream(api):
    r = api.http.post(f"{api.url}/v1/messages", json={"model": "fake", "max_tokens": 50, "stream": True,
                                                      "messages": say("abc")})
    events = [(b.split("\n")[0], json.loads(b.split("\n")[1][6:])) for b in r.text.strip().split("\n\n")]
    assert all(name == f"event: {data['type']}" for name, data in events)
    kinds = [d["type"] for _, d in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn" and events[-2][1]["usage"]["output_tokens"] == 3


def test_a_tool_call_whole_and_streamed(api):
    m = api.claude.messages.create(model="fake", max_tokens=200, messages=say(f"Let me look.{CALL}"),
                                   tools=[WEATHER])
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[0].text == "Let me look."
    use = m.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert m.stop_reason == "tool_use"
    assert last_prompt(api).startswith("<|tools|>get_weather;<|user|>")
    with api.claude.messages.stream(model="fake", max_tokens=200, messages=say(CALL), tools=[WEATHER]) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"


def test_a_tool_result_goes_back_through_the_template(api):
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                             {"type": "text", "text": "say:It is sunny."}]}]
    m = api.claude.messages.create(model="fake", max_tokens=50, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "auto"})
    assert m.content[0].text == "It is sunny." and m.stop_reason == "end_turn"
    assert ('<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<|tool|>sunny<|user|>say:It is sunny.<|assistant|>') in last_prompt(api)


def test_tool_choice_any_constrains_the_answer_to_a_call(api, no_lltokenizer):
    api.claude.messages.create(model="fake", max_tokens=200, messages=say(CALL), tools=[WEATHER],
                               tool_choice={"type": "any"})
    assert api.session.requests[-1].decoding.constraint.kind == "lark"
    api.claude.messages.create(model="fake", max_tokens=20, messages=say("x"), tools=[WEATHER],
                               tool_choice={"type": "none"})
    assert api.session.requests[-1].decoding.constraint is None and "<|tools|>" not in last_prompt(api)


def test_count_tokens(api):
    body = dict(model="fake", messages=say("count me"), system="sys")
    n = api.claude.messages.count_tokens(**body).input_tokens
    api.claude.messages.create(max_tokens=5, **body)
    assert n == len(api.session.requests[-1].prompt)
    assert api.claude.messages.count_tokens(model="fake", messages=say("x"), tools=[WEATHER]).input_tokens > n - 10


# ------------------------------------------------------------------------------------ Anthropic: errors
def anthropic_error(api, path: str, body, status: int, kind: str, words: str) -> None:
    r = api.http.post(f"{api.url}{path}", **({"content": body} if isinstance(body, str) else {"json": body}))
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"], err


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": "fake", "messages": say("x")}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"model": "fake", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages.0.role"),
    ({"model": "fake", "max_tokens": 0, "messages": say("x")}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "fake", "max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", "messages.0.content.0"),
    ({"model": "fake", "max_tokens": 5, "messages": say("x"), "tools": [{"name": "f"}]}, 400,
     "invalid_request_error", "tools.0.input_schema"),
    ({"model": "fake", "max_tokens": 5, "messages": say("x"), "temperature": 1.5}, 400,
     "invalid_request_error", "temperature"),
    ({"model": "fake", "max_tokens": 10 ** 6, "messages": say("x")}, 400, "invalid_request_error", "context"),
    ("{not json", 400, "invalid_request_error", "not valid JSON"),
])
def test_message_errors_are_anthropic_shaped(api, body, status, kind, words):
    anthropic_error(api, "/v1/messages", body, status, kind, words)
    assert api.session.requests == []


def test_count_tokens_errors_and_the_sdk_exceptions(api):
    anthropic_error(api, "/v1/messages/count_tokens", {"model": "fake"}, 400, "invalid_request_error", "messages")
    import anthropic
    with pytest.raises(anthropic.BadRequestError) as e:
        api.claude.messages.create(model="fake", max_tokens=5, messages=[{"role": "tool", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------------ OpenAI: responses
def test_a_response_whole(api):
    r = api.oai.responses.create(model="fake", input="say:Hi from responses", instructions="be kind",
                                 temperature=0.3, top_p=0.5)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hi from responses" and r.output[0].type == "message"
    assert r.output[0].content[0].type == "output_text" and r.output[0].content[0].annotations == []
    assert r.usage.input_tokens == len(api.session.requests[-1].prompt) and r.usage.output_tokens == 17
    assert r.usage.total_tokens == r.usage.input_tokens + 17
    assert last_prompt(api) == "<|system|>be kind<|user|>say:Hi from responses<|assistant|>"
    r = api.oai.responses.create(model="fake", input="say:Hi from responses", max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", "Hi ")


def test_a_response_streamed(api):
    events = list(api.oai.responses.create(model="fake", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "say:streaming "}, {"type": "input_text", "text": "it"}]}], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "streaming it"
    assert events[-1].response.output_text == "streaming it" and events[-1].response.usage.output_tokens == 12


def test_a_function_call_whole_streamed_and_answered(api):
    r = api.oai.responses.create(model="fake", input=f"say:{CALL}", tools=[FN_WEATHER], max_output_tokens=200)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(api.oai.responses.create(model="fake", input=f"say:{CALL}", tools=[FN_WEATHER], max_output_tokens=200,
                                           tool_choice="auto", stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.output_item.done").item
    assert done.type == "function_call" and json.loads(done.arguments) == {"city": "Paris"}
    api.oai.responses.create(model="fake", tools=[FN_WEATHER], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "say:ok"}])
    assert ('<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<|tool|>sunny<|user|>say:ok') in last_prompt(api)


def test_text_format_is_the_chat_routes_constraint(api, no_lltokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    api.oai.responses.create(model="fake", input="say:{}", text={"format": {"type": "json_schema", "name": "x",
                                                                            "schema": schema, "strict": True}})
    c = api.session.requests[-1].decoding.constraint
    assert (c.kind, json.loads(c.text)) == ("json_schema", schema)
    api.oai.responses.create(model="fake", input="say:{}", text={"format": {"type": "json_object"}})
    assert api.session.requests[-1].decoding.constraint.kind == "json_object"


@pytest.mark.parametrize("body, status, param", [
    ({"model": "fake", "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"model": "fake", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format.schema"),
    ({"model": "fake", "input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"model": "fake", "input": [{"role": "robot", "content": "x"}]}, 400, "input.0.role"),
    ({"model": "fake", "input": [{"type": "reasoning"}]}, 400, "input.0.type"),
    ({"model": "fake", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"model": "fake", "input": "x", "tools": [{"type": "function", "name": "bad name"}]}, 400, "tools.0.name"),
    ({"model": "fake", "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": "fake"}, 400, "input"),
])
def test_response_errors_are_openai_shaped(api, body, status, param):
    r = api.http.post(f"{api.url}/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    assert api.session.requests == []
