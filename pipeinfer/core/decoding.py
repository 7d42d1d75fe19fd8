"""What a request asks of each chosen token beyond the sampling parameters: a constraint, biases, penalties and
log-probabilities. Plain data: it travels from the HTTP front end to the scheduler (and, JSON-encoded, to a
supervised job's rank 0); the head turns it into per-row masks and biases for the last stage (decide/rules.py),
the last stage applies them before it draws a row's token and returns the log-probabilities asked for.

Exactness: the constraint and the biases change the target's distribution at every position where a token is
chosen, the same way in every mode, so PipeInfer stays exact with respect to the constrained target; a drafted
token the constraint forbids simply fails verification.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

CONSTRAINT_KINDS = ("json_object", "json_schema", "lark", "gbnf", "regex")
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Constraint:
    kind: str          # one of CONSTRAINT_KINDS
    text: str = ""     # json_schema: the schema as JSON text; lark/gbnf/regex: the grammar's source; json_object: ""
    strict: bool = False  # json_schema: no properties beyond the schema's (OpenAI's `strict`)

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"unknown constraint kind '{self.kind}' (one of {', '.join(CONSTRAINT_KINDS)})")


@dataclass(frozen=True)
class Decoding:
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit), OpenAI's logit_bias
    frequency_penalty: float = 0.0   # subtracted per earlier occurrence of a token in the answer (OpenAI's rule)
    presence_penalty: float = 0.0    # subtracted once from every token already in the answer
    top_logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely

    def __post_init__(self):
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs {self.top_logprobs} outside 0..{MAX_TOP_LOGPROBS}")

    @property
    def shapes_logits(self) -> bool:
        """Does anything change the target's logits before a token is drawn (a mask or a bias)?"""
        return bool(self.constraint or self.logit_bias or self.frequency_penalty or self.presence_penalty)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Decoding":
        if not d:
            return cls()
        c = d.get("constraint")
        return cls(Constraint(**c) if c else None, tuple((int(t), float(b)) for t, b in d.get("logit_bias", ())),
                   float(d.get("frequency_penalty", 0.0)), float(d.get("presence_penalty", 0.0)),
                   d.get("top_logprobs"))


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability (log-softmax of its raw logits at temperature 1, as llama-cpp-python reports
    them) of one chosen token, and its `top_logprobs` most likely alternatives, most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())
