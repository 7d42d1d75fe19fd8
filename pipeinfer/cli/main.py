"""Command line: `pipeinfer generate | models | launch | plot`.

Run ranks with `mpiexec -n N pipeinfer generate ...` (or `python -m mpi4py -m pipeinfer ...`). Any error
on any rank prints one line and ends the whole job with a non-zero status (MPI_Abort), never a hang.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .. import __version__
from ..core.errors import UserError
from ..core.files import prompt_path, read_prompt_file
from ..core.verify import SamplingParams
from ..engine.kernels import DEFAULT_DRAFT_MAX, DEFAULT_KERNELS, KERNELS
from ..ranks.head import MODES, GenConfig
from ..spec.drafter import DRAFT_HEAD_AUTO, Cutoffs
from .guard import die, installed, mpi_rank, mpi_size, run_guarded
from .status import StatusLine


@click.group()
@click.version_option(__version__)
def main() -> None:
    """pipeinfer: PipeInfer (asynchronous pipelined speculation) for GGUF models on CPU clusters over MPI."""


# options of every command that loads the pipeline (generate, serve)
PIPELINE_OPTIONS = [
    click.option("-m", "--model", default=None, help="target GGUF path or registry name [default: qwen2.5-coder-1.5b]"),
    click.option("--mode", type=click.Choice(MODES), default="pipeinfer", show_default=True),
    click.option("--layer-split", default=None, help="fraction of layers per rank, rank 0 first, e.g. 0.2,0.4,0.4 [default: even]"),
    click.option("-t", "--threads", default=None, help="threads per rank for single-token decodes: one value or a,b,c"),
    click.option("-tb", "--threads-batch", default=None, help="threads per rank for batch decodes [default: --threads]"),
    click.option("-c", "--ctx-size", default=4096, show_default=True, type=click.IntRange(16), help="KV cache size per stage"),
    click.option("-b", "--batch-size", default=512, show_default=True, type=click.IntRange(1), help="largest batch per decode"),
    click.option("--draft", default=None, help="draft GGUF (same vocabulary as the target)"),
    click.option("--drafter", type=click.Choice(["model", "ngram", "replay"]), default=None,
                  help="[default: model if --draft (on the default target: gemma3-270m when installed) else ngram]; "
                       "replay is a benchmark instrument (see README)"),
    click.option("--draft-vocab", type=click.Choice(["auto", "same", "translate"]), default="auto", show_default=True,
                  help="draft model vocabulary: same as the target (checked), or translate through text; auto picks"),
    click.option("--draft-at", type=click.Choice(["auto", "head", "thread", "rank"]), default="auto", show_default=True,
                  help="where the draft runs: head (in series with rank 0's stage), thread (beside it, in rank 0), rank "
                       "(an MPI rank of its own: the last; start one more rank than the target's stages); auto: thread "
                       "for a draft model in pipeinfer mode with -np 1, else head"),
    click.option("--draft-threads", default=None, type=click.IntRange(1),
                  help="threads of the draft model [default: rank 0's --threads; on its own rank: cores / ranks]"),
    click.option("--draft-head", default="auto", show_default=True, callback=lambda c, p, v: _draft_head(v),
                  help=f"tokens the draft model's output projection keeps, the most frequent first: a number, full, or auto "
                       f"({DRAFT_HEAD_AUTO:,}); the draft proposes only those, the output stays exact"),
    click.option("--draft-max", default=None, type=click.IntRange(1, 64),
                  help=f"max draft tokens per speculative micro-batch [default: up to {DEFAULT_DRAFT_MAX}, within the exact "
                       f"batch limit]"),
    click.option("--micro-batch", type=click.Choice(["auto", "fixed"]), default="auto", show_default=True,
                  help="PipeInfer's draft tokens per micro-batch: auto picks 1..--draft-max from the decode costs measured "
                       "at start-up and the running acceptance; fixed always asks for --draft-max"),
    click.option("-pa", "--p-accept", default=0.5, show_default=True, type=click.FloatRange(0, 1), help="draft confidence cutoff"),
    click.option("-ps", "--p-split", default=0.1, show_default=True, type=click.FloatRange(0, 1), help="confidence to open a tree branch"),
    click.option("-pr", "--p-recovery", default="auto", show_default=True, callback=lambda c, p, v: _auto_or_float(v, p),
                  help="cutoff rise per micro-batch since the last acceptance; auto: 0.5 / (ranks - 1)"),
    click.option("-pd", "--p-decay", default=0.0, show_default=True, type=click.FloatRange(0), help="cutoff fall per failed draft while idle"),
    click.option("-np", "--max-branches", default=1, show_default=True, type=click.IntRange(1, 16), help="max tree branches per run"),
    click.option("--max-in-flight", default=8, show_default=True, type=click.IntRange(1, 255), help="max speculative runs in flight"),
    click.option("--cancel/--no-cancel", default=True, help="early inference cancellation"),
    click.option("--continuous/--no-continuous", default=True, help="more than one speculative run in flight"),
    click.option("--quiet-first/--no-quiet-first", default=True,
                  help="with the draft in a thread of rank 0, leave it idle while the first token after the prompt is "
                       "computed (README, The draft beside the pipeline)"),
    click.option("--kernels", type=click.Choice(KERNELS), default=DEFAULT_KERNELS, show_default=True,
                  help="repack: repacked weights + flash attention (exact to the batch limit measured at load); "
                       "no-repack: exact to larger batches, slower; fast: llama.cpp's defaults, batch-dependent logits "
                       "(README, Exactness)"),
    click.option("--fast-kernels", is_flag=True, help="same as --kernels fast"),
    click.option("--poll-us", default=500, show_default=True, type=click.IntRange(0), help="sleep between message probes while waiting"),
    click.option("--stall-timeout", default=60.0, show_default=True, type=click.FloatRange(0),
                  help="seconds without a heartbeat from a rank before the job ends naming it (0: only lost ranks "
                       "are detected; README, Failure behaviour)"),
]


def pipeline_options(f):
    for option in reversed(PIPELINE_OPTIONS):
        f = option(f)
    return f


@main.command()
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
@click.option("--ignore-eos", is_flag=True, help="keep generating past end-of-generation tokens")
@click.option("--results", default=None, help="append one CSV row of results to this file")
@click.option("-q", "--quiet", is_flag=True, help="no statistics on stderr")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (text, tokens, stats) instead of streaming")
def generate(**kw) -> None:
    """Generate text with the target model split across the MPI ranks."""
    run_guarded(_generate, kw)


def _generate(kw) -> None:
    from mpi4py import MPI

    from ..ranks.startup import run
    rank = MPI.COMM_WORLD.Get_rank()
    if kw["drafter"] == "replay" and not kw["replay_ref"]:
        raise UserError("--drafter replay needs --replay-ref FILE.json (from an earlier --json run)")
    model, draft, drafter, gen = _pipeline_config(
        kw, n_predict=kw["n_predict"], sampling=SamplingParams(kw["temp"], kw["top_k"], kw["top_p"], kw["seed"]),
        stop_at_eos=not kw["ignore_eos"])
    prompt_tokens, prompt_name, text = None, kw["prompt_name"] or "", None
    sources = [x for x in ("prompt", "prompt_file", "prompt_name") if kw[x]]
    if len(sources) != 1:
        raise UserError("give exactly one of -p/--prompt, -f/--file, --prompt-name")
    chat = kw["chat"]
    if kw["prompt"] is not None:
        text = kw["prompt"]
        chat = True if chat is None else chat  # a -p prompt is a user message when the model has a template
    else:
        path = kw["prompt_file"] or str(prompt_path(kw["prompt_name"]))
        if not Path(path).is_file():
            raise UserError(f"prompt file not found: {path}")
        text, file_chat = read_prompt_file(path)
        chat = file_chat if chat is None else chat
        prompt_name = prompt_name or Path(path).stem
    stream = None
    user_text = text
    so_far = {"tokens": [], "stats": None}  # rank 0: what a failure report needs (liveness hook below)
    if rank == 0:
        from ..engine.stagefile import check_splittable, read_info
        from ..engine.tokenizer import StreamDecoder, Tokenizer, apply_chat
        check_splittable(read_info(model), _n_target_ranks(kw))  # clear errors for a non-GGUF or a foreign architecture
                                                         # before llama.cpp sees the file
        tok = Tokenizer(model)
        if chat:
            text = apply_chat(tok, text)
        prompt_tokens = tok.encode(text)
        reserve = _cells_reserve(kw)
        need = len(prompt_tokens) + kw["n_predict"] + reserve
        if need > kw["ctx_size"]:
            raise UserError(f"prompt of {len(prompt_tokens)} tokens + {kw['n_predict']} to generate + {reserve} for "
                            f"runs in flight does not fit the context of {kw['ctx_size']} tokens (-c/--ctx-size)")
        dec = StreamDecoder(tok)

        def stream(tokens):
            so_far["tokens"] += tokens
            if not kw["as_json"]:
                sys.stdout.write(dec.feed(tokens))
                sys.stdout.flush()
    progress = None
    if rank == 0 and not kw["quiet"] and not kw["as_json"]:
        progress = StatusLine.for_streams(sys.stdout, sys.stderr, under_mpiexec=mpi_size() > 1)

    def on_progress(stats, n_in_flight):
        so_far["stats"] = stats
        if progress is not None:
            progress(stats, n_in_flight)
    if rank == 0 and mpi_size() > 1:
        from ..core.metrics import Stats
        from ..wire.liveness import set_failure_hook, set_row_provider

        def row_so_far(status: str = "ok") -> dict:
            return _row(kw, _draft_label(kw, drafter, draft), model, [None] * _n_target_ranks(kw), prompt_name,
                        so_far["stats"] or Stats(n_prompt=len(prompt_tokens)), status=status)

        def on_failure(reason: str) -> None:
            """A rank was lost or went silent: the text so far ends its line, the --results row says so."""
            if progress is not None:
                progress.close()
            if kw["as_json"]:
                print(json.dumps({"text": tok.decode(so_far["tokens"]), "tokens": so_far["tokens"],
                                  "prompt_tokens": prompt_tokens, "status": f"failed: {reason}"}))
            else:
                sys.stdout.write(dec.flush() + "\n")
            sys.stdout.flush()
            if kw["results"]:
                _write_row(kw, row_so_far(f"failed: {reason}"))
        set_failure_hook(on_failure)
        # the liveness hub writes this row itself when rank 0 cannot (mpiexec killed it, or it is the silent one)
        set_row_provider(lambda: (kw["results"], row_so_far()) if kw["results"] else None)
    opts = _run_options(kw, model, draft, drafter, gen, on_progress=on_progress, prompt_tokens=prompt_tokens,
                        replay_ref=kw["replay_ref"], replay_accuracy=kw["replay_accuracy"], prompt_text=user_text,
                        chat=bool(chat), on_tokens=stream)
    try:
        res = run(opts)
    finally:
        if progress is not None:
            progress.close()
    if rank != 0:
        return
    if kw["as_json"]:
        print(json.dumps({"text": tok.decode(res.tokens), "tokens": res.tokens, "prompt_tokens": prompt_tokens,
                          "ranges": [[r.start, r.end] for r in res.ranges], "stats": res.stats.to_dict(),
                          "peak_rss_mb": res.peak_rss_mb}))
    else:
        sys.stdout.write(dec.flush() + "\n")
        sys.stdout.flush()
    if not kw["quiet"]:
        ranges = ", ".join(f"rank {i}: layers {r}" for i, r in enumerate(res.ranges))
        cutoff = {"iterative": "", "speculative": f", cutoff -pa {gen.cut.p_accept:g}"}.get(
            gen.mode, f", cutoff -pa {gen.cut.p_accept:g} -pr {res.p_recovery:g}")
        print(f"\n[pipeinfer] mode {gen.mode}{cutoff}, {len(res.ranges)} rank(s): {ranges}", file=sys.stderr)
        print(res.stats.report(), file=sys.stderr)
    if kw["results"]:
        _append_csv(kw, _draft_label(kw, drafter, draft), model, res.ranges, prompt_name, res.stats, res.peak_rss_mb)


def _pipeline_config(kw, *, n_predict: int, sampling: SamplingParams, stop_at_eos: bool):
    """(target path, draft path or None, drafter kind, GenConfig) from the pipeline options."""
    from ..engine.models import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    model = str(resolve_model(kw["model"] or DEFAULT_TARGET))
    draft = str(resolve_model(kw["draft"])) if kw["draft"] else None
    if draft is None and kw["drafter"] is None and kw["model"] in (None, DEFAULT_TARGET) and kw["mode"] != "iterative":
        draft = installed(DEFAULT_DRAFT)  # the default demo: Qwen target, Gemma draft through text translation
    drafter = kw["drafter"] or ("model" if draft else "ngram")
    if kw["draft_at"] == "auto":  # measured: results/bench_draft_layout.csv (README, The draft beside the pipeline)
        beside = kw["mode"] == "pipeinfer" and drafter in ("model", "replay") and kw["max_branches"] == 1
        kw["draft_at"] = "thread" if beside else "head"
    if kw["draft_at"] != "head" and kw["max_branches"] > 1:
        raise UserError(f"--draft-at {kw['draft_at']} drafts chains: -np/--max-branches must be 1")
    if kw["draft_at"] == "rank" and drafter == "ngram" and kw["mode"] != "iterative":
        raise UserError("--draft-at rank: the draft rank has no draft model (give --draft MODEL.gguf; the n-gram "
                        "drafter costs nothing and runs on the head)")
    gen = GenConfig(
        mode=kw["mode"], n_predict=n_predict, sampling=sampling,
        cut=Cutoffs(kw["p_accept"], kw["p_split"], kw["draft_max"], kw["max_branches"]),
        p_recovery=kw["p_recovery"], p_decay=kw["p_decay"], cancel=kw["cancel"], continuous=kw["continuous"],
        quiet_first=kw["quiet_first"], n_batch=kw["batch_size"], stop_at_eos=stop_at_eos, adaptive_draft=kw["micro_batch"] == "auto")
    return model, draft, drafter, gen


def _run_options(kw, model, draft, drafter, gen, **more):
    from ..ranks.startup import RunOptions
    return RunOptions(model=model, gen=gen, layer_split=kw["layer_split"], threads=kw["threads"],
                      threads_batch=kw["threads_batch"], n_ctx=kw["ctx_size"], draft=draft, drafter=drafter,
                      max_in_flight=kw["max_in_flight"], poll_s=kw["poll_us"] / 1e6,
                      kernels="fast" if kw["fast_kernels"] else kw["kernels"], draft_vocab=kw["draft_vocab"],
                      stall_timeout=kw["stall_timeout"], draft_at=kw["draft_at"], draft_threads=kw["draft_threads"],
                      draft_head=kw["draft_head"],
                      **more)


def _cells_reserve(kw) -> int:
    """KV cells the runs in flight may take beyond the prompt and the answer (auto --draft-max: at most the default)."""
    from ..core.kvplan import cells_reserve, plan_partitions
    n_part = 0 if kw["mode"] == "iterative" else plan_partitions(kw["max_branches"], kw["max_in_flight"])[0]
    return cells_reserve(n_part, kw["draft_max"] or DEFAULT_DRAFT_MAX)


@main.command()
@pipeline_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (0.0.0.0: every interface)")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--alias", default=None, help="model id clients ask for [default: the registry name or the file's stem]")
@click.option("-n", "--n-predict", default=256, show_default=True, type=click.IntRange(1),
              help="max_tokens of a request that gives none (within the context)")
@click.option("--max-queue", default=16, show_default=True, type=click.IntRange(1),
              help="requests waiting beyond the one generating; more get 503 with Retry-After")
@click.option("--results", default=None, help="append one CSV row per request to this file")
def serve(**kw) -> None:
    """Serve the model over an OpenAI-compatible HTTP API from rank 0 (streaming and not)."""
    run_guarded(_serve, kw)


def _serve(kw) -> None:
    import signal

    from mpi4py import MPI

    from ..ranks.startup import open_session
    if kw["drafter"] == "replay":
        raise UserError("--drafter replay is a benchmark instrument for generate, not for serve")
    rank = MPI.COMM_WORLD.Get_rank()
    model, draft, drafter, gen = _pipeline_config(kw, n_predict=kw["n_predict"], sampling=SamplingParams(),
                                                  stop_at_eos=True)
    if rank == 0:
        _check_port_free(kw["host"], kw["port"])  # before the models load
    else:  # a stage rank ends when the head shuts the pipeline down, not on the terminal's Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    session = open_session(_run_options(kw, model, draft, drafter, gen))
    if session is None:
        return
    import uvicorn

    from ..engine.tokenizer import apply_chat
    from .server import Generator, ServeConfig, create_app
    tok = session.tok
    from ..engine.models import DEFAULT_TARGET
    name = kw["model"] or DEFAULT_TARGET
    is_file = Path(name).suffix.lower() == ".gguf" or Path(name).exists()
    model_id = kw["alias"] or (Path(name).stem if is_file else name)  # a registry name stays as it is

    def on_done(job, stats, finish):
        if kw["results"]:
            try:
                _append_csv(kw, _draft_label(kw, drafter, draft), model, session.ranges, f"serve:{finish}", stats)
            except UserError as e:  # the answer went out; a row that cannot be written must not stop the server
                print(f"[serve] {job.request_id}: {e}", file=sys.stderr, flush=True)

    generator = Generator(session, kw["max_queue"], on_done=on_done)
    app = create_app(ServeConfig(model_id, kw["ctx_size"], _cells_reserve(kw), kw["n_predict"]), generator, tok,
                     lambda messages: apply_chat(tok, messages))
    generator.start()
    print(f"[pipeinfer] serving '{model_id}' on http://{kw['host']}:{kw['port']}/v1 (mode {kw['mode']}, "
          f"{len(session.ranges)} rank(s)); Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, host=kw["host"], port=kw["port"], log_level="warning",
                                      timeout_graceful_shutdown=5)).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for: the normal way to stop
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # mpiexec forwards Ctrl-C again: finish shutting down
        print("[pipeinfer] stopping: finishing the request in progress, then shutting the pipeline down",
              file=sys.stderr, flush=True)
        generator.stop()
        session.close()
    if generator.fatal:
        raise UserError(f"the pipeline failed: {generator.fatal}")


def _check_port_free(host: str, port: int) -> None:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _draft_head(value: str) -> int | None:
    """--draft-head: 'auto' (DRAFT_HEAD_AUTO), 'full' (None: every token), or a number of tokens >= 256."""
    if value == "auto":
        return DRAFT_HEAD_AUTO
    if value == "full":
        return None
    if not value.isdigit() or int(value) < 256:
        raise click.BadParameter(f"{value!r} is not auto, full or a number of tokens >= 256")
    return int(value)


def _auto_or_float(value: str, param) -> float | None:
    """'auto' (None: the runner picks by the number of ranks) or a number >= 0."""
    if value == "auto":
        return None
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not x >= 0:
        raise click.BadParameter(f"{value!r} is neither 'auto' nor a number >= 0", param=param)
    return x


def _n_target_ranks(kw) -> int:
    """The ranks that hold the target's stages: every rank but the draft's (--draft-at rank)."""
    return mpi_size() - (kw.get("draft_at") == "rank")


def _draft_label(kw, drafter: str, draft: str | None) -> str:
    """The draft_model column: the drafter for the model-free ones, else the draft file's name."""
    if kw["mode"] == "iterative":
        return ""
    label = {"ngram": "ngram", "replay": f"replay@{kw.get('replay_accuracy')}"}.get(drafter, Path(draft or "").name)
    return label if kw.get("draft_at", "head") == "head" else f"{label} ({kw['draft_at']})"


def _append_csv(kw, draft_label: str, model: str, ranges, prompt_name: str, s, peak_rss_mb=None) -> None:
    """One --results row for a generation (peak RSS per rank when known: generate has it, a served request not)."""
    _write_row(kw, _row(kw, draft_label, model, ranges, prompt_name, s, peak_rss_mb))


def _row(kw, draft_label: str, model: str, ranges, prompt_name: str, s, peak_rss_mb=None, status: str = "ok") -> dict:
    """A --results row; `status` is "ok" or "failed: REASON" (ranges may then be unknown: None per rank)."""
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "mode": kw["mode"], "target_model": Path(model).name,
        "draft_model": draft_label, "ranks": len(ranges),
        "layer_split": ",".join(str(r.n_layers) for r in ranges if r is not None), "threads": kw["threads"] or "",
        "prompt_name": prompt_name, "n_prompt_tokens": s.n_prompt, "n_generated": s.n_generated,
        "pp_tokens_per_s": round(s.pp_tokens_per_s, 3), "gen_tokens_per_s": round(s.gen_tokens_per_s, 3),
        "ttft_s": round(s.ttft_s, 4), "itl_mean_s": round(s.itl_s, 4),
        "acceptance_rate": round(s.acceptance_rate, 4), "n_runs": s.n_runs, "n_cancelled": s.n_cancelled,
        "peak_rss_max_mb": round(max(peak_rss_mb), 1) if peak_rss_mb else None,
        "peak_rss_sum_mb": round(sum(peak_rss_mb), 1) if peak_rss_mb else None,
        "version": __version__, **_kernel_and_link_columns(s), "status": status,
    }


def _write_row(kw, row: dict) -> None:
    from ..core.results import append_result
    try:
        append_result(kw["results"], row)
    except (ValueError, OSError) as e:  # the text is out already; only the row could not be written
        raise UserError(f"--results {kw['results']}: {e}") from None


def _kernel_and_link_columns(s) -> dict:
    known = [x for x in (s.exact_batch or []) if x is not None]
    try:
        per_token = [round(b) for b in s.bytes_per_token()]
    except (TypeError, ValueError, ZeroDivisionError, AttributeError):  # a generation cut short: unknown
        per_token = None
    draft = [round(b) for b in s.draft_bytes_per_token()] if s.draft_link_bytes else None
    return {"kernels": s.kernels, "exact_batch_limit": min(known) if known else None, "bytes_per_token": per_token,
            "draft_bytes_per_token": draft}


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


def entry() -> None:
    """The console entry point: click, with a usage error as one line like every other user error
    (printed once, by rank 0; every rank exits with 2)."""
    try:
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


def _register() -> None:
    from ..engine.models import models_group
    from .launch import launch_cmd
    from .plot import plot_cmd
    from .twin_cmds import plan_cmd, profile_cmd, simulate_cmd
    main.add_command(simulate_cmd)
    main.add_command(plan_cmd)
    main.add_command(profile_cmd)
    main.add_command(models_group)
    main.add_command(launch_cmd)
    main.add_command(plot_cmd)


_register()
