"""One generation as the paper's state machine: iterative, synchronous speculative, and PipeInfer generation.

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

Head holds the algorithm's state; beside it, the draft-size policy (draftsize.py) and the drafter's lease (lease.py).
Each step returns values: the actions for the pipeline (actions.py), and what the generation emitted (Emitted).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..core.decoding import TokenLogprob
from ..core.kvplan import CANONICAL, PartitionPool, commit_ops, prefix_ops, retire_starts
from ..core.metrics import Stats, rss_mb
from ..core.protocol import NO_RUN, Batch, cp, kv_ops
from ..core.recurrent import chain_seq_ids, main_seq, state_seq
from ..core.verify import Node, TreeRun, consistent, is_useful, verify
from ..drafters.drafter import Cutoffs, Drafter, DraftNode, main_chain
from .actions import Action, Cancel, EditKv, Launch
from .draftsize import DraftSizer
from .genconfig import GenConfig, check_gen_config
from .lease import DraftLease
from .port import Result
from .rules import RunRules


def token_logprobs(logprobs, rows: list[int], tokens: list[int]) -> list[TokenLogprob] | None:
    """The accepted tokens' log-probabilities from a RESULT's LOGPROBS (port.Result.logprobs: chosen f32[n],
    top ids i32[n, k], top f32[n, k]) and the rows they were drawn from (verify.Verdict.rows)."""
    if logprobs is None:
        return None
    chosen, top_ids, top = logprobs
    return [TokenLogprob(t, float(chosen[r]), tuple(zip(top_ids[r].tolist(), top[r].tolist())))
            for t, r in zip(tokens, rows)]


@dataclass(frozen=True)
class Emitted:
    """Tokens a generation emitted (within its max tokens, up to its end of generation) and, when its request asked,
    their log-probabilities (one each)."""
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Taken:
    """What taking a result decided: the actions for the pipeline, in order, and what the generation emitted."""
    actions: list[Action]
    emitted: list[Emitted]


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


def prompt_runs(prompt: list[int], replay: list[int], chunk: int, canon: int,
                cached: tuple[int, int] | None) -> list[tuple[list[Node], np.ndarray]]:
    """The prompt's runs after its cached positions, (nodes, prefix KV ops) in launch order: chunks of `chunk` tokens
    at positions 0, C, 2C, ... (the last row of the last one predicts the next token), then each replayed token alone
    (a generated token was decoded alone or in a micro-batch within the exact batch limit, which gives the same
    cells). cached = (seq, n): positions [0, n) are copied from sequence `seq` instead of decoded."""
    first, pre = 0, kv_ops()
    if cached is not None:
        src, first = cached
        if first % chunk or not 0 < first < len(prompt):
            raise RuntimeError(f"internal: a cached start at {first} in a prompt of {len(prompt)} "
                               f"({chunk}-token chunks)")
        pre = kv_ops(cp(src, canon, 0, first))
    runs = [(start, prompt[start:start + chunk]) for start in range(first, len(prompt), chunk)]
    runs += [(len(prompt) + k, [t]) for k, t in enumerate(replay)]
    out = []
    for i, (start, tokens) in enumerate(runs):
        last = i == len(runs) - 1
        nodes = [Node(t, start + k, k - 1, [canon], 0 if (last and k == len(tokens) - 1) else -1)
                 for k, t in enumerate(tokens)]
        out.append((nodes, pre if i == 0 else kv_ops()))
    return out


def within_answer(tokens: list[int], room: int, eos: set[int], stop_at_eos: bool) -> tuple[list[int], bool]:
    """(the tokens an answer emits of `tokens`, whether it ended at an end of generation): at most `room`, and up to
    the first end-of-generation token when it stops there."""
    out = tokens[:room]
    if stop_at_eos:
        for i, t in enumerate(out):
            if t in eos:
                return out[:i], True
    return out, False


def timed_emission(stats: Stats, n: int, now: float) -> None:
    """n tokens emitted at `now`: the prompt's end, the first token after it, the last, and the memory trace."""
    if stats.n_generated == 0:
        stats.t_prompt_done_s = now
        if n > 1:
            stats.t_first_s = now
    elif not stats.t_first_s:
        stats.t_first_s = now
    stats.t_last_s = now
    before = stats.n_generated
    stats.n_generated += n
    if stats.n_generated // 250 > before // 250:
        stats.rss_trace_mb[stats.n_generated // 250 * 250] = rss_mb()


def covered(flights: dict[int, Flight], accepted: list[int]) -> bool:
    """Whether some run in flight predicts the token after the last accepted one (a row at that position, on a
    path consistent with the accepted tokens)."""
    m = len(accepted)
    return any(not fl.cancelled and any(n.pos == m - 1 and n.row >= 0 and consistent(fl.run, i, accepted)
                                        for i, n in enumerate(fl.run.nodes))
               for fl in flights.values())


def pruned_chain(chain: list[ChainEntry], seq0_end: int, flights: dict[int, Flight],
                 accepted: list[int]) -> list[ChainEntry]:
    """The speculation chain past sequence 0's end while it still holds: its runs in flight and not cancelled, its
    tokens not contradicted by the accepted ones, continuing sequence 0 without a gap (else none of it)."""
    m, keep = len(accepted), []
    for e in chain:
        if e.pos < seq0_end:
            continue
        fl = flights.get(e.owner)
        if fl is None or fl.cancelled or (e.pos < m and accepted[e.pos] != e.token):
            break
        keep.append(e)
    return keep if not keep or keep[0].pos == seq0_end else []


def useless_runs(flights: dict[int, Flight], accepted: list[int]) -> list[int]:
    """Speculative runs in flight that can no longer add a token: their parent was cancelled (or is, now), or their
    tree contradicts the accepted tokens. Launch order: a parent is decided before its children."""
    dead: list[int] = []
    for rid, fl in flights.items():
        if fl.speculative and not fl.cancelled and (fl.parent_id in dead or (fl.parent_id in flights and
                                                                             flights[fl.parent_id].cancelled)
                                                    or not is_useful(fl.run, accepted)):
            dead.append(rid)
    return dead


def commit(fl: Flight, verdict, seq0_end: int, garbage_seq: int, canon: int) -> tuple[np.ndarray, int]:
    """(KV ops, sequence 0's new end) for a speculative run that is back (verdict None: cancelled): the cells of its
    deepest accepted node join sequence 0 and the rest retire (kvplan.commit_ops)."""
    branch_seq, end = None, seq0_end
    if verdict is not None and verdict.deepest >= 0:
        node = fl.run.nodes[verdict.deepest]
        # the sequence that ends at the deepest accepted node: its cells, and its recurrent state
        branch_seq = state_seq(node.seq_ids, canon) if node.pos >= seq0_end else None
        end = max(end, node.pos + 1)
    starts = retire_starts([(n.pos, n.seq_ids) for n in fl.run.nodes], canon)
    return commit_ops(branch_seq, seq0_end, end, fl.seqs, starts, garbage_seq, canon), end


def run_batch(run: TreeRun, pre_ops: np.ndarray) -> Batch:
    """The batch every stage decodes for a run: its nodes' tokens, positions, sequences and output rows."""
    return Batch(np.array([n.token for n in run.nodes], dtype=np.int32),
                 np.array([n.pos for n in run.nodes], dtype=np.int32),
                 [n.seq_ids for n in run.nodes],
                 np.array([n.row >= 0 for n in run.nodes], dtype=np.int32), pre_ops)


def tree_seqs(tree: list[DraftNode], partition_seqs: list[int], nested: bool) -> tuple[list[int], list[list[int]]]:
    """(the partition's sequence ids a draft tree uses, each node's sequence ids): a branch per sequence, or, for a
    model with recurrent layers (nested), each drafted token of a chain in a sequence of its own (core/recurrent.py)."""
    if nested:
        if any(d.branches != {0} or d.parent != i - 1 for i, d in enumerate(tree)):
            raise RuntimeError("internal: a model with recurrent layers drafts chains only")
        seqs = partition_seqs[:len(tree)]
        return seqs, chain_seq_ids(seqs, len(tree))
    seqs = partition_seqs[:1 + max(b for n in tree for b in n.branches)]
    return seqs, [[seqs[b] for b in sorted(d.branches)] for d in tree]


class Head:
    """One generation's part of the loop of the module docstring, as one state machine over the accepted tokens,
    the end of sequence 0, the runs in flight, the speculation chain and the cutoff adjustment. It never calls the
    pipeline nor its request: each step returns the actions it decided (actions.py), which the scheduler has carried
    out, and what it emitted (Emitted), which the scheduler delivers."""

    def __init__(self, cfg: GenConfig, new_run_id: Callable[[], int], *, eos: set[int] = frozenset(),
                 clock: Callable[[], float] = time.perf_counter, canon: int = CANONICAL,
                 rules: RunRules | None = None, top_logprobs: int | None = None,
                 draft_obs: deque[tuple[int, float]] | None = None):
        check_gen_config(cfg)
        self.cfg = cfg
        self._out: list[Action] = []        # what this step decided, for the scheduler to carry out (_decided)
        self._emitted: list[Emitted] = []   # what it emitted, for the scheduler to deliver
        self.pool: PartitionPool | None = None  # the partitions while it holds (and, after, to free its runs')
        self.lease: DraftLease | None = None    # the drafter, lent by the scheduler while this generation may speculate
        self.eos = set(eos)
        self.clock = clock                  # seconds; the digital twin (twin/sim.py) passes its virtual clock
        self.canon = canon                  # this generation's canonical sequence (scheduler.py: one per generation)
        self.rules = rules                  # its constraint's masks and biases for each run's rows (rules.py)
        self.top_logprobs = top_logprobs    # log-probabilities asked of the last stage (None: none)
        self._new_run_id = new_run_id       # every generation on one pipeline draws run ids from one counter
        self.accepted: list[int] = []
        self.seq0_end = 0                   # positions in sequence 0 once every issued transaction is applied
        self.pending: list[tuple[list[Node], np.ndarray]] = []  # the prompt's runs to feed (run ids drawn at launch)
        self.prompt_in_flight: set[int] = set()  # run ids of the prompt's runs launched and not yet taken
        self.flights: dict[int, Flight] = {}  # in launch order
        self.chain: list[ChainEntry] = []   # speculation beyond sequence 0 that new micro-batches build on
        self.adjust = 0.0                   # reactive cutoff adjustment
        self.stats = Stats()
        self.sizer = DraftSizer(cfg, self.stats, draft_obs)  # draft_obs: the drafter's costs, whoever held it
        self.done = False
        self._n_prompt = 0
        self.n_cells_bound = 0              # cells any stage may hold: retired cells count until COMPACT
        self._n_draft = cfg.draft_max       # the last micro-batch size asked for

    def hold_drafter(self, drafter: Drafter, pool: PartitionPool) -> None:
        """This generation may speculate with `drafter` and the partitions of `pool`, until release_drafter."""
        self.pool = pool
        self.lease = DraftLease(drafter, pool, self.stats, self.accepted[:self._n_prompt], self.clock)

    def release_drafter(self) -> Drafter:
        """No more speculative runs (those in flight are verified as usual; the partitions stay to free theirs)."""
        lease, self.lease = self.lease, None
        return lease.end()

    @property
    def asynchronous(self) -> bool:
        """Whether it holds a drafter that drafts ahead beside the pipeline."""
        return self.lease is not None and self.lease.asynchronous

    def start(self, prompt: list[int], replay: list[int] = (), cached: tuple[int, int] | None = None) -> None:
        """Plan the prompt's runs (prompt_runs; the scheduler feeds them, feed_prompt, between the others' tokens), then
        those of `replay`: tokens this answer already has (streamed before the pipeline was lost), decoded as first,
        so every token after them is the uninterrupted answer's; cfg.n_predict counts only the tokens after them."""
        if not prompt:
            raise ValueError("empty prompt")
        self.stats.t_start_s = self.clock()
        self.stats.n_prompt = len(prompt)
        self._n_prompt = len(prompt) + len(replay)  # where this start's new tokens begin in `accepted`
        self.accepted = list(prompt) + list(replay)
        self.pending = prompt_runs(list(prompt), list(replay), self.cfg.prompt_chunk, self.canon, cached)
        if cached is not None:
            self.stats.n_cached = cached[1]
        if self.lease is not None:
            self.lease.drafter.prefill(self.accepted)  # while the target's stages process the prompt

    def feed_prompt(self) -> list[Action]:
        """Launch the prompt's next run."""
        nodes, pre_ops = self.pending.pop(0)
        run = TreeRun(self._new_run_id(), nodes)
        self._launch(Flight(run, speculative=False), pre_ops)
        self.prompt_in_flight.add(run.run_id)
        self.seq0_end = run.nodes[-1].pos + 1
        return self._decided()

    def _decided(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    @property
    def n_cells_held(self) -> int:
        """Cells any stage may hold for this generation now: those its runs took, and its prompt's unfed chunks'."""
        return self.n_cells_bound + self.n_planned - self.seq0_end

    @property
    def n_planned(self) -> int:
        """Positions in sequence 0 once the prompt's pending runs are fed too."""
        return self.seq0_end + sum(len(nodes) for nodes, _ in self.pending)

    def take_result(self, res: Result) -> Taken:
        """One result of this generation's runs: verify and commit it, cancel what it made useless."""
        self._handle(res)
        emitted, self._emitted = self._emitted, []
        return Taken(self._decided(), emitted)

    def after_result(self, stop: bool = False) -> list[Action]:
        """After a result: keep the next token covered, or once done (or told to stop) cancel everything in flight."""
        if self.asynchronous and self.cfg.mode == "pipeinfer" and not self._quiet():
            self._steer_drafter()  # re-root it now, before this rank's next decode
        self.done = self.done or stop
        if self.done:
            self._cancel_all()
            return self._decided()
        return self.cover_next()

    def result(self) -> list[int]:
        """The generated tokens (after the prompt and any replayed ones)."""
        return self.accepted[self._n_prompt:self._n_prompt + self.stats.n_generated]

    @property
    def may_speculate(self) -> bool:
        """Whether a speculative micro-batch could go out now: a partition is free and the prompt is all fed."""
        return self.lease is not None and self.pool.n_free > 0 and not self.pending

    @property
    def spec_parent(self) -> int:
        """The run whose cells the next speculative micro-batch builds on (the chain's last), or NO_RUN."""
        return self.chain[-1].owner if self.chain else NO_RUN

    @property
    def speculating(self) -> bool:
        """Whether a speculative run of this generation is in flight."""
        return any(f.speculative for f in self.flights.values())

    def speculate_once(self, ride_rows: int = 0) -> list[Action] | None:
        """Draft one micro-batch on the current speculation and launch it if the draft is confident (the cutoff
        then rises by p_recovery); if not, lower the cutoff by p_decay and return no actions, or return None:
        nothing more to speculate now. ride_rows: it rides a shared decode of that many other rows (ride_len)."""
        cutoffs = self.cfg.cutoffs
        if not self.cfg.continuous and any(f.speculative and not f.cancelled for f in self.flights.values()):
            return None
        p_accept = max(0.0, cutoffs.p_accept + self.adjust)
        if p_accept >= 1.0 or self._quiet():
            return None
        context = self._spec_context()
        if len(context) >= min(self._n_prompt + self.cfg.n_predict, self.cfg.n_ctx - cutoffs.n_max):
            return None  # far enough ahead
        self._n_draft = self.sizer.ride_len(ride_rows) if ride_rows else self.sizer.draft_len()
        if self.asynchronous:
            self._steer_drafter(context)
        tree, unconfident = self.lease.propose(context, Cutoffs(p_accept, max(0.0, cutoffs.p_split + self.adjust),
                                                                self._n_draft, cutoffs.max_branches), self.sizer)
        if tree:
            if cutoffs.max_branches > 1 and not ride_rows and all(n.branches == {0} for n in tree):
                tree = self.sizer.with_siblings(tree, max(0.0, cutoffs.p_split + self.adjust))
            self._launch_spec(tree, context)
            self.adjust += self.cfg.p_recovery
            return self._decided()
        if unconfident and self.cfg.p_decay > 0 and p_accept > 0:
            self.adjust -= self.cfg.p_decay
            return []
        return None

    def _steer_drafter(self, context: list[int] | None = None) -> None:
        """Point the drafter beside the pipeline at the chain the next micro-batches build on: the speculation
        context, or the accepted tokens when they reach further (a correction verification just made), up to
        a micro-batch per free partition ahead. It stops at the cutoff's floor, not at today's raised one: the
        recovery adjustment falls back to 0 at the next acceptance, and the tokens drafted meanwhile are then ready."""
        context = self._spec_context() if context is None else context
        target = context if len(context) >= len(self.accepted) else self.accepted
        p_min = min(1.0, max(0.0, self.cfg.p_accept + min(0.0, self.adjust)))
        self.lease.steer(target, len(context) + self._n_draft * max(1, self.pool.n_free), p_min, self._n_draft)

    def _quiet(self) -> bool:
        """Whether the drafter is left idle now (lease.DraftLease.quiet): while the first token is computed."""
        return self.cfg.quiet_first and self.lease is not None and self.lease.quiet(self.stats.n_generated, self.done)

    def _handle(self, res: Result) -> None:
        fl = self.flights.pop(res.run_id)
        self.prompt_in_flight.discard(res.run_id)
        verdict, m_before = None, len(self.accepted)
        if res.mtp is not None and self.lease is not None:  # the target's MTP head drafted after this run
            self.lease.drafter.offer((fl.run.nodes[-1].token, int(res.tokens[-1])), *res.mtp)
        if not (fl.cancelled or res.cancelled):
            verdict = verify(fl.run, res.tokens, self.accepted)
            if fl.siblings:
                self.sizer.siblings_checked(fl.run, fl.siblings, self.accepted)
        if fl.speculative:
            ops, self.seq0_end = commit(fl, verdict, self.seq0_end, self.pool.garbage_seq, self.canon)
            self._out.append(EditKv(ops))
            self.pool.give_back(fl.partition)
        if len(self.accepted) > m_before:  # the chain's drafts these positions decided (before _prune_chain)
            self.sizer.checked([(e.pos, e.token) for e in self.chain], self.accepted, m_before)
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

    def cover_next(self) -> list[Action]:
        """Make sure some run in flight predicts the token after the last accepted one (once the prompt is fed)."""
        if self.pending or covered(self.flights, self.accepted):
            return self._decided()
        tree = []
        if self.cfg.mode == "speculative" and self.lease is not None:
            tree = self.lease.drafter.draft(self.accepted, self.cfg.cutoffs)
            self.stats.n_draft_calls += 1
        if tree:
            self._launch_spec(tree, self.accepted, lead=True)
        else:
            self._launch_nonspec()
        return self._decided()

    def _launch_nonspec(self) -> None:
        m = len(self.accepted)
        if self.seq0_end != m - 1:
            raise RuntimeError(f"internal: sequence 0 ends at {self.seq0_end}, expected {m - 1}")
        self.chain.clear()
        run = TreeRun(self._new_run_id(), [Node(self.accepted[-1], m - 1, -1, [self.canon], 0)])
        self._launch(Flight(run, speculative=False), kv_ops())
        self.seq0_end = m

    def _launch_spec(self, tree: list[DraftNode], context: list[int], lead: bool = False) -> None:
        """A speculative run for a draft tree over positions len(context)..; with `lead`, [last token] + tree."""
        k = self.pool.take()
        nested = self.cfg.state_per_token
        seqs, ids = tree_seqs(tree, self.pool.seqs(k), nested)
        first_pos = len(context)
        nodes, prefix, parent_id, parent_seq = [], {}, NO_RUN, None
        if lead:  # synchronous mode: the last accepted token joins sequence 0 and every branch
            nodes.append(Node(context[-1], first_pos - 1, -1, [self.canon] + seqs, 0))
            seq0_end = first_pos - 1
        else:     # PipeInfer: build on sequence 0 plus the speculation chain's cells
            seq0_end = self.seq0_end
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
                     prefix_ops(seqs, seq0_end, parent_seq, first_pos - lead, self.canon))
        self.stats.n_spec_runs += 1
        self.stats.n_drafted += len(tree)
        if lead:
            self.seq0_end = first_pos
        else:
            self.chain += [ChainEntry(nodes[off + i].pos, tree[i].token, run.run_id) for i in main_chain(tree)]

    def compacted(self) -> None:
        """Every stage repacked the canonical sequences (a compaction the scheduler made): retired cells are gone."""
        self.n_cells_bound = self.seq0_end
        self.stats.n_compactions += 1

    def _launch(self, fl: Flight, pre_ops: np.ndarray) -> None:
        run = fl.run
        self.n_cells_bound += len(run.nodes)
        if self.n_cells_bound > self.cfg.n_ctx:
            raise RuntimeError(f"internal: {self.n_cells_bound} KV cells needed, the context has {self.cfg.n_ctx}")
        batch = run_batch(run, pre_ops)
        self.flights[run.run_id] = fl
        rules = self.rules.for_run(run, self.accepted) if self.rules is not None else None
        self._out.append(Launch(run.run_id, batch, fl.speculative, fl.parent_id, self.cfg.sampling, self.top_logprobs,
                                rules))
        self.stats.n_runs += 1

    def _emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        out, ended = within_answer(tokens, self.cfg.n_predict - self.stats.n_generated, self.eos, self.cfg.stop_at_eos)
        self.done = self.done or ended
        if out:
            timed_emission(self.stats, len(out), self.clock())
            self._emitted.append(Emitted(out, None if logprobs is None else logprobs[:len(out)]))
        if self.stats.n_generated >= self.cfg.n_predict:
            self.done = True

    def _spec_context(self) -> list[int]:
        """Accepted tokens up to sequence 0's end, then the speculation chain."""
        return self.accepted[:self.seq0_end] + [e.token for e in self.chain]

    def _prune_chain(self) -> None:
        self.chain = pruned_chain(self.chain, self.seq0_end, self.flights, self.accepted)

    def _cancel_useless(self) -> None:
        dead = useless_runs(self.flights, self.accepted)
        if dead:
            self.stats.n_cancelled += len(dead)
            self._cancel(dead)
            self._prune_chain()

    def _cancel_all(self) -> None:
        """Cancel every speculative run in flight and forget the prompt's runs not launched (the generation is over)."""
        self.pending.clear()
        self._cancel([rid for rid, fl in self.flights.items() if fl.speculative and not fl.cancelled])

    def _cancel(self, run_ids: list[int]) -> None:
        for rid in run_ids:
            self.flights[rid].cancelled = True
        if run_ids and self.cfg.cancel:
            self._out.append(Cancel(tuple(run_ids)))
