"""The head's scheduler: iterative, synchronous speculative, and PipeInfer generation.

PipeInfer (paper, section IV), as the loop below runs it:

    launch the prompt (non-speculative)
    until done:
        while no result is waiting and a partition is free:            # asynchronous speculation
            draft a micro-batch on top of the current speculation      # continuous speculation
            if the draft is confident: launch it as a speculative run   #   cutoff += p_recovery
            else: cutoff -= p_decay, or wait if decay is off
        take the oldest result; verify it against the accepted tokens   # lossless (verify.py)
        commit its accepted cells to sequence 0, free its partition     # KV multibuffering (kvplan.py)
        cancel in-flight runs that can no longer add a token            # early inference cancellation
        if nothing in flight will predict the next token: launch the last token non-speculatively

With a drafter beside the pipeline (draftahead.py: --draft-at thread|rank) "draft a micro-batch" only reads
what it has drafted ahead on the chain; with nothing ready yet the head waits for a result or a draft,
whichever comes first, never for the draft alone.

`speculative` mode is the synchronous baseline: draft a tree after [last token], run it, wait, verify.
`iterative` mode runs one token at a time through the pipeline.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Callable

import numpy as np

from ..core.config import DEFAULT_DRAFT_MAX, MODES, Config, ServingOptions, SpeculationOptions, StageOptions
from ..core.decoding import TokenLogprob
from ..core.kvplan import (
    CANONICAL,
    PartitionPool,
    commit_ops,
    prefix_ops,
    retire_starts,
)
from ..core.metrics import Stats, rss_mb
from ..core.protocol import NO_RUN, Batch, cp, kv_ops
from ..core.recurrent import chain_seq_ids, main_seq, seqs_per_run, state_seq
from ..core.verify import (
    Node,
    TreeRun,
    chain_checks,
    consistent,
    is_useful,
    one_sampling,
    reached,
    verify,
)
from ..drafters.drafter import Cutoffs, Drafter, DraftNode, main_chain
from .actions import Action, Cancel, EditKv, Launch
from .rules import RunRules
from .shape import add_siblings, choose_draft_len, choose_siblings, draft_cost_fit, fixed_siblings, ride_len



def auto_p_recovery(n_ranks: int) -> float:
    """The default recovery factor: 0.5 per micro-batch over the stages after the head's.

    A draft of confidence c keeps launching while c >= p_accept + k * p_recovery, i.e. about
    (c - p_accept) / p_recovery + 1 micro-batches past the last verification; with this factor a confident
    draft (0.9 over -pa 0.5) runs about 0.8 * (n_ranks - 1) + 1 ahead: enough to keep the other stages busy,
    not so many that cancelled runs queue behind them. Measured on 2 ranks (launch/bench_repeat.py --config): 0.5 beat
    0.25 and 0.1 at every agreement tried.
    """
    return 0.5 / max(1, n_ranks - 1)


@dataclass(frozen=True, kw_only=True)
class GenConfig(StageOptions, SpeculationOptions, ServingOptions):
    """The head's parameters: the run's stage, speculation and serving sections (core/config.py) as start-up
    resolved them (n_batch, prompt_chunk, draft_max, p_recovery, batch_rows), and what it measured."""
    mode: str = "iterative"
    p_recovery: float | None = 0.0   # None until resolved: auto_p_recovery(number of ranks)
    draft_max: int | None = DEFAULT_DRAFT_MAX
    batch_rows: int = 1              # next tokens of different generations one decode may carry (the exact limit)
    # each stage's decode time (ms) for 1..limit tokens, rank 0 first (startup.py measures it):
    # with it PipeInfer sizes each micro-batch by choose_draft_len (draft_max is then the cap)
    stage_ms: tuple[tuple[float, ...], ...] | None = None
    # a target with recurrent layers (core/recurrent.py): each drafted token of a run in a sequence of its own
    # (nested), so a partly accepted run commits the state after its last accepted token
    state_per_token: bool = False

    @property
    def seqs_per_run(self) -> int:
        """Sequence ids in a speculative run's partition (core/recurrent.seqs_per_run)."""
        return seqs_per_run(self.state_per_token, self.max_branches, self.draft_max or DEFAULT_DRAFT_MAX)

    @property
    def cut(self) -> Cutoffs:
        """What the drafter is asked for, before the head moves the cutoffs."""
        return Cutoffs(self.p_accept, self.p_split, self.draft_max, self.max_branches)


def gen_config(config: Config, *, n_batch: int, p_recovery: float, batch_rows: int = 1) -> GenConfig:
    """The head's parameters from the run's configuration (n_batch, p_recovery and batch_rows as start-up resolved
    them; draft_max, None for auto, is resolved by start-up after)."""
    own = {f.name: getattr(config, f.name) for f in fields(GenConfig) if hasattr(config, f.name)}
    return GenConfig(**{**own, "n_batch": n_batch, "prompt_chunk": min(config.prompt_chunk, n_batch),
                        "p_recovery": p_recovery, "batch_rows": batch_rows})


def check_gen_config(cfg: GenConfig) -> None:
    if cfg.mode not in MODES:
        raise ValueError(f"unknown mode {cfg.mode!r}")
    if cfg.p_recovery is None:
        raise ValueError("p_recovery is unresolved: pass a number (auto_p_recovery gives the default)")


def token_logprobs(logprobs, rows: list[int], tokens: list[int]) -> list[TokenLogprob] | None:
    """The accepted tokens' log-probabilities from a RESULT's LOGPROBS (pipeline.Result.logprobs: chosen f32[n],
    top ids i32[n, k], top f32[n, k]) and the rows they were drawn from (verify.Verdict.rows)."""
    if logprobs is None:
        return None
    chosen, top_ids, top = logprobs
    return [TokenLogprob(t, float(chosen[r]), tuple(zip(top_ids[r].tolist(), top[r].tolist())))
            for t, r in zip(tokens, rows)]


@dataclass(frozen=True)
class DrafterCounts:
    """A drafter beside the pipeline's running counters (draftahead.DraftClient), read when it is lent and given
    back: the difference is one generation's share."""
    n_stale: int = 0
    n_calls: int = 0
    bytes_out: int = 0
    bytes_in: int = 0

    @classmethod
    def of(cls, drafter) -> DrafterCounts:
        if not getattr(drafter, "asynchronous", False):
            return cls()
        return cls(drafter.n_stale, drafter.n_calls, drafter.bytes_out, drafter.bytes_in)


@dataclass
class Flight:
    run: TreeRun
    speculative: bool
    partition: int | None = None
    seqs: list[int] = field(default_factory=list)  # sequence ids the run's cells carry (partition seqs used)
    parent_id: int = NO_RUN
    main_seq: int | None = None  # the sequence holding the run's whole main chain (a child run builds on it)
    cancelled: bool = False
    siblings: dict[int, float] = field(default_factory=dict)  # node index -> probability: the draft's runner-ups


@dataclass
class ChainEntry:
    pos: int
    token: int
    owner: int  # run whose main sequence holds the cell (and every speculative cell before it)


class Head:
    """One generation's part of the loop of the module docstring (scheduler.py drives it, alone or beside others,
    over a Pipeline or the twin's). It never calls the pipeline: each step returns the actions it decided
    (actions.py: launches, cancels, KV edits), which the scheduler applies.

    Why one class: it is the paper's algorithm as one state machine. Launching, verifying, committing and
    cancelling all read and change the same few pieces of state together (the accepted tokens, the end of
    sequence 0, the runs in flight, the speculation chain, the partitions, the cutoff adjustment); each step
    holds an invariant across them (a chain continues sequence 0 without a gap, a cancelled run's children are
    cancelled, every cell is counted against the context). Cut into classes, those pieces would be passed back
    and forth on every call and the loop would no longer read as the algorithm; the pure parts (verify.py,
    kvplan.py, choose_draft_len) already live outside it.
    """

    def __init__(self, cfg: GenConfig, new_run_id: Callable[[], int], *,
                 eos: set[int] = frozenset(), on_tokens: Callable[[list[int]], None] | None = None,
                 on_progress: Callable[[Stats, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.perf_counter, canon: int = CANONICAL,
                 rules: RunRules | None = None, top_logprobs: int | None = None,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
                 draft_obs: deque[tuple[int, float]] | None = None):
        check_gen_config(cfg)
        self.cfg = cfg
        self._out: list[Action] = []       # what this step decided, for the scheduler to apply (_decided)
        self.pool: PartitionPool | None = None
        self.drafter: Drafter | None = None  # lent by the scheduler while this generation may speculate
        self.eos = set(eos)
        self.on_tokens = on_tokens
        self.on_progress = on_progress      # (stats, runs in flight) after every emission, for a live status line
        self.should_stop = should_stop      # polled after every result: True ends the generation early
        self.clock = clock                  # seconds; the digital twin (twin/sim.py) passes its virtual clock
        self.canon = canon                  # this generation's canonical sequence (scheduler.py: one per generation)
        self.rules = rules                  # its constraint's masks and biases for each run's rows (rules.py)
        self.top_logprobs = top_logprobs    # log-probabilities asked of the last stage (None: none)
        self.on_logprobs = on_logprobs      # one TokenLogprob per token, just before on_tokens
        self._new_run_id = new_run_id       # every generation on one pipeline draws run ids from one counter
        self.accepted: list[int] = []
        self.n_kv0 = 0                      # positions in sequence 0 once every issued transaction is applied
        # the prompt's runs not launched yet, (nodes, prefix ops), oldest first: the scheduler feeds them (feed); a
        # run id is drawn at launch, as every stage takes run ids in launch order
        self.pending: deque[tuple[list[Node], np.ndarray]] = deque()
        self.prompt_in_flight: set[int] = set()  # run ids of the prompt's runs launched and not yet taken
        self.flights: dict[int, Flight] = {}  # in launch order
        self.chain: list[ChainEntry] = []   # speculation beyond sequence 0 that new micro-batches build on
        self.adjust = 0.0                   # reactive cutoff adjustment
        self.stats = Stats()
        self.done = False
        self._n_prompt = 0
        self.n_cells_bound = 0              # cells any stage may hold: retired cells count until COMPACT
        self._n_checked = 0                 # draft tokens verification reached (their predecessors accepted)
        self._n_agreed = 0                  # ... and found right
        # recent (tokens proposed, ms) calls of the drafter in series (the scheduler's: every holder's, so that a
        # generation newly lent it prices its first micro-batches by what the drafter cost the others)
        self._draft_obs: deque[tuple[int, float]] = deque(maxlen=32) if draft_obs is None else draft_obs
        self._sib_promised = 0.0             # runner-up probabilities of the siblings verification reached (shape.py)
        # a drafter beside the pipeline (draftahead.DraftClient) drafts ahead by itself: the head only reads it
        self.asynchronous = False
        self._n_draft = cfg.draft_max                # the last micro-batch size asked for
        self._lent_at = DrafterCounts()              # the drafter's counters when it was lent

    # ================================================================ the drafter lent and given back (scheduler.py)
    def lend(self, drafter: Drafter, pool: PartitionPool) -> None:
        """This generation may speculate from now on (in the pipeline's mode), with `drafter` and the partitions
        of `pool`, until `give_back`."""
        self.drafter, self.pool = drafter, pool
        self.asynchronous = bool(getattr(drafter, "asynchronous", False))
        self._lent_at = DrafterCounts.of(drafter)
        self.stats.exact_batch_draft = getattr(drafter, "exact_batch", None)
        self.drafter.prefill(self.accepted[:self._n_prompt])

    def give_back(self) -> Drafter:
        """No more speculative runs (those in flight are verified as usual; the partitions stay to free theirs):
        what the drafter did for this generation goes into its statistics, and the drafter goes back."""
        drafter, now = self.drafter, DrafterCounts.of(self.drafter)
        if self.asynchronous:
            self.stats.n_draft_stale += now.n_stale - self._lent_at.n_stale
            self.stats.n_draft_calls += now.n_calls - self._lent_at.n_calls
            if drafter.remote:
                self.stats.draft_link_bytes = [now.bytes_out - self._lent_at.bytes_out,
                                               now.bytes_in - self._lent_at.bytes_in]
        self.drafter, self.asynchronous = None, False
        return drafter

    # ================================================================ the algorithm

    def start(self, prompt: list[int], replay: list[int] = (), cached: tuple[int, int] | None = None) -> None:
        """Plan the prompt's runs, in chunks of prompt_chunk tokens at positions 0, C, 2C, ... (non-speculative
        runs; the scheduler launches them one by one with feed, between the other generations' tokens), then
        `replay`: tokens this answer already has (streamed before the pipeline was lost), one per run, as they
        were first decoded, so the cells and every token after them are bit for bit the uninterrupted answer's;
        cfg.n_predict then counts only the tokens after them. cached = (seq, n): positions [0, n) are the cold
        bits of sequence `seq` (core/prefixcache.py), copied instead of decoded."""
        if not prompt:
            raise ValueError("empty prompt")
        self.stats.t_start_s = self.clock()
        self.stats.n_prompt = len(prompt)
        self._n_prompt = len(prompt) + len(replay)  # where this start's new tokens begin in `accepted`
        self._plan_prompt(prompt, list(replay), cached)
        if self.drafter is not None:
            self.drafter.prefill(self.accepted)  # while the target's stages process the prompt

    def feed(self) -> list[Action]:
        """Launch the prompt's next run."""
        nodes, pre_ops = self.pending.popleft()
        run = TreeRun(self._new_run_id(), nodes)
        self._launch(Flight(run, speculative=False), pre_ops)
        self.prompt_in_flight.add(run.run_id)
        self.n_kv0 = run.nodes[-1].pos + 1
        return self._decided()

    def _decided(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    @property
    def n_planned(self) -> int:
        """Positions in sequence 0 once the prompt's pending runs are fed too."""
        return self.n_kv0 + sum(len(nodes) for nodes, _ in self.pending)

    def take(self, res) -> list[Action]:
        """One result of this generation's runs: verify and commit it, cancel what it made useless, and keep
        the next token covered (once done, cancel everything left in flight)."""
        self._handle(res)
        if self.asynchronous and self.cfg.mode == "pipeinfer" and not self._quiet() and self.drafter is not None:
            self._steer_drafter()  # re-root it now, before this rank's next decode
        if self.should_stop is not None and self.should_stop():
            self.done = True  # a client left or a stop string matched: cancel what is in flight
        if self.done:
            self._cancel_all()
        else:
            self._cover()
        return self._decided()

    def result(self) -> list[int]:
        """The generated tokens (after the prompt and any replayed ones)."""
        return self.accepted[self._n_prompt:self._n_prompt + self.stats.n_generated]

    @property
    def may_speculate(self) -> bool:
        """Whether a speculative micro-batch could go out now: a partition is free and the prompt is all fed."""
        return self.drafter is not None and self.pool.n_free > 0 and not self.pending

    @property
    def spec_parent(self) -> int:
        """The run whose cells the next speculative micro-batch builds on (the chain's last), or NO_RUN."""
        return self.chain[-1].owner if self.chain else NO_RUN

    @property
    def speculating(self) -> bool:
        """Whether a speculative run of this generation is in flight."""
        return any(f.speculative for f in self.flights.values())

    def speculate_once(self, ride_rows: int = 0) -> list[Action] | None:
        """Draft one micro-batch on top of the current speculation and launch it if the draft is confident
        (the cutoff then rises by p_recovery); if not, lower the cutoff by p_decay and return no actions, or
        return None: nothing more to speculate now (not continuous and a run is out, the cutoff reached 1,
        the quiet first token, far enough ahead, or an unconfident draft without decay). ride_rows: the
        micro-batch rides a shared decode of that many other rows (sized by ride_len, not choose_draft_len)."""
        cut = self.cfg.cut
        if not self.cfg.continuous and any(f.speculative and not f.cancelled for f in self.flights.values()):
            return None
        p_accept = max(0.0, cut.p_accept + self.adjust)
        if p_accept >= 1.0 or self._quiet():
            return None
        context = self._spec_context()
        if len(context) >= min(self._n_prompt + self.cfg.n_predict, self.cfg.n_ctx - cut.n_max):
            return None  # far enough ahead
        t0 = self.clock()
        self._n_draft = self.ride_len(ride_rows) if ride_rows else self._draft_len()
        if self.asynchronous:  # what the drafter beside us has drafted on this chain so far
            tree, unconfident = self._steer_drafter(context).ready(context, p_accept, self._n_draft)
        else:
            tree = self.drafter.draft(context, Cutoffs(p_accept, max(0.0, cut.p_split + self.adjust),
                                                       self._n_draft, cut.max_branches))
            unconfident = not tree
            self.stats.n_draft_calls += 1
            if tree:
                self._draft_obs.append((len(tree), (self.clock() - t0) * 1e3))
        if tree:
            if cut.max_branches > 1 and not ride_rows and all(n.branches == {0} for n in tree):
                tree = self._with_siblings(tree, max(0.0, cut.p_split + self.adjust))
            self._launch_spec(tree, context)
            self.adjust += self.cfg.p_recovery
            return self._decided()
        if unconfident and self.cfg.p_decay > 0 and p_accept > 0:
            self.adjust -= self.cfg.p_decay
            return []
        return None

    def _draft_len(self) -> int:
        """Draft tokens for the next micro-batch: choose_draft_len on the measured costs and the running
        acceptance (_acceptance), or --draft-max without stage costs."""
        cut = self.cfg.cut
        if self.cfg.stage_ms is None or self.cfg.mode != "pipeinfer":
            return cut.n_max
        # a drafter beside the pipeline costs the head nothing per draft token (_draft_obs stays empty)
        n = choose_draft_len(self._acceptance(), [list(ms) for ms in self.cfg.stage_ms],
                             draft_cost_fit(self._draft_obs), cut.n_max)
        self.stats.draft_len_hist[n] = self.stats.draft_len_hist.get(n, 0) + 1
        return n

    def ride_len(self, n_rows: int, draft_ms: float | None = None) -> int:
        """Draft tokens worth riding a shared decode of n_rows other rows, within the batch's rows: by
        --draft-rides, 0 (never), that or a micro-batch's size (always), or as shape.ride_len finds on the measured
        costs and the running acceptance (auto: 0 where they buy less than those rows, or without stage costs).
        draft_ms: what a ride has cost the head in drafting so far (Scheduler._ride_cost_ms), else the fit of
        this drafter's calls."""
        cap = min(self.cfg.cut.n_max, self.cfg.batch_rows - n_rows)
        if self.cfg.draft_rides == "never" or self.cfg.mode != "pipeinfer" or self.cfg.state_per_token or cap < 1:
            return 0
        k = 0
        if self.cfg.stage_ms is not None:
            cost = draft_cost_fit(self._draft_obs) if draft_ms is None else (draft_ms, 0.0)
            k = ride_len(n_rows, self._acceptance(), [list(ms) for ms in self.cfg.stage_ms], cost, cap)
        if k == 0 and self.cfg.draft_rides == "always":
            k = min(cap, self._draft_len())
        return k

    def _acceptance(self) -> float:
        """The running acceptance of the chain's drafts, with a prior of 0.6 weighing as 8 checks (so that a lucky
        start does not decide)."""
        return (self._n_agreed + 0.6 * 8) / (self._n_checked + 8)

    def _with_siblings(self, chain: list[DraftNode], p_split: float) -> list[DraftNode]:
        """The chain with the runner-ups that pay as one-token siblings (shape.py): by the measured stage costs
        when there are any, else every runner-up >= p_split, within --max-branches and the batch cap."""
        cut = self.cfg.cut
        room = cut.max_branches - 1
        if self.cfg.stage_ms is None:
            keep, depths = fixed_siblings(chain, cut.n_max, room, p_split)
            chain = chain[:keep]
        else:
            sibling_rate = (self.stats.n_siblings_right + 1.0) / (self._sib_promised + 1.0)
            depths = choose_siblings(chain, self._acceptance(), sibling_rate, [list(ms) for ms in self.cfg.stage_ms],
                                     draft_cost_fit(self._draft_obs), cut.n_max, room, p_split)
        if depths:
            self.stats.n_siblings += len(depths)
        return add_siblings(chain, depths) if depths else chain

    def _count_siblings(self, fl: Flight) -> None:
        """A verified run's siblings whose chain reached them: how many were right, against what their
        probabilities promised (the correction choose_siblings applies, as drafts are not calibrated)."""
        m = len(self.accepted)
        for i, prob in fl.siblings.items():
            n = fl.run.nodes[i]
            if n.pos < m and reached(fl.run, i, self.accepted):
                self._sib_promised += prob
                self.stats.n_siblings_right += self.accepted[n.pos] == n.token

    def _steer_drafter(self, context: list[int] | None = None):
        """Point the drafter beside the pipeline at the chain the next micro-batches build on: the speculation
        context, or the accepted tokens when they reach further (a correction verification just made), up to
        a micro-batch per free partition ahead."""
        context = self._spec_context() if context is None else context
        target = context if len(context) >= len(self.accepted) else self.accepted
        # the drafter stops at the cutoff's floor, not at today's raised one: the recovery adjustment falls back
        # to 0 at the next acceptance, and the tokens drafted meanwhile are then ready to launch
        p_min = min(1.0, max(0.0, self.cfg.p_accept + min(0.0, self.adjust)))
        self.drafter.steer(target, len(context) + self._n_draft * max(1, self.pool.n_free), p_min, self._n_draft)
        return self.drafter

    def _quiet(self) -> bool:
        """While the first token after the prompt is computed, a drafter that shares the head's cores (a thread of
        rank 0) is left idle and nothing speculative is launched: on a host whose cores the stages use, drafting
        then slowed that token's decodes (measured on 2 cores: stage 0 24 -> 26-39 ms), and it is the token
        the time to first token waits for. What it costs: the overlap of one token at the start."""
        return (self.cfg.quiet_first and self.asynchronous and not self.drafter.remote
                and self.stats.n_generated == 1 and not self.done)

    def handle(self, res) -> list[Action]:
        """Verify the oldest run, commit what it proved, cancel what it made useless."""
        self._handle(res)
        return self._decided()

    def _handle(self, res) -> None:
        fl = self.flights.pop(res.run_id)
        self.prompt_in_flight.discard(res.run_id)
        verdict, m_before = None, len(self.accepted)
        if not (fl.cancelled or res.cancelled):
            verdict = verify(fl.run, res.tokens, self.accepted)
            if fl.siblings:
                self._count_siblings(fl)
        if fl.speculative:
            branch_seq, end = None, self.n_kv0
            if verdict is not None and verdict.deepest >= 0:
                node = fl.run.nodes[verdict.deepest]
                # the sequence that ends at the deepest accepted node: its cells, and its recurrent state
                branch_seq = state_seq(node.seq_ids, self.canon) if node.pos >= self.n_kv0 else None
                end = max(end, node.pos + 1)
            starts = retire_starts([(n.pos, n.seq_ids) for n in fl.run.nodes], self.canon)
            self._out.append(EditKv(commit_ops(branch_seq, self.n_kv0, end, fl.seqs, starts, self.pool.garbage_seq,
                                               self.canon)))
            self.n_kv0 = end
            self.pool.give_back(fl.partition)
        if len(self.accepted) > m_before:  # the chain's drafts these positions decided (before _prune_chain)
            checked, agreed = chain_checks([(e.pos, e.token) for e in self.chain], self.accepted, m_before)
            self._n_checked += checked
            self._n_agreed += agreed
        if verdict is not None and verdict.new_tokens:
            self.stats.n_draft_accepted += verdict.n_draft_accepted
            n = len(verdict.new_tokens)
            self.stats.accept_hist[n] = self.stats.accept_hist.get(n, 0) + 1
            self.adjust = 0.0  # recovery and decay both reset on acceptance
            if self.rules is not None:
                self.rules.commit(self.accepted)
            self._emit(verdict.new_tokens, token_logprobs(res.logprobs, verdict.rows, verdict.new_tokens))
        self._prune_chain()
        self._cancel_useless()

    def cover(self) -> list[Action]:
        """Make sure some run in flight predicts the token after the last accepted one (the prompt's last run does,
        once fed)."""
        self._cover()
        return self._decided()

    def _cover(self) -> None:
        if self.pending:
            return
        m = len(self.accepted)
        for fl in self.flights.values():
            if not fl.cancelled and any(n.pos == m - 1 and n.row >= 0 and consistent(fl.run, i, self.accepted)
                                        for i, n in enumerate(fl.run.nodes)):
                return
        if self.cfg.mode == "speculative" and self.drafter is not None:
            tree = self.drafter.draft(self.accepted, self.cfg.cut)
            self.stats.n_draft_calls += 1
            if tree:
                self._launch_spec(tree, self.accepted, lead=True)
                return
        self._launch_nonspec()

    # ================================================================ launching runs
    def _plan_prompt(self, prompt: list[int], replay: list[int], cached: tuple[int, int] | None) -> None:
        """The prompt's chunks after its cached positions (the last row of the last one predicts the next token),
        then each replayed token alone (a generated token was decoded alone or in a micro-batch within the exact
        batch limit, which gives the same cells), as runs pending to be fed."""
        self.accepted = list(prompt) + replay
        size, first, pre = self.cfg.prompt_chunk, 0, kv_ops()
        if cached is not None:
            src, first = cached
            if first % size or not 0 < first < len(prompt):
                raise RuntimeError(f"internal: a cached start at {first} in a prompt of {len(prompt)} ({size}-token chunks)")
            pre = kv_ops(cp(src, self.canon, 0, first))
            self.stats.n_cached = first
        runs = [(start, prompt[start:start + size]) for start in range(first, len(prompt), size)]
        runs += [(len(prompt) + k, [t]) for k, t in enumerate(replay)]
        for i, (start, chunk) in enumerate(runs):
            last = i == len(runs) - 1
            nodes = [Node(t, start + k, k - 1, [self.canon], 0 if (last and k == len(chunk) - 1) else -1)
                     for k, t in enumerate(chunk)]
            self.pending.append((nodes, pre if i == 0 else kv_ops()))

    def _launch_nonspec(self) -> None:
        m = len(self.accepted)
        if self.n_kv0 != m - 1:
            raise RuntimeError(f"internal: sequence 0 ends at {self.n_kv0}, expected {m - 1}")
        self.chain.clear()
        run = TreeRun(self._new_run_id(), [Node(self.accepted[-1], m - 1, -1, [self.canon], 0)])
        self._launch(Flight(run, speculative=False), kv_ops())
        self.n_kv0 = m

    def _launch_spec(self, tree: list[DraftNode], context: list[int], lead: bool = False) -> None:
        """A speculative run for a draft tree over positions len(context)..; with `lead`, [last token] + tree."""
        k = self.pool.take()
        nested = self.cfg.state_per_token
        if nested:  # a chain, each drafted token in its own sequence (core/recurrent.py)
            if any(d.branches != {0} or d.parent != i - 1 for i, d in enumerate(tree)):
                raise RuntimeError("internal: a model with recurrent layers drafts chains only")
            seqs = self.pool.seqs(k)[:len(tree)]
            ids = chain_seq_ids(seqs, len(tree))
        else:
            n_branches = 1 + max(b for n in tree for b in n.branches)
            seqs = self.pool.seqs(k)[:n_branches]
            ids = [[seqs[b] for b in sorted(d.branches)] for d in tree]
        first_pos = len(context)
        nodes, prefix, parent_id, parent_seq = [], {}, NO_RUN, None
        if lead:  # synchronous mode: the last accepted token joins sequence 0 and every branch
            nodes.append(Node(context[-1], first_pos - 1, -1, [self.canon] + seqs, 0))
            n_kv0 = first_pos - 1
        else:     # PipeInfer: build on sequence 0 plus the speculation chain's cells
            n_kv0 = self.n_kv0
            prefix = {e.pos: e.token for e in self.chain}
            parent_id = self.spec_parent
            if parent_id != NO_RUN:
                parent_seq = self.flights[parent_id].main_seq
        off = len(nodes)
        for i, d in enumerate(tree):
            parent = d.parent + off if d.parent >= 0 else (0 if lead else -1)
            nodes.append(Node(d.token, first_pos + d.depth, parent, ids[i], off + i, drafted=True))
        run = TreeRun(self._new_run_id(), nodes, prefix)
        siblings = {off + i: d.prob for i, d in enumerate(tree)
                    if 0 not in d.branches and (d.parent < 0 or 0 in tree[d.parent].branches)}
        self._launch(Flight(run, True, k, seqs, parent_id, main_seq(seqs, len(tree), nested), siblings=siblings),
                     prefix_ops(seqs, n_kv0, parent_seq, first_pos - lead, self.canon))
        self.stats.n_spec_runs += 1
        self.stats.n_drafted += len(tree)
        if lead:
            self.n_kv0 = first_pos
        else:
            self.chain += [ChainEntry(nodes[off + i].pos, tree[i].token, run.run_id) for i in main_chain(tree)]

    def compacted(self) -> None:
        """Every stage repacked the canonical sequences (a compaction the scheduler made): retired cells are gone."""
        self.n_cells_bound = self.n_kv0
        self.stats.n_compactions += 1

    def _launch(self, fl: Flight, pre_ops: np.ndarray) -> None:
        run = fl.run
        self.n_cells_bound += len(run.nodes)
        if self.n_cells_bound > self.cfg.n_ctx:
            raise RuntimeError(f"internal: {self.n_cells_bound} KV cells needed, the context has {self.cfg.n_ctx}")
        batch = Batch(np.array([n.token for n in run.nodes], dtype=np.int32),
                      np.array([n.pos for n in run.nodes], dtype=np.int32),
                      [n.seq_ids for n in run.nodes],
                      np.array([n.row >= 0 for n in run.nodes], dtype=np.int32), pre_ops)
        self.flights[run.run_id] = fl
        rules = self.rules.for_run(run, self.accepted) if self.rules is not None else None
        self._out.append(Launch(run.run_id, batch, fl.speculative, fl.parent_id,
                                one_sampling(self.cfg.sampling, self.top_logprobs), rules))
        self.stats.n_runs += 1

    # ================================================================ bookkeeping
    def _emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        room = self.cfg.n_predict - self.stats.n_generated
        out = tokens[:room]
        if self.cfg.stop_at_eos:
            for i, t in enumerate(out):
                if t in self.eos:
                    out = out[:i]
                    self.done = True
                    break
        now = self.clock()
        if out:
            if self.stats.n_generated == 0:
                self.stats.t_prompt_done_s = now
                if len(out) > 1:
                    self.stats.t_first_s = now
            elif not self.stats.t_first_s:
                self.stats.t_first_s = now
            self.stats.t_last_s = now
            before = self.stats.n_generated
            self.stats.n_generated += len(out)
            if self.stats.n_generated // 250 > before // 250:
                self.stats.rss_trace_mb[self.stats.n_generated // 250 * 250] = rss_mb()
            if self.on_logprobs and logprobs is not None:
                self.on_logprobs(logprobs[:len(out)])
            if self.on_tokens:
                self.on_tokens(out)
            if self.on_progress:
                self.on_progress(self.stats, len(self.flights))
        if self.stats.n_generated >= self.cfg.n_predict:
            self.done = True

    def _spec_context(self) -> list[int]:
        """Accepted tokens up to sequence 0's end, then the speculation chain."""
        return self.accepted[:self.n_kv0] + [e.token for e in self.chain]

    def _prune_chain(self) -> None:
        m, keep = len(self.accepted), []
        for e in self.chain:
            if e.pos < self.n_kv0:
                continue
            fl = self.flights.get(e.owner)
            if fl is None or fl.cancelled or (e.pos < m and self.accepted[e.pos] != e.token):
                break
            keep.append(e)
        if keep and keep[0].pos != self.n_kv0:
            keep = []  # a chain must continue sequence 0 without a gap
        self.chain = keep

    def _cancel_useless(self) -> None:
        dead: list[int] = []
        for rid, fl in self.flights.items():  # launch order: a parent is decided before its children
            if fl.speculative and not fl.cancelled and (fl.parent_id in dead or
                                                        (fl.parent_id in self.flights and self.flights[fl.parent_id].cancelled)
                                                        or not is_useful(fl.run, self.accepted)):
                dead.append(rid)
        for rid in dead:
            self.flights[rid].cancelled = True
        if dead:
            self.stats.n_cancelled += len(dead)
            if self.cfg.cancel:
                self._out.append(Cancel(tuple(dead)))
            self._prune_chain()

    def _cancel_all(self) -> None:
        """Cancel every speculative run in flight and forget the prompt's runs not launched (the generation is
        over)."""
        self.pending.clear()
        left = [rid for rid, fl in self.flights.items() if fl.speculative and not fl.cancelled]
        for rid in left:
            self.flights[rid].cancelled = True
        if left and self.cfg.cancel:
            self._out.append(Cancel(tuple(left)))
