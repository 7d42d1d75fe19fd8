"""schemathesis against the OpenAPI schema the app publishes (GET /openapi.json), over the scripted head session
(tests/api_fakes.py): bodies generated from the schema, valid (positive) and not (negative), for every operation,
`model` always the served one (the answers name the model asked when it is served); no answer may be a
5xx, and the server answers a normal request afterwards. Bounded: FUZZ_EXAMPLES examples per operation,
derandomized (the same cases every run). The routes that read their body by hand (Anthropic's /v1/messages*,
/v1/responses) publish no body schema: their pydantic models are added to the fuzzed copy."""
from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, settings

from api_fakes import ScriptedSession, simple_template
from pipeinfer.feeders.generator import Generator
from pipeinfer.frontend.app import ServeConfig, create_app

FUZZ_EXAMPLES = 30
CALLS: dict[str, list[int]] = {}  # "METHOD path" -> statuses seen (the summary at the end)


def _with_hand_read_bodies(raw: dict) -> dict:
    """The published schema, plus request bodies for the routes that validate theirs by hand."""
    from pipeinfer.frontend.anthropic_api import CountTokensRequest, MessagesRequest
    from pipeinfer.frontend.responses_api import ResponsesRequest
    for path, model in (("/v1/messages", MessagesRequest), ("/v1/messages/count_tokens", CountTokensRequest),
                        ("/v1/responses", ResponsesRequest)):
        op = raw["paths"].get(path, {}).get("post")
        if op is not None and "requestBody" not in op:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}
            for name, sub in model.model_json_schema(ref_template="#/components/schemas/{model}").get(
                    "$defs", {}).items():
                raw.setdefault("components", {}).setdefault("schemas", {}).setdefault(name, sub)
    for body in raw.get("components", {}).get("schemas", {}).values():  # the served model: answers then name it
        if "model" in body.get("properties", {}):
            body["properties"]["model"] = {"type": "string", "enum": ["fake"]}
    for op in (o for item in raw["paths"].values() for o in item.values()):
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
        if "model" in body.get("properties", {}):
            body["properties"]["model"] = {"type": "string", "enum": ["fake"]}
    return raw


@pytest.fixture(scope="module")
def served_app():
    from pipeinfer.engine import grammar
    session = ScriptedSession()
    gen = Generator(session, max_queue=64, log=lambda _msg: None)
    gen.start()
    app = create_app(ServeConfig("fake", 512, 4, 16), gen, session.tok, simple_template)
    with pytest.MonkeyPatch.context() as mp:
        # the fake tokenizer has no llama.cpp vocabulary: a constraint compiles without llguidance's tokenizer (as
        # test_api.py's no_lltokenizer), not a 500 of the fake's own
        mp.setattr(grammar, "lltokenizer", lambda tok: None)
        yield app
    gen.stop()


@pytest.fixture(scope="module")
def published(served_app):
    with TestClient(served_app) as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200
    schema = schemathesis.openapi.from_dict(_with_hand_read_bodies(r.json()))
    schema.app = served_app
    return schema


OPERATIONS = ["GET /health", "GET /v1/models", "POST /tokenize", "POST /detokenize", "POST /v1/completions",
              "POST /v1/chat/completions", "POST /v1/messages", "POST /v1/messages/count_tokens",
              "POST /v1/responses"]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
@pytest.mark.parametrize("operation", OPERATIONS)
def test_no_server_error(published, operation, mode):
    """schemathesis' cases for one operation through hypothesis (its own pytest plugin is not used: it does not
    know pytest 9's items)."""
    from hypothesis import given
    method, path = operation.split(" ", 1)
    if method == "GET" and mode == schemathesis.GenerationMode.NEGATIVE:
        pytest.skip("no parameter, no body: nothing to make invalid")
    op = published[path][method]

    @given(case=op.as_strategy(mode))
    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call()
        CALLS.setdefault(f"{operation} ({mode.value})", []).append(response.status_code)
        assert response.status_code < 500, f"{operation} {case.body!r}: {response.text}"
    fuzz()


def test_every_published_operation_is_fuzzed(published):
    ops = {f"{r.ok().method.upper()} {r.ok().path}" for r in published.get_all_operations()}
    assert ops - {"GET /state"} == set(OPERATIONS)  # /state: the web page's (its own tests)


def test_the_server_still_answers_after_the_fuzz(served_app):
    with TestClient(served_app) as client:
        r = client.post("/v1/chat/completions", json={"model": "fake",
                                                      "messages": [{"role": "user", "content": "say:alive"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "alive"
        assert client.get("/health").json()["status"] == "ok"
    summary = {k: (len(v), sorted(set(v))) for k, v in sorted(CALLS.items())}
    print("\nfuzzed:", sum(n for n, _ in summary.values()), "calls;",
          "; ".join(f"{k}: {n} ({', '.join(map(str, s))})" for k, (n, s) in summary.items()))
