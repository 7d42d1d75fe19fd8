"""Batching users on the real Qwen2.5-Coder-1.5B: 16 requests at once to a 2-rank server (greedy and seeded, short
prompts and a 300+-token one, some with log-probabilities, a JSON-schema grammar, a logit bias), through the real
`openai` client, each equal to the same request alone on the same server; and the server did share decodes."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import Server, real_model

pytestmark = [pytest.mark.real, pytest.mark.mpi, pytest.mark.slow]  # about 3 min: the 1.5B model on 2 cores

N = 24
CODE = [
    "def quicksort(arr):", "class Stack:\n    def __init__(self):", "import numpy as np\n\ndef softmax(x):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"", "SELECT name, COUNT(*) FROM",
    "// JavaScript debounce\nfunction debounce(fn, wait) {", "def binary_search(arr, target):",
    "#include <stdio.h>\nint main(void) {",
]
LONG = "# utilities\n" + "".join(f"def helper_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(40)) + "def main():"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["name", "year"]}


def requests() -> list[tuple[str, dict]]:
    """(route, body) of the 16 requests: 8 greedy completions, 2 with log-probabilities, a 300+-token prompt,
    2 seeded samples, a logit bias, a grammar and a greedy chat."""
    done = {"max_tokens": N, "cache_prompt": False}  # each answer decoded from its prompt, not from the cache
    out = [("completions", {"prompt": p, **done}) for p in CODE]
    out += [("completions", {"prompt": p, "logprobs": 2, **done}) for p in ("def is_prime(n):", "def gcd(a, b):")]
    out.append(("completions", {"prompt": LONG, **done}))
    out += [("chat", {"messages": [{"role": "user", "content": "Name a random animal."}], "temperature": 0.8,
                      "seed": seed, **done}) for seed in (3, 4)]
    out.append(("completions", {"prompt": "def add(a, b):", "logit_bias": {"198": -4.0}, **done}))
    out.append(("chat", {"messages": [{"role": "user", "content": "Describe a famous programming book in JSON."}],
                         "response_format": {"type": "json_schema", "json_schema": {"name": "book", "strict": True,
                                                                                   "schema": SCHEMA}}, **done}))
    out.append(("chat", {"messages": [{"role": "user", "content": "What does a linker do?"}], **done}))
    return out


def ask(client, route: str, body: dict) -> dict:
    body = dict(body)
    extra = {"cache_prompt": body.pop("cache_prompt")}
    if route == "completions":
        r = client.completions.create(model="qwen", extra_body=extra, **body).choices[0]
        return {"text": r.text, "logprobs": r.logprobs.token_logprobs if r.logprobs else None}
    r = client.chat.completions.create(model="qwen", extra_body=extra, **body).choices[0]
    return {"text": r.message.content, "logprobs": None}


def test_sixteen_requests_at_once_each_equal_alone(tmp_path):
    from openai import OpenAI
    model = real_model("qwen2.5-coder-1.5b")
    srv = Server(["-m", model, "--drafter", "ngram", "-t", "1", "-c", "4096", "--parallel", "16", "--alias", "qwen"],
                 2, tmp_path / "server.log", timeout=300)
    try:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=600)
        asked = requests()
        n_long = len(json.loads(srv.request("POST", "/tokenize", {"content": LONG})[2])["tokens"])
        assert len(asked) == 16 and n_long >= 300, n_long
        with ThreadPoolExecutor(len(asked)) as pool:
            at_once = list(pool.map(lambda rb: ask(client, *rb), asked))
        status, _, body = srv.request("GET", "/health")
        batching = json.loads(body)["batching"]
        alone = [ask(client, route, body) for route, body in asked]
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.text(), srv.text()[-3000:]
    for i, (together, single) in enumerate(zip(at_once, alone)):
        assert together == single, (i, asked[i], together, single)
    json.loads(at_once[-2]["text"])  # the grammar's answer is JSON
    assert batching["batch_rows"] >= 2 and batching["shared_decodes"] > 0, batching
