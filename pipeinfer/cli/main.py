"""Command line: `pipeinfer generate | models | launch | plot`.

Run ranks with `mpiexec -n N pipeinfer generate ...` (or `python -m mpi4py -m pipeinfer ...`). Any error
on any rank prints one line and ends the whole job with a non-zero status (MPI_Abort), never a hang.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .. import __version__
from ..core.errors import UserError
from ..core.files import prompt_path, read_prompt_file
from ..core.results import results_row, write_row
from ..core.sampling import SamplingParams
from ..core.topology import stage_group_sizes
from ..decide.genconfig import runs_as_iterative
from ..decide.batching import default_parallel_text
from .guard import StopSignals, die, mpi_rank, mpi_size, run_guarded
from ..wire.launcher import enter_workdir
from ..core.config import CONFIG_ENV, Config, cells_reserve, check_fits
from .options import (CheckedCommand, config_from_options, drafter_note, n_target_ranks, own_fields,
                      pipeline_options, supervision_options)
from .status import StatusLine

if TYPE_CHECKING:
    from ..frontend.access import Access



@click.group()
@click.version_option(__version__)
def main() -> None:
    """pipeinfer: PipeInfer (asynchronous pipelined speculation) for GGUF models on CPU clusters over MPI."""


@main.command(cls=CheckedCommand)
@pipeline_options
@click.option("-p", "--prompt", default=None, help="prompt text")
@click.option("-f", "--file", "prompt_file", default=None, help="prompt file (first line may be '# chat: true|false')")
@click.option("--prompt-name", default=None, help="a prompt from prompts/ by name (code, story, encyclopedia)")
@click.option("--chat/--no-chat", default=None,
              help="apply the model's chat template [default: yes for -p, the '# chat:' header for files]")
@click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(1), help="tokens to generate")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0), help="temperature; 0 is greedy")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--replay-ref", default=None, help="replay drafter: JSON output of an earlier --json run of the same prompt")
@click.option("--replay-accuracy", default=0.8, show_default=True, type=click.FloatRange(0, 1),
              help="replay drafter: probability that each proposal is the reference token")
@click.option("--replay-runner-up", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="replay drafter: probability that a wrong proposal's runner-up is the reference token (0: none)")
@click.option("--ignore-eos", is_flag=True, help="keep generating past end-of-generation tokens")
@click.option("--results", default=None, help="append one CSV row of results to this file")
@click.option("-q", "--quiet", is_flag=True, help="no statistics on stderr")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (text, tokens, stats) instead of streaming")
@click.option("--prompts", default=None,
              help="a file of prompts (one per line, or JSON lines): run them all, several at once; one JSON line each")
@click.option("--parallel", default=None, type=click.IntRange(1, 64),
              help=f"with --prompts: prompts generated at once [default: {default_parallel_text()}]")
@supervision_options("the generation")
@click.option("--resume-on-failure", is_flag=True, help="the same as --np/--hostfile's supervision (which it needs)")
def generate(**kw) -> None:
    """Generate text with the target model split across the MPI ranks."""
    run_guarded(_generate, kw)


@dataclass(frozen=True)
class GenerateArgs:
    """`pipeinfer generate`'s options: the run's configuration (what every rank gets), then what only the front
    end reads: the prompt and the output."""
    config: Config
    prompt: str | None
    prompt_file: str | None
    prompt_name: str | None
    chat: bool | None
    results: str | None
    quiet: bool
    as_json: bool
    prompts: str | None
    np: int | None
    hostfile: str | None
    resume_on_failure: bool
    rejoin: bool

    @classmethod
    def of(cls, kw: dict) -> GenerateArgs:
        supervised = kw["np"] or kw["hostfile"]
        config = config_from_options({**kw, "parallel": kw["parallel"] if kw["prompts"] else 1},
                                     sampling=SamplingParams(kw["temp"], kw["top_k"], kw["top_p"], kw["seed"]))
        if config.draft.drafter == "replay" and (kw["prompts"] or supervised):
            raise UserError("--drafter replay follows one reference answer: not with --prompts or --np/--hostfile")
        return cls(config, **own_fields(cls, kw, skip=("config",)))


@dataclass(frozen=True)
class Prompt:
    text: str          # as the user gave it (before any chat template)
    chat: bool | None  # apply the model's chat template (None: a file without a '# chat:' header, so no)
    name: str          # the prompt_name column of --results


def _generate(kw: dict) -> None:
    """Every rank: the options resolved and the prompt read; rank 0 tokenizes and streams the answer, then
    reports; the other ranks serve the pipeline."""
    if kw["np"] or kw["hostfile"] or kw["resume_on_failure"] or kw["rejoin"]:
        return _generate_supervised(GenerateArgs.of(kw))  # outside mpiexec: this process must not start MPI
    from mpi4py import MPI  # first: an error in the options then ends the whole job in one line (guard.die)

    from ..ranks.startup import run
    args = GenerateArgs.of(kw)
    config = args.config
    if args.quiet:
        from ..ranks.weights import set_quiet
        set_quiet(True)  # no weights transfer progress either
    if args.prompts:
        return _generate_batch(args)
    prompt = read_prompt(args)
    stop = StopSignals().install()  # Ctrl-C or SIGTERM: the text so far, the statistics, exit 0
    if MPI.COMM_WORLD.Get_rank() != 0:  # the other ranks serve the pipeline until the head ends it
        run(config)
        return
    head = HeadOutput(args, prompt)
    if mpi_size() > 1:
        _report_failures(args, prompt, head)
    try:
        res = run(config, lambda: head.prompt_tokens, prompt_text=prompt.text, chat=bool(prompt.chat),
                  on_tokens=head.on_tokens, on_progress=head.on_progress, should_stop=lambda: stop.requested)
    finally:
        head.close_status()
    status = f"stopped: {stop.signal_name}" if stop.requested else "ok"
    head.end_text(res.tokens, ranges=[[r.start, r.end] for r in res.ranges], threads=res.threads,
                  stats=res.stats.to_dict(), peak_rss_mb=res.peak_rss_mb, status=status)
    if stop.requested:
        print(f"[pipeinfer] stopped by {stop.signal_name} after {len(res.tokens)} tokens", file=sys.stderr, flush=True)
    if not args.quiet:
        _print_report(config, res)
    if args.results:
        write_row(args.results, results_row(config, res.ranges, prompt.name, res.stats, res.peak_rss_mb,
                                              status=status, threads=res.threads))


def _generate_supervised(args: GenerateArgs) -> None:
    """--np N / --hostfile HOSTS outside mpiexec: the generation survives a lost rank (resume.py)."""
    from ..supervisor.resume import batch_supervised, generate_supervised
    if not (args.np or args.hostfile):
        raise UserError("--resume-on-failure and --rejoin need --np N or --hostfile HOSTS, run without mpiexec: the "
                        "process that resumes must outlive the MPI job")
    from ..supervisor.placement import placement
    where = placement(args.np, args.hostfile, args.config)
    stop = StopSignals().install()
    if args.prompts:
        return batch_supervised(args, where, stop)
    generate_supervised(args, where, read_prompt(args), stop)


def _generate_batch(args: GenerateArgs) -> None:
    """--prompts FILE on every rank: rank 0 runs the batch (batch.py), the others serve the pipeline."""
    from mpi4py import MPI

    from ..ranks.startup import open_session
    from ..feeders.batch import run_batch
    if args.prompt or args.prompt_file or args.prompt_name or args.as_json:
        raise UserError("--prompts FILE replaces -p/-f/--prompt-name and prints JSON lines (no --json)")
    if args.config.mode == "speculative":
        raise UserError("--prompts runs iterative or pipeinfer mode (several generations at once)")
    stop = StopSignals().install()
    if MPI.COMM_WORLD.Get_rank() != 0:
        open_session(args.config)
        return
    run_batch(args, stop)


def read_prompt(args: GenerateArgs) -> Prompt:
    """The one prompt of -p, -f or --prompt-name; a -p prompt is a user message when the model has a template,
    a file says so in its first line."""
    if len([x for x in (args.prompt, args.prompt_file, args.prompt_name) if x]) != 1:
        raise UserError("give exactly one of -p/--prompt, -f/--file, --prompt-name")
    if args.prompt is not None:
        return Prompt(args.prompt, True if args.chat is None else args.chat, args.prompt_name or "")
    path = args.prompt_file or str(prompt_path(args.prompt_name))
    if not Path(path).is_file():
        raise UserError(f"prompt file not found: {path}")
    text, file_chat = read_prompt_file(path)
    return Prompt(text, file_chat if args.chat is None else args.chat, args.prompt_name or Path(path).stem)


class HeadOutput:
    """Rank 0's side of a generation: the prompt as tokens, the answer streamed to stdout (kept for --json),
    the status line, and the tokens and statistics so far that a failure report needs."""

    def __init__(self, args: GenerateArgs, prompt: Prompt):
        from concurrent.futures import ThreadPoolExecutor

        from ..engine.stagefile import check_splittable, read_info
        # clear errors for a non-GGUF or a foreign architecture before llama.cpp sees the file
        check_splittable(read_info(args.config.model), n_target_ranks(args.config))
        # the tokenizer loads while the ranks start (0.2-0.5 s; it is C code that releases the GIL): the prompt's
        # tokens are needed when the stages are loaded, not before (llama-cli also tokenizes after its load)
        pool = ThreadPoolExecutor(1, thread_name_prefix="pipeinfer-tokenizer")
        self._tokenized = pool.submit(self._tokenize, args.config, prompt)
        pool.shutdown(wait=False)
        self.as_json = args.as_json
        self.tokens: list[int] = []
        self.stats = None  # the Stats of the last progress report
        self.status = None
        if not args.quiet and not args.as_json:
            self.status = StatusLine.for_streams(sys.stdout, sys.stderr, under_mpiexec=mpi_size() > 1)

    @staticmethod
    def _tokenize(config: Config, prompt: Prompt):
        """(Tokenizer, the prompt's tokens, a StreamDecoder), or UserError when the prompt does not fit."""
        from ..engine.tokenizer import StreamDecoder, Tokenizer, encode_prompt
        tok = Tokenizer(config.model)
        tokens = encode_prompt(tok, prompt.text, bool(prompt.chat))
        check_fits(config, len(tokens), config.serving.n_predict, n_target_ranks(config))
        return tok, tokens, StreamDecoder(tok)

    @property
    def tok(self):
        return self._tokenized.result()[0]

    @property
    def prompt_tokens(self) -> list[int]:
        """The prompt's tokens, waiting for the tokenizer (its UserError raised here)."""
        return self._tokenized.result()[1]

    @property
    def dec(self):
        return self._tokenized.result()[2]

    def n_prompt(self) -> int:
        """The prompt's tokens counted, 0 before the tokenizer has them or when it failed (a failure's row)."""
        done = self._tokenized.done() and self._tokenized.exception() is None
        return len(self.prompt_tokens) if done else 0

    def on_tokens(self, tokens: list[int]) -> None:
        self.tokens += tokens
        if not self.as_json:
            sys.stdout.write(self.dec.feed(tokens))
            sys.stdout.flush()

    def on_progress(self, stats, n_in_flight: int) -> None:
        self.stats = stats
        if self.status is not None:
            self.status(stats, n_in_flight)

    def close_status(self) -> None:
        if self.status is not None:
            self.status.close()

    def end_text(self, tokens: list[int], **more) -> None:
        """The answer's end: its line on stdout finished, or with --json one object (text, tokens, the prompt's
        tokens, then `more`); a line's end alone when the prompt never tokenized (its error says why)."""
        if self._tokenized.exception() is not None:
            sys.stdout.write("\n")
        elif self.as_json:
            print(json.dumps({"text": self.tok.decode(tokens), "tokens": tokens, "prompt_tokens": self.prompt_tokens,
                              **more}))
        else:
            sys.stdout.write(self.dec.flush() + "\n")
        sys.stdout.flush()


def _report_failures(args: GenerateArgs, prompt: Prompt, head: HeadOutput) -> None:
    """When a rank is lost or goes silent, the text so far ends its line and the --results row says so; the
    liveness hub writes that row itself when rank 0 cannot (mpiexec killed it, or it is the silent one)."""
    from ..core.metrics import Stats
    from ..wire.liveness import set_failure_hook, set_row_provider

    def row_so_far(status: str = "ok") -> dict:
        return results_row(args.config, [None] * n_target_ranks(args.config), prompt.name,
                            head.stats or Stats(n_prompt=head.n_prompt()), status=status)

    def on_failure(reason: str) -> None:
        head.close_status()
        head.end_text(head.tokens, status=f"failed: {reason}")
        if args.results:
            write_row(args.results, row_so_far(f"failed: {reason}"))
    set_failure_hook(on_failure)
    set_row_provider(lambda: (args.results, row_so_far()) if args.results else None)


def _where(config: Config, n_stages: int) -> str:
    """Where a served pipeline runs, for the banner: its ranks, tensor groups, and one stage's PipeInfer as iterative
    (ranks/startup._head_mode)."""
    sizes = stage_group_sizes(config.stage.groups, config.stage.tensor_parallel, n_stages)
    text = f"{sum(sizes)} rank(s)" + (f", stages of tensor groups of {','.join(map(str, sizes))}" if max(sizes) > 1 else "")
    if runs_as_iterative(config.mode, n_stages, config.draft.at):
        text += "; one stage: runs as iterative"
    return text


def _print_report(config: Config, res) -> None:
    """The statistics on stderr after the text: mode, cutoffs, the layers of each rank, then Stats.report."""
    threads = res.threads or [None] * len(res.ranges)
    groups = stage_group_sizes(config.stage.groups, config.stage.tensor_parallel, len(res.ranges))
    ranges = ", ".join((f"stage {i} (a tensor group of {g} ranks)" if g > 1 else f"rank {i}") + f": layers {r}" +
                       (f" on {t} thread{'s' * (t != 1)}" if t else "")
                       for i, (r, t, g) in enumerate(zip(res.ranges, threads, groups)))
    p_accept = config.speculation.p_accept
    cutoff = {"iterative": "", "speculative": f", cutoff -pa {p_accept:g}"}.get(
        config.mode, f", cutoff -pa {p_accept:g} -pr {res.p_recovery:g}")
    print(f"\n[pipeinfer] mode {config.mode}{cutoff}, {sum(groups)} rank(s): {ranges}", file=sys.stderr)
    one_stage = runs_as_iterative(config.mode, len(res.ranges), config.draft.at)
    print(f"[pipeinfer] {'drafter: none (one pipeline stage)' if one_stage else drafter_note(config)}", file=sys.stderr)
    print(res.stats.report(), file=sys.stderr)


@main.command(cls=CheckedCommand)
@pipeline_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (0.0.0.0: every interface)")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--alias", "aliases", multiple=True, metavar="NAME",
              help="a name of the model for clients, listed in /v1/models and named in the replies that ask for it "
                   "(repeatable; the first is the model's id) [default id: the registry name or the file's stem]; "
                   "requests for any other name are answered too")
@click.option("-n", "--n-predict", default=256, show_default=True, type=click.IntRange(1),
              help="max_tokens of a request that gives none (within the context)")
@click.option("--max-queue", default=16, show_default=True, type=click.IntRange(1),
              help="requests waiting beyond those generating; more get 503 with Retry-After")
@click.option("--results", default=None, help="append one CSV row per request to this file")
@click.option("--parallel", default=None, type=click.IntRange(1, 64),
              help=f"requests generated at once [default: {default_parallel_text()}; 1: one after another]")
@supervision_options("every request")
@click.option("--ignore-eos", is_flag=True, help="generate past the end-of-sequence token (every answer max_tokens "
              "long: load tests and benchmarks)")
@click.option("--webui/--no-webui", default=True, show_default=True,
              help="the cluster's live page (and a chat) at / (GET /state: its JSON)")
@click.option("--api-key", "api_key", multiple=True, metavar="KEY", envvar="PIPEINFER_API_KEY", help="require "
              "`Authorization: Bearer KEY` (or x-api-key) on every route but /health and the page (/, /static/*: no "
              "data; it sends the key typed into it) (repeatable; --api-key-file or $PIPEINFER_API_KEY keep keys "
              "out of `ps`)")
@click.option("--api-key-file", default=None, metavar="FILE", help="API keys, one a line (# comments); chmod 600 it")
@click.option("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
@click.option("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
@click.option("--max-body-bytes", default=4 * 2**20, show_default=True, type=click.IntRange(1024),
              help="largest request body; larger ones get 413")
@click.option("--max-connections", default=128, show_default=True, type=click.IntRange(1),
              help="requests in progress at once (/health and /metrics aside); more get 503 with Retry-After")
@click.option("--stalled-client-timeout", default=60.0, show_default=True, type=click.FloatRange(0.1),
              help="seconds a client may take none of its answer before it is dropped (its generations cancelled)")
def serve(**kw) -> None:
    """Serve the model over an OpenAI-compatible HTTP API from rank 0 (streaming and not)."""
    run_guarded(_serve, kw)


@dataclass(frozen=True)
class ServeArgs:
    """`pipeinfer serve`'s options: the run's configuration (what every rank gets), then the HTTP server's."""
    config: Config
    model_name: str | None  # -m as given: the model's id, unless --alias
    host: str
    port: int
    aliases: tuple[str, ...]
    max_queue: int
    results: str | None
    np: int | None
    hostfile: str | None
    rejoin: bool
    webui: bool = True
    access: Access | None = None   # keys and limits
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @classmethod
    def of(cls, kw: dict) -> ServeArgs:
        if kw["drafter"] == "replay":
            raise UserError("--drafter replay is a benchmark instrument for generate, not for serve")
        from ..frontend.access import access_of
        config = config_from_options(kw, sampling=SamplingParams())
        return cls(config, kw["model"], access=access_of(kw),
                   **own_fields(cls, kw, skip=("config", "model_name", "access")))


def _serve(kw: dict) -> None:
    if kw["np"] or kw["hostfile"]:
        return _supervise(ServeArgs.of(kw))  # outside mpiexec: this process must not start MPI
    if kw["rejoin"]:
        raise UserError("--rejoin needs --np N or --hostfile HOSTS (a supervised server, run without mpiexec)")
    from mpi4py import MPI  # first: an error in the options then ends the whole job in one line (guard.die)

    args = ServeArgs.of(kw)

    from ..ranks.startup import open_session
    if MPI.COMM_WORLD.Get_rank() == 0:
        _check_port_free(args.host, args.port)  # before the models load
    # Ctrl-C or SIGTERM: rank 0 stops the server (below); a stage rank ends when the head shuts the pipeline down
    stop = StopSignals().install()
    session = open_session(args.config)
    if session is None:
        return
    from ..feeders.generator import Generator

    def on_done(job, stats, finish):
        _served_row(args, session.ranges, job, stats, finish)

    generator = Generator(session, args.max_queue, on_done=on_done)
    generator.start()
    try:
        _serve_http(args, generator, session.tok, _where(args.config, len(session.ranges)), stop)
    finally:
        print("[pipeinfer] stopping: finishing the request in progress, then shutting the pipeline down",
              file=sys.stderr, flush=True)
        generator.stop()
        session.close()
    if generator.fatal:
        raise UserError(f"the pipeline failed: {generator.fatal}")


@main.command(hidden=True)
@click.argument("socket_path")
def attach(socket_path: str) -> None:
    """Every rank of a supervised job (supervisor/supervisor.py starts it): the configuration from PIPEINFER_CONFIG;
    rank 0 takes its requests from the supervisor's socket, the others serve the pipeline."""
    run_guarded(_attach, {"socket_path": socket_path})


def _attach(kw: dict) -> None:
    from mpi4py import MPI  # noqa: F401  first: an error then ends the whole job in one line (guard.die)

    from ..ranks.startup import open_session
    from ..feeders.attach import run_attached
    try:
        config = Config.from_json(os.environ[CONFIG_ENV])
    except (KeyError, ValueError) as e:
        raise UserError(f"pipeinfer attach: no configuration in {CONFIG_ENV} ({e}); the supervisor starts this "
                        "command (serve or generate with --np/--hostfile)") from None
    stop = StopSignals().install()
    session = open_session(config)
    if session is None:
        return
    try:
        run_attached(session, kw["socket_path"], stop)
    finally:
        session.close()


def _supervise(args: ServeArgs) -> None:
    """`serve --np N` / `--hostfile HOSTS` outside mpiexec: the HTTP server here, the pipeline a child job that is
    re-formed on the slots that remain when a rank is lost (supervisor.py)."""
    from ..engine.tokenizer import Tokenizer
    from ..supervisor.inflight import resumed_status
    from ..supervisor.placement import placement
    from ..supervisor.supervisor import Supervisor
    where = placement(args.np, args.hostfile, args.config)
    slots = where.slots
    _check_port_free(args.host, args.port)
    stop = StopSignals().install()
    tok = Tokenizer(args.config.model)

    def on_done(job, stats, finish, n_resumes=0):
        _served_row(args, [None] * len(sup.slots), job, stats, finish, resumed_status(n_resumes))
    sup = Supervisor(slots, where.config, tok,
                     on_done=on_done, footprint=where.footprint, rejoin=args.rejoin, draft=where.draft,
                     on_fatal=lambda why: stop.request("the pipeline failed"))
    try:
        sup.start()
        draft = f" and the draft on {where.draft.name}" if where.draft else ""
        _serve_http(args, sup, tok, f"{len(slots)} rank(s){draft} in a supervised job", stop)
    finally:
        print("[pipeinfer] stopping: the pipeline's job finishes the requests in progress, then shuts down",
              file=sys.stderr, flush=True)
        sup.stop()
    if sup.fatal:
        raise UserError(f"the pipeline failed: {sup.fatal}")


def _serve_http(args: ServeArgs, generator, tok, ranks: str, stop: StopSignals) -> None:
    """The OpenAI-compatible app over `generator` (feeders/generator.Generator, or the Supervisor) on --host/--port until a
    stop signal; `ranks` says where the pipeline runs. A stop asked for while the models loaded: no server."""
    import uvicorn

    from ..engine.tokenizer import apply_chat
    from ..frontend.app import ServeConfig, create_app
    model_id = _model_id(args)
    config = args.config
    app = create_app(ServeConfig(model_id, config.stage.n_ctx, cells_reserve(config, n_target_ranks(config)),
                                 config.serving.n_predict, webui=args.webui, aliases=args.aliases),
                     generator, tok, lambda messages: apply_chat(tok, messages), access=args.access)
    if stop.requested:
        return
    from ..frontend.access import exposure_warning
    scheme, keyed = ("https" if args.ssl_certfile else "http"), bool(args.access.api_keys)
    print(f"[pipeinfer] serving '{model_id}' on {scheme}://{args.host}:{args.port}/v1 (mode {config.mode}, {ranks}, "
          f"{generator.parallel} request(s) at once{', API key required' if keyed else ''}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    if warning := exposure_warning(args.host, args.access.api_keys):
        print(warning, file=sys.stderr, flush=True)
    backstop = args.access.max_connections + 16 if args.access.max_connections else None  # idle connections too
    _http_server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=DRAIN_TIMEOUT_S, ssl_certfile=args.ssl_certfile,
                                ssl_keyfile=args.ssl_keyfile, limit_concurrency=backstop), stop).run()


def _served_row(args: ServeArgs, ranges, job, stats, finish: str, status: str = "ok") -> None:
    """A served request's --results row, if asked for."""
    if not args.results:
        return
    try:
        write_row(args.results, results_row(args.config, ranges, f"serve:{finish}", stats, status=status))
    except UserError as e:  # the answer went out; a row that cannot be written must not stop the server
        print(f"[serve] {job.request_id}: {e}", file=sys.stderr, flush=True)


# a stop (Ctrl-C, SIGTERM, Slurm's signal before the time limit) lets the answers in flight complete for this long;
# a second Ctrl-C ends them at once
DRAIN_TIMEOUT_S = 240.0


def _http_server(config, stop: StopSignals):
    """uvicorn's server, ended by every stop signal: uvicorn catches SIGINT and SIGTERM itself while it runs (the
    liveness hub is told at once all the same), a stop signal it does not catch (SIGUSR1) sets its should_exit."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)  # first: a second Ctrl-C still forces uvicorn's exit, as it would
            stop.on_signal(sig)

    server = Server(config)
    stop.then = lambda: setattr(server, "should_exit", True)
    return server


def _check_port_free(host: str, port: int) -> None:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _model_id(args: ServeArgs) -> str:
    """The model's id: the first --alias, else a registry name as it is, else the file's stem."""
    from ..engine.models import DEFAULT_TARGET
    name = args.model_name or DEFAULT_TARGET
    is_file = Path(name).suffix.lower() == ".gguf" or Path(name).exists()
    return args.aliases[0] if args.aliases else (Path(name).stem if is_file else name)


# ------------------------------------------------------------------------------------ --results rows
# spellings that once meant something else here, or mean something else in llama.cpp: a one-line hint, not a run
_OLD_SPELLINGS = {
    "-np": "-np is not an option: --np N runs N ranks as a supervised job, --max-branches N sets the draft tree's "
           "branches (llama.cpp's -np, parallel slots, is --parallel here)",
}


def _refuse_old_spellings(argv: list[str]) -> None:
    for arg in argv:
        if arg == "--":
            return
        hint = _OLD_SPELLINGS.get(arg.split("=", 1)[0])
        if hint:
            raise click.UsageError(hint)


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


def entry() -> None:
    """The console entry point: click, with a usage error as one line like every other user error
    (printed once, by rank 0; every rank exits with 2)."""
    enter_workdir()  # a rank `launch` started in / (MPICH): back into the folder the launch ran in
    try:
        _refuse_old_spellings(sys.argv[1:])
        code = main.main(prog_name="pipeinfer", standalone_mode=False)
    except _NO_ARGS_IS_HELP as e:  # bare `pipeinfer`: the help, as click shows it
        e.show()
        sys.exit(e.exit_code)
    except click.UsageError as e:
        hint = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
        if mpi_rank() == 0:
            print(f"pipeinfer: error: {e.format_message()}{hint}", file=sys.stderr, flush=True)
        elif mpi_size() > 1:
            # every rank sees the same error; the others' non-zero exit makes mpi4py abort the job, which
            # could kill rank 0 before its line is written: give rank 0 the time to print and exit first
            time.sleep(3)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        die(e.format_message(), e.exit_code)
    except click.Abort:
        die("interrupted", 130)
    sys.exit(code if isinstance(code, int) else 0)


def _check_serve(kw: dict):
    """ServeArgs.of, and for a supervised server where its job would run (supervisor.Placement, else None)."""
    args = ServeArgs.of(kw)
    if args.np or args.hostfile:
        from ..supervisor.placement import placement
        return placement(args.np, args.hostfile, args.config)
    return None


generate.check = GenerateArgs.of
serve.check = _check_serve


def _register() -> None:
    from .doctor_cmd import doctor_cmd
    from .launch import launch_cmd
    from .models_cmd import models_group
    from .plot import plot_cmd
    from .plan_cmd import plan_cmd
    from .twin_cmds import profile_cmd, simulate_cmd
    main.add_command(simulate_cmd)
    main.add_command(plan_cmd)
    main.add_command(profile_cmd)
    main.add_command(models_group)
    main.add_command(launch_cmd)
    main.add_command(doctor_cmd)
    main.add_command(plot_cmd)


_register()
