"""Tool calls on POST /v1/chat/completions (tools, tool_choice, parallel_tool_calls, assistant tool_calls and tool
messages), without ranks: the real app and generation thread over the scripted head session of tests/api_fakes.py
(a model that says what follows "say:", a Hermes-style template), read by the real `openai` package on a port; the
error shapes and the raw deltas by hand."""
from __future__ import annotations

import json

import pytest

from api_fakes import ByteTokenizer, api, last_prompt, say, served  # noqa: F401  (api, served: fixtures)

ARGS = {"city": "Paris"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def create(api, **body):
    return api.oai.chat.completions.create(model="fake", max_tokens=200, **body)


def raw_chunks(api, body: dict) -> list[dict]:
    """A streamed answer's chunk objects, by hand, up to data: [DONE] (which must come)."""
    r = api.http.post(f"{api.url}/v1/chat/completions", json={"model": "fake", "stream": True, **body})
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def streamed_calls(chunks: list[dict], index: int = 0) -> tuple[str, dict[int, dict], list[str]]:
    """A streamed choice's content, its calls rebuilt from the deltas (OpenAI's rules: id, type and name at a call's
    start, then argument fragments) and its finish reasons."""
    content, calls, finishes = "", {}, []
    for ch in chunks:
        for c in ch["choices"]:
            if c["index"] != index:
                continue
            content += c["delta"].get("content") or ""
            for d in c["delta"].get("tool_calls") or []:
                if "id" in d:
                    assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
                    calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
                else:
                    assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                    calls[d["index"]]["arguments"] += d["function"]["arguments"]
            if c["finish_reason"]:
                finishes.append(c["finish_reason"])
    return content, calls, finishes


# ------------------------------------------------------------------------------------ calls
def test_tool_choice_required_constrains_the_answer_and_its_call_is_parsed(api, no_lltokenizer):
    r = create(api, messages=say(CALL), tools=[WEATHER], tool_choice="required")
    c = api.session.requests[-1].decoding.constraint
    assert c.kind == "lark" and "get_weather" in c.text and "<tool_call>" in c.text
    assert last_prompt(api).startswith("<|tools|>get_weather;<|user|>say:")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
    assert r.usage.completion_tokens == len(CALL)


def test_tool_choice_required_streamed(api, no_lltokenizer):
    chunks = list(create(api, messages=say(CALL), tools=[WEATHER], tool_choice="required", stream=True))
    assert api.session.requests[-1].decoding.constraint.kind == "lark"
    assert chunks[0].choices[0].delta.role == "assistant"
    starts = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or [] if d.id]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in starts] == [
        (0, "function", "get_weather", "")]
    fragments = [d.function.arguments for ch in chunks for d in ch.choices[0].delta.tool_calls or [] if not d.id]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == ARGS  # the arguments as they come
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    # the SDK's own accumulator reads the same call
    with api.oai.chat.completions.stream(model="fake", max_tokens=200, messages=say(CALL), tools=[WEATHER],
                                         tool_choice="required") as s:
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)


def test_a_named_function_and_one_call_only(api, no_lltokenizer):
    create(api, messages=say(CALL), tools=[WEATHER, TIME],
           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = api.session.requests[-1].decoding.constraint.text
    assert "get_weather" in c and "get_time" not in c and "call (" not in c   # one call of it
    create(api, messages=say(CALL), tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    c = api.session.requests[-1].decoding.constraint.text
    assert "get_weather" in c and "get_time" in c and "call (" not in c
    create(api, messages=say(CALL), tools=[WEATHER, TIME], tool_choice="required")
    assert "call (" in api.session.requests[-1].decoding.constraint.text  # one call or more


def test_auto_parses_text_and_calls_afterwards(api):
    r = create(api, messages=say(f"Let me look.{CALL}\n{CALL_2}"), tools=[WEATHER, TIME])
    assert api.session.requests[-1].decoding.constraint is None   # auto: free text
    m = r.choices[0].message
    assert m.content == "Let me look." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", ARGS), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in m.tool_calls}) == 2
    chunks = raw_chunks(api, {"messages": say(f"Let me look.{CALL}\n{CALL_2}"), "tools": [WEATHER, TIME],
                              "max_tokens": 200})
    content, calls, finishes = streamed_calls(chunks)
    assert content == "Let me look." and finishes == ["tool_calls"]
    assert [(k, c["name"], json.loads(c["arguments"])) for k, c in sorted(calls.items())] == [
        (0, "get_weather", ARGS), (1, "get_time", {"zone": "CET"})]


def test_auto_recognises_qwens_fenced_json_for_the_requests_tools_only(api):
    r = create(api, messages=say(FENCED), tools=[WEATHER], tool_choice="auto")
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    r = create(api, messages=say(FENCED), tools=[TIME])   # not one of the tools: text
    assert r.choices[0].message.content == FENCED and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_stops_after_the_first_call(api):
    answer = f"{CALL}\n{CALL_2}" + " and more text" * 50
    r = api.oai.chat.completions.create(model="fake", max_tokens=1000, messages=say(answer), tools=[WEATHER, TIME],
                                        parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert r.usage.completion_tokens < len(answer)   # the generation was stopped
    _, calls, finishes = streamed_calls(raw_chunks(api, {"messages": say(f"{CALL}\n{CALL_2}"), "max_tokens": 200,
                                                         "tools": [WEATHER, TIME], "parallel_tool_calls": False}))
    assert [c["name"] for c in calls.values()] == ["get_weather"] and finishes == ["tool_calls"]


def test_one_call_only_on_the_turn_routes_too(api):
    """turn.Turn (the Responses and Messages APIs) stops after the first call as well."""
    answer = f"{CALL}\n{CALL}" + " and more text" * 50
    r = api.oai.responses.create(model="fake", input=f"say:{answer}", max_output_tokens=1000,
                                 tools=[{"type": "function", **WEATHER["function"]}], parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["function_call"] and r.usage.output_tokens < len(answer)


def test_each_choice_parses_its_own_calls(api):
    r = create(api, messages=say(f"ok{CALL}"), tools=[WEATHER], n=2, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.message.content == "ok" and c.finish_reason == "tool_calls"
        assert [json.loads(t.function.arguments) for t in c.message.tool_calls] == [ARGS]
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    chunks = raw_chunks(api, {"messages": say(f"ok{CALL}"), "tools": [WEATHER], "n": 2, "temperature": 1.0,
                              "max_tokens": 200, "stream_options": {"include_usage": True}})
    ids = set()
    for j in range(2):
        content, calls, finishes = streamed_calls(chunks, j)
        assert content == "ok" and finishes == ["tool_calls"]
        assert [json.loads(c["arguments"]) for c in calls.values()] == [ARGS]
        ids |= {c["id"] for c in calls.values()}
    assert len(ids) == 2 and chunks[-1]["usage"]["completion_tokens"] == 2 * len(f"ok{CALL}")


@pytest.fixture
def with_logprobs(api, monkeypatch):
    """The scripted model reports a log-probability for each token it says, when asked (as the last stage does)."""
    from pipeinfer.core.decoding import TokenLogprob
    made = api.session.request

    def request(prompt, *, on_tokens, on_logprobs=None, decoding=None, **kw):
        def tokens_with_logprobs(tokens):
            if decoding is not None and decoding.top_logprobs is not None:
                on_logprobs([TokenLogprob(t, -0.5, ()) for t in tokens])
            on_tokens(tokens)
        return made(prompt, on_tokens=tokens_with_logprobs, on_logprobs=on_logprobs, decoding=decoding, **kw)
    monkeypatch.setattr(api.session, "request", request)
    return api


def test_logprobs_go_with_the_choices_chunks(with_logprobs):
    """Every token's entry, whether its text became content or a call: whole, and streamed (each with the next
    chunk of its choice)."""
    api = with_logprobs
    answer = f"ok{CALL}\n"
    r = create(api, messages=say(answer), tools=[WEATHER], logprobs=True, top_logprobs=0)
    assert r.choices[0].message.content == "ok" and r.choices[0].message.tool_calls
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens == len(answer)
    assert "".join(e.token for e in r.choices[0].logprobs.content) == answer
    chunks = raw_chunks(api, {"messages": say(answer), "tools": [WEATHER], "logprobs": True, "max_tokens": 200})
    streamed = "".join(e["token"] for ch in chunks for c in ch["choices"] if c["logprobs"]
                       for e in c["logprobs"]["content"])
    assert streamed == answer


# ------------------------------------------------------------------------------------ the conversation goes on
def test_a_tool_message_goes_back_through_the_template(api):
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "say:It is sunny."}]
    r = create(api, messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert last_prompt(api) == ('<|tools|>get_weather;<|user|>weather in Paris?<|assistant|><tool_call>'
                                '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                                '<|tool|>sunny<|user|>say:It is sunny.<|assistant|>')
    create(api, messages=messages)   # no tools now: the calls and results still go through the template
    assert last_prompt(api).startswith('<|user|>weather in Paris?<|assistant|><tool_call>')


def test_tool_choice_none_renders_no_tools_and_parses_nothing(api):
    r = create(api, messages=say(CALL), tools=[WEATHER], tool_choice="none")
    assert api.session.requests[-1].decoding.constraint is None and "<|tools|>" not in last_prompt(api)
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    chunks = raw_chunks(api, {"messages": say(CALL), "tools": [WEATHER], "tool_choice": "none", "max_tokens": 200})
    assert streamed_calls(chunks) == (CALL, {}, ["stop"])


# ------------------------------------------------------------------------------------ errors
def test_a_bad_tool_definition_is_a_400_naming_the_field(api):
    import openai
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    with pytest.raises(openai.BadRequestError) as e:
        create(api, messages=say("x"), tools=[WEATHER, bad])
    assert e.value.body["param"] == "tools.1.function.parameters.properties"
    assert e.value.body["type"] == "invalid_request_error" and api.session.requests == []


CALLED = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                               "function": {"name": "get_weather", "arguments": "{}"}}]}


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "not a name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "only 'function'"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "twice"),
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters", "'object'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "not one of"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not one of the tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot both"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": CALLED["tool_calls"]}]}, "messages.0.tool_calls",
     "only an assistant"),
    ({"messages": [{**CALLED, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "JSON text of an object"),
    ({"messages": [{**CALLED, "tool_calls": [{"type": "function"}]}]}, "messages.0.tool_calls.0", "a tool call is"),
    ({"messages": [CALLED, {"role": "tool", "content": "sunny"}]}, "messages.1.tool_call_id", "required"),
])
def test_malformed_tool_fields_are_400s_naming_them(api, no_lltokenizer, fields, param, words):
    body = {"model": "fake", "messages": say("x"), **fields}
    r = api.http.post(f"{api.url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and words in err["message"], err
    assert "\n" not in err["message"] and api.session.requests == []


def test_a_model_without_a_tool_call_format_cannot_take_tools(api, monkeypatch):
    monkeypatch.setattr(ByteTokenizer, "chat_template", lambda self: "{% for m in messages %}{{ m.content }}"
                                                                     "{% endfor %}")
    r = api.http.post(f"{api.url}/v1/chat/completions", json={"model": "fake", "messages": say("x"),
                                                              "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ------------------------------------------------------------------------------------ the real Qwen, end to end
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """`pipeinfer serve` on the real Qwen2.5-Coder-1.5B, 2 ranks under mpiexec (tests/test_serve.py's way)."""
    from helpers import Server, real_model
    model = real_model("qwen2.5-coder-1.5b")
    log = tmp_path_factory.mktemp("serve-tools") / "server.log"
    srv = Server(["-m", model, "--mode", "pipeinfer", "--drafter", "ngram", "-t", "1", "-c", "1024",
                  "--alias", "qwen"], 2, log)
    yield srv
    assert srv.stop() == 0, srv.text()[-3000:]
    assert "Traceback" not in srv.text()


@pytest.mark.slow  # about 100 s: the real model served on 2 ranks
@pytest.mark.real
@pytest.mark.mpi
def test_real_qwen_calls_a_tool_and_reads_its_result(qwen_server):
    """tool_choice "required": a parsed call whose arguments validate against the tool's parameters, streamed
    and not (greedy: the same call); then the call and the tool's result go back (an assistant message with
    tool_calls, a tool message) and the answer is text that uses the result."""
    import jsonschema
    from openai import OpenAI
    c = OpenAI(base_url=qwen_server.base_url, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Istanbul?"}]
    ask = dict(model="qwen", messages=messages, tools=[GET_WEATHER], tool_choice="required", max_tokens=48)
    r = c.chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(args, GET_WEATHER["function"]["parameters"])
    assert "istanbul" in args["city"].lower(), args

    chunks = [ch.model_dump(exclude_unset=True) for ch in c.chat.completions.create(**ask, stream=True)]
    content, calls, finishes = streamed_calls(chunks)
    assert finishes == ["tool_calls"] and not content.strip()
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == ("get_weather", args)

    weather = {"city": "Istanbul", "temperature": 18, "unit": "celsius", "sky": "sunny"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(weather)}]
    # tool_choice "none": an answer from the result (given the tools, the 1.5B model asks for the weather again)
    r = c.chat.completions.create(model="qwen", messages=messages, tools=[GET_WEATHER], tool_choice="none",
                                  max_tokens=24)
    choice = r.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length"), choice
    assert "18" in choice.message.content, choice.message.content   # the tool's result was read
