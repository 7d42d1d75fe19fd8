"""Tool calls: the chat template rendered with tools (engine/chat.py), and frontend/tools.py's checks, tool-call
format, streaming parser and forcing grammar. The `real` tests load the Qwen2.5-Coder vocabulary (no weights)."""
import itertools
import json

import pytest
from helpers import real_model

from pipeinfer.engine.chat import render_chat, template_messages
from pipeinfer.frontend.tools import (HERMES, CallArgs, CallEnd, CallFailed, CallStart, Text, ToolCallParser,
                                      ToolError, check_tools, choice_of, from_anthropic_messages,
                                      from_anthropic_tools, new_call_id, prompt_tools, tool_constraint, tool_format)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]


def call_text(name, args, fmt=HERMES):
    return f"{fmt.open}\n{json.dumps({'name': name, 'arguments': args})}\n{fmt.close}"


PARIS = call_text("get_weather", {"city": "Paris"})
PARIS_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ROME = call_text("get_weather", {"city": "Rome", "unit": "C"})


# ---------------------------------------------------------------- the streaming parser
def parse(pieces, names=None):
    """(events, finish()) of a parser fed `pieces`, with ids call_0, call_1, ..."""
    counter = itertools.count()
    p = ToolCallParser(HERMES, names, new_id=lambda: f"call_{next(counter)}")
    events = [e for piece in pieces for e in p.feed(piece)] + p.close()
    return events, p.finish()


def merged(events):
    """Events with consecutive Text pieces, and consecutive CallArgs of one call, joined (how they are split
    depends on how the text came in)."""
    out = []
    for e in events:
        if out and isinstance(e, Text) and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + e.text)
        elif out and isinstance(e, CallArgs) and isinstance(out[-1], CallArgs) and out[-1].index == e.index:
            out[-1] = CallArgs(e.index, out[-1].fragment + e.fragment)
        else:
            out.append(e)
    return out


STREAMS = [
    "Just text, no call. {\"name\": 1} </tool_call> ends with a space ",
    "Let me check.\n" + PARIS,
    PARIS + "\n" + ROME + "\n",
    "<tool_call>\nnot json at all\n</tool_call> and after",
    '<tool_call>\n{"arguments": {"q": "a}b"}, "name": "search"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {bad}}\n</tool_call>tail',
    'Ünïcode ✓ first\n' + call_text("get_weather", {"city": "Zürich \"quoted\" {x}"}) + "\nthen more",
    "ends inside a tag <tool_ca",
    PARIS[:-5],
    PARIS[:30],
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    'Here is JSON:\n```json\n{"name": "Bob", "arguments": {}}\n```\n',
]


@pytest.mark.parametrize("text", STREAMS)
def test_any_split_of_the_stream_gives_the_same_result(text):
    names = ["get_weather", "search", "f"]
    whole_events, whole = parse([text], names)
    assert merged(parse(list(text), names)[0]) == merged(whole_events)   # one character at a time
    for cut in range(len(text) + 1):
        events, result = parse([text[:cut], text[cut:]], names)
        assert result == whole, cut
        assert merged(events) == merged(whole_events), cut


def test_content_before_a_call():
    events, result = parse(["Let me check.\n", PARIS])
    assert merged(events) == [Text("Let me check."), CallStart(0, "call_0", "get_weather"),
                              CallArgs(0, '{"city": "Paris"}'), CallEnd(0)]
    assert result.content == "Let me check."
    assert result.tool_calls == [{"id": "call_0", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_multiple_calls_and_the_pads_between_them():
    _, result = parse([PARIS + "\n" + ROME + "\n"])
    assert result.content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "unit": "C"})]
    assert [c["id"] for c in result.tool_calls] == ["call_0", "call_1"]


def test_text_without_calls_comes_out_unchanged():
    text = "  Leading and trailing whitespace, a </tool_call>, and ``` fences ```\n\n"
    assert parse([text])[1].content == text
    assert parse(list(text), names=["f"])[1].content == text


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json at all\n</tool_call> and after",
    "Before.\n<tool_call>\n{\"name\": \"f\", \"arguments\": \"not an object\"}\n</tool_call>",
    "<tool_call>\n[1, 2]\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"argu",   # the answer ended inside the call
])
def test_a_malformed_call_is_kept_as_text(text):
    events, result = parse([text])
    assert result.tool_calls == [] and result.content == text
    assert not any(isinstance(e, CallStart) for e in events)


def test_a_call_broken_after_its_start_becomes_text():
    text = '<tool_call>\n{"name": "f", "arguments": {bad}}\n</tool_call>'
    events, result = parse([text])
    assert CallFailed(0, '<tool_call>\n{"name": "f", "arguments": {bad}') in events
    assert result.tool_calls == [] and result.content == text
    assert events[0] == CallStart(0, "call_0", "f")   # announced before it broke: a stream sent it already


def test_keys_in_another_order_are_read_once_the_call_is_whole():
    _, result = parse(['<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>'])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == [
        ("search", {"q": "x"})]


def test_a_missing_close_tag_at_the_end_still_makes_a_call():
    _, result = parse([PARIS[:-len("</tool_call>")]])
    assert len(result.tool_calls) == 1 and result.content == ""


def test_a_fenced_json_call_counts_only_when_it_names_a_tool():
    # what Qwen2.5-Coder-1.5B writes when left free with tools
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
    _, result = parse([fenced], names=["get_weather"])
    assert result.content == "" and json.loads(result.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert parse([fenced], names=["other"])[1].content == fenced
    assert parse([fenced])[1].content == fenced


def test_arguments_stream_before_the_call_ends():
    counter = itertools.count()
    p = ToolCallParser(HERMES, new_id=lambda: f"call_{next(counter)}")
    assert p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == [
        CallStart(0, "call_0", "get_weather"), CallArgs(0, '{"city": "Pa')]
    assert p.feed('ris"}}\n</tool_call>') == [CallArgs(0, 'ris"}'), CallEnd(0)]
    assert p.n_calls == 1


def test_call_ids():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == len("call_") + 24 and i.startswith("call_") for i in ids)
    int(next(iter(ids))[5:], 16)


# ---------------------------------------------------------------- checking a request's tools
@pytest.mark.parametrize("tools, choice, parallel, param", [
    ("nope", None, None, "tools"),
    ([{"type": "retrieval"}], None, None, "tools.0.type"),
    ([WEATHER, {"type": "function"}], None, None, "tools.1.function"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, None, "tools.0.function.name"),
    ([NOW, NOW], None, None, "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "city"}}}],
     None, None, "tools.0.function.parameters.required"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], None, None,
     "tools.0.function.parameters.properties.a.type"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, None, "tools.0.function.description"),
    (TOOLS, "sometimes", None, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, None, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    (TOOLS, "auto", "yes", "parallel_tool_calls"),
])
def test_check_tools_names_the_field(tools, choice, parallel, param):
    with pytest.raises(ToolError) as e:
        check_tools(tools, choice, parallel)
    assert e.value.param == param and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)


def test_valid_tools_pass_and_the_choice_is_read():
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "now"}}):
        check_tools(TOOLS, choice, True)
    check_tools(None, None, None)
    assert choice_of(TOOLS, None) == ("auto", None) and choice_of(None, None) == ("none", None)
    assert choice_of(TOOLS, {"type": "function", "function": {"name": "now"}}) == ("function", "now")
    assert prompt_tools(TOOLS, "none") is None and prompt_tools(TOOLS, "required") == TOOLS


# ---------------------------------------------------------------- Anthropic's shapes
def test_anthropic_tools_and_choice():
    tools = [{"name": "get_weather", "description": "d", "input_schema": WEATHER["function"]["parameters"]}]
    got, choice, parallel = from_anthropic_tools(tools, {"type": "any", "disable_parallel_tool_use": True})
    assert got == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                     "parameters": WEATHER["function"]["parameters"]}}]
    assert (choice, parallel) == ("required", False)
    assert from_anthropic_tools(tools, {"type": "tool", "name": "get_weather"})[1] == {
        "type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(ToolError) as e:
        from_anthropic_tools([{"name": "f", "input_schema": {"type": "string"}}], None)
    assert e.value.param == "tools.0.input_schema"
    with pytest.raises(ToolError) as e:
        from_anthropic_tools(tools, {"type": "tool", "name": "nope"})
    assert e.value.param == "tool_choice.name"


def test_anthropic_messages():
    msgs = from_anthropic_messages("Be brief.", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "18C"}]},
                                     {"type": "text", "text": "And?"}]}])
    assert msgs == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [dict(PARIS_CALL, id="toolu_1")]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"}, {"role": "user", "content": "And?"}]


# ---------------------------------------------------------------- the chat template (no model needed)
MINI_HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
               "{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]{{ m.content or '' }}"
               "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
               "</tool_call>{% endfor %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_render_chat_passes_tools_calls_and_results():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    text = render_chat(MINI_HERMES, msgs, [WEATHER])
    assert text.startswith("<tools>" + json.dumps(WEATHER) + "</tools>")
    assert text.endswith('[user]Weather in Paris?[assistant]<tool_call>get_weather {"city": "Paris"}</tool_call>'
                         "[tool:get_weather]18C[assistant]")
    assert "<tools>" not in render_chat(MINI_HERMES, msgs[:1], [])


def test_template_errors_are_one_line_value_errors():
    for template in ("{% if %}", "{{ raise_exception('no\nway') }}", "{{ messages[0].content + 1 }}",
                     "{{ messages[5].content.upper() }}"):
        with pytest.raises(ValueError) as e:
            render_chat(template, [{"role": "user", "content": "hi"}])
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"messages\.0\.tool_calls\.0\.function\.arguments"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}])


def test_tool_format_is_found_in_the_template():
    assert tool_format(MINI_HERMES) == HERMES
    for template in ("{{ messages }}", None):
        with pytest.raises(ToolError) as e:
            tool_format(template)
        assert e.value.param == "tools"


def test_auto_and_none_are_not_constrained():
    for choice in ("auto", "none", None):
        assert tool_constraint(TOOLS, choice, True, HERMES) is None


def test_the_grammar_forces_the_chosen_calls():
    one = tool_constraint(TOOLS, {"type": "function", "function": {"name": "now"}}, True, HERMES)
    assert one.kind == "lark" and one.text.startswith('start: call "\\n"?\n')
    assert '"const": "now"' in one.text and "get_weather" not in one.text
    assert 'call: "<tool_call>" "\\n" body "\\n" "</tool_call>"' in one.text   # no token ids known: as text
    many = tool_constraint(TOOLS, "required", None, HERMES)
    assert many.text.startswith('start: call ("\\n" call)* "\\n"?\n') and "body: f0 | f1" in many.text
    assert tool_constraint(TOOLS, "required", False, HERMES).text.startswith('start: call "\\n"?\n')


def test_a_schema_llguidance_cannot_compile_names_the_tool():
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}
    with pytest.raises(ToolError) as e:
        tool_constraint([NOW, bad], "required", None, HERMES)
    assert e.value.param == "tools.1.function.parameters"


# ---------------------------------------------------------------- on the real Qwen2.5-Coder vocabulary
@pytest.fixture(scope="module")
def qwen():
    from pipeinfer.engine.tokenizer import Tokenizer
    tok = Tokenizer(real_model("qwen2.5-coder-1.5b"))
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def qwen_lltok(qwen):
    from pipeinfer.engine.grammar import lltokenizer
    return lltokenizer(qwen)


QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
PLAIN = [
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "ç ✓\n\n  "}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "system", "content": "S2"},
     {"role": "user", "content": "c"}],
]


@pytest.mark.real
@pytest.mark.parametrize("messages", PLAIN)
def test_render_chat_equals_llama_cpp_on_plain_conversations(qwen, messages):
    from pipeinfer.engine.tokenizer import format_chat
    template = qwen.chat_template()
    assert render_chat(template, messages) == format_chat(template, messages)
    assert render_chat(template, messages, []) == format_chat(template, messages)


@pytest.mark.real
def test_without_a_system_message_the_template_adds_qwens_own(qwen):
    # the one difference: llama.cpp renders the template as plain ChatML, without the template's default system
    from pipeinfer.engine.tokenizer import format_chat
    template = qwen.chat_template()
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    assert render_chat(template, messages) == QWEN_SYSTEM + format_chat(template, messages)


@pytest.mark.real
def test_the_tool_prompt_holds_the_schema_and_past_calls(qwen):
    template = qwen.chat_template()
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    text = render_chat(template, msgs, [WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert "<|im_start|>assistant\n" + PARIS + "<|im_end|>\n" in text   # the format the parser reads
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.real
def test_qwen_tool_call_tags_are_single_tokens(qwen):
    fmt = tool_format(qwen.chat_template(), qwen)
    assert (fmt.open, fmt.close, fmt.open_id, fmt.close_id) == ("<tool_call>", "</tool_call>", 151657, 151658)
    assert qwen.piece(151657) == b"<tool_call>"   # written out as text when detokenized: the parser sees it


def _accepted(lltok, constraint, ids) -> tuple[int, bool]:
    """(how many of ids the grammar accepts, whether it is satisfied after all of them)."""
    import llguidance
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(constraint.text), log_level=0)
    assert not m.is_error(), m.get_error()
    n = m.validate_tokens(ids)
    assert m.consume_tokens(ids[:n])
    return n, m.is_accepting()


@pytest.mark.real
def test_the_grammar_accepts_calls_and_refuses_the_rest(qwen, qwen_lltok):
    fmt = tool_format(qwen.chat_template(), qwen)
    required = tool_constraint(TOOLS, "required", None, fmt)
    only_now = tool_constraint(TOOLS, {"type": "function", "function": {"name": "now"}}, None, fmt)
    single = tool_constraint(TOOLS, "required", False, fmt)
    now = call_text("now", {})

    def accepts(constraint, text):
        ids = qwen.encode(text, add_special=False)
        n, accepting = _accepted(qwen_lltok, constraint, ids)
        return n == len(ids) and accepting

    assert qwen.encode(PARIS, add_special=False)[0] == 151657
    for text in (PARIS, ROME, now, PARIS + "\n" + now + "\n"):
        assert accepts(required, text), text
    assert accepts(only_now, now) and not accepts(only_now, PARIS)
    assert accepts(single, PARIS + "\n") and not accepts(single, PARIS + "\n" + now)
    for text in (call_text("get_weather", {"town": "Paris"}),          # without the required "city"
                 call_text("get_weather", {"city": "Paris", "unit": "K"}),   # outside the enum
                 call_text("missing", {}), "Sure! " + PARIS, PARIS[:-5],
                 '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>',   # not the template's separators
                 "<tool_call>" + PARIS[len("<tool_call>"):].replace("\n", "", 1)):
        assert not accepts(required, text), text


@pytest.mark.real
def test_the_grammar_spells_the_tags_as_the_model_emits_them(qwen, qwen_lltok):
    # the tag as a token id: the text "<tool_call>" spelled with ordinary tokens is refused
    fmt = tool_format(qwen.chat_template(), qwen)
    required = tool_constraint(TOOLS, "required", None, fmt)
    spelled = qwen.encode("<tool_call", add_special=False) + qwen.encode(">", add_special=False)
    assert qwen.decode(spelled) == "<tool_call>" and len(spelled) > 1
    assert _accepted(qwen_lltok, required, spelled)[0] == 0


@pytest.mark.real
def test_gemma_has_no_template_for_tools():
    from pipeinfer.engine.tokenizer import Tokenizer
    tok = Tokenizer(real_model("gemma3-270m"))
    try:
        assert tok.chat_template() is None
        with pytest.raises(ToolError):
            tool_format(tok.chat_template(), tok)
    finally:
        tok.close()
