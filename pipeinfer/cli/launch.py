"""`pipeinfer launch`: run `pipeinfer ARGS...` on every slot of a hostfile through the right mpiexec/mpirun, or on
the tasks of the Slurm allocation it runs in through srun (wire/launcher.py and wire/slurm.py build the command
line; the hostfile format is described in launcher.py)."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from ..core.errors import UserError
from ..wire import container
from ..wire.launcher import (HOW_TO_LOAD, MPI_KINDS, MPI_NAMES, Host, build_command, choose_launcher, hostfile_text,
                             job_plan, launcher_env, mpi4py_library, parse_hostfile, rank_hosts,
                             signal_to_pass_on)
from ..wire.slurm import TASK_FILE_ENV, allocation, allocation_hosts, srun_command, srun_path
from .options import CheckedCommand


@click.command("launch", context_settings={"ignore_unknown_options": True,
                                           "allow_interspersed_args": False})
@click.option("--hostfile", "hostfile_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Hostfile (see module docs); inside a Slurm allocation: settings for its nodes (optional).")
@click.option("--np", "np_", type=click.IntRange(min=1), default=None,
              help="Number of ranks [default: total slots].")
@click.option("--mpi", type=click.Choice(["auto", *MPI_KINDS]), default="auto", show_default=True,
              help="The MPI to run on; auto: the one whose library mpi4py loads (another is refused).")
@click.option("--mpiexec", default=None,
              help="mpiexec/mpirun to use [default: the launcher of the MPI library mpi4py loads; srun inside a "
                   "Slurm allocation].")
@click.option("--write-hostfile", "out_hostfile", type=click.Path(dir_okay=False), default=None,
              help="Where to write the translated hostfile [default: a temporary file].")
@click.option("--mpi-arg", "mpi_args", multiple=True, metavar="ARG",
              help="Extra option for mpiexec (srun in an allocation), repeatable (e.g. --mpi-arg=-iface "
                   "--mpi-arg=eth1).")
@click.option("--image", default=None, metavar="IMAGE",
              help="Run every host's ranks in a container of this pipeinfer image (podman, or docker with "
                   "PIPEINFER_IMAGE_RUNTIME=docker; docs/containers.md).")
@click.option("--dry-run", is_flag=True, help="Check and print the command and do not run it.")
@click.argument("pipeinfer_args", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(hostfile_path, np_, mpi, mpiexec, out_hostfile, mpi_args, image, dry_run,
               pipeinfer_args):
    """Run `pipeinfer ARGS...` on every slot of HOSTFILE via mpiexec, or on a Slurm allocation's tasks via srun.

    Example: pipeinfer launch --hostfile hosts.txt -- generate --model m.gguf
    """
    command = _subcommand(pipeinfer_args)
    try:
        slurm = allocation(os.environ) if mpiexec is None else None
        library = mpi4py_library() if image else None  # (asked once: a subprocess that starts MPI)
        image_env = _image_env(image, pipeinfer_args, library, in_slurm=slurm is not None) if image else {}
        if image and slurm is None:  # (in an allocation each task of the step starts its container: wire/slurm)
            mpi_args = (*mpi_args, *container.launcher_args())
        if slurm is None and hostfile_path is None:
            raise ValueError("--hostfile HOSTS is needed outside a Slurm allocation (SLURM_JOB_ID is not set)")
        hosts = parse_hostfile(hostfile_path) if hostfile_path else []
        if slurm is not None:
            hosts = allocation_hosts(slurm, hosts)
        if pipeinfer_args[:1] == ("serve",):
            if slurm is not None:  # the supervisor starts its job steps with srun (supervisor.py)
                hostfile_path = out_hostfile or os.path.join(tempfile.mkdtemp(prefix="pipeinfer-"), "hosts")
                Path(hostfile_path).write_text(hostfile_text(hosts))
            serve_args = ["--hostfile", hostfile_path] + (["--np", str(np_)] if np_ else []) + list(pipeinfer_args[1:])
            where = _check(command, serve_args, resolve=dry_run)
            _launch_supervised_serve(mpi_args, dry_run, serve_args, where, image_env)
            if dry_run and where is not None:
                by_name = {h.name: h for h in hosts}
                _show_ranks(where.config, [by_name.get(n, Host(n)) for n in where.slots],
                            by_name.get(where.draft.name) if where.draft else None)
            return None
        library = library or mpi4py_library()
        if mpi != "auto" and mpi != library.kind:
            raise RuntimeError(f"--mpi {mpi}, but mpi4py loads {library.name}: every rank would run as a separate "
                               f"one-process job (make mpi4py load {MPI_NAMES[mpi]}: {HOW_TO_LOAD[mpi]})")
        mpi = library.kind
        accepts = {p.name for p in command.params}
        hosts = _without_draft_host(command.name, hosts, accepts)
        np_ = np_ or sum(h.slots for h in hosts)
        if slurm is not None:
            task_file = out_hostfile or _temporary("pipeinfer-tasks-")
            cmd, env = srun_command(hosts, np_, mpi, pipeinfer_args, task_file=task_file, srun=srun_path(),
                                    extra=mpi_args, accepts=accepts, environ={**os.environ, **image_env})
            env = {**image_env, **env}
            hostfile = env[TASK_FILE_ENV]
        else:
            mpiexec = choose_launcher(library, mpiexec)
            extra = ["--allow-run-as-root"] if mpi == "openmpi" and os.geteuid() == 0 else []
            extra += list(mpi_args)
            cmd, env = build_command(hosts, np_, mpi, pipeinfer_args, mpiexec=mpiexec, extra=extra,
                                     hostfile=out_hostfile, accepts=accepts,
                                     environ={**os.environ, **image_env}), image_env
            hostfile = cmd[cmd.index("-f" if mpi == "mpich" else "--hostfile") + 1]
    except (ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        checked = _check(command, cmd[cmd.index("pipeinfer", cmd.index("mpi4py")) + 1:], resolve=dry_run)
    except click.ClickException:
        if out_hostfile is None:
            Path(hostfile).unlink(missing_ok=True)
        raise
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    click.echo(prefix + shlex.join(cmd), err=True)  # stdout is the job's: the answer alone
    if dry_run:
        what = "tasks (one node per rank)" if slurm is not None else "hostfile"
        click.echo(f"# {what} {hostfile}:\n" + Path(hostfile).read_text().rstrip(), err=True)
        if out_hostfile is None:  # nothing will run it: leave no temporary file behind
            Path(hostfile).unlink(missing_ok=True)
        if getattr(checked, "config", None) is not None:
            ordered, _ = job_plan(hosts, np_, pipeinfer_args, accepts)
            per_rank = rank_hosts(ordered, np_)
            draft = per_rank[-1] if per_rank[-1].role == "draft" else None
            _show_ranks(checked.config, per_rank[:-1] if draft else per_rank, draft)
        return
    try:
        rc = _run_forwarding_signals(cmd, "slurm" if slurm is not None else mpi, {**os.environ, **env})
    finally:
        if out_hostfile is None:
            Path(hostfile).unlink(missing_ok=True)
    sys.exit(rc if rc >= 0 else 128 - rc)


def _image_env(image: str, pipeinfer_args, library, in_slurm: bool) -> dict[str, str]:
    """The variables of a job whose ranks run in `image` (wire/container.py), for its launcher and a supervised
    server: the image, and the folders of the paths among the job's arguments (each host's pipeinfer cache, with
    the models fetched there, is the container's own). `library`: the MPI mpi4py loads here."""
    if library.kind != "mpich":
        raise ValueError("--image runs MPICH's launcher (the image's MPI is the mpich wheel), but mpi4py loads "
                         f"{library.name} here")
    env = {container.IMAGE_ENV: image}
    if in_slurm:  # each task starts its container: what it runs is checked now, not when the first job starts
        container.step_command({**os.environ, **env})
    return {**env, **container.with_volumes(env, container.volumes_for(pipeinfer_args))}


def _without_draft_host(name: str, hosts: list, accepts) -> list:
    """The hosts a command runs on: a command with no draft rank (no --draft-at, e.g. `profile`) runs on the stage
    hosts only, the role=draft host left out, said in one line (its slot would be one more stage rank than the
    hostfile's --layer-split has fractions for)."""
    draft = next((h for h in hosts if h.role == "draft"), None)
    if draft is None or "draft_at" in accepts:
        return hosts
    click.echo(f"[pipeinfer] launch: {name} runs no draft rank: {draft.name} (role=draft) is left out", err=True)
    return [h for h in hosts if h is not draft]


@dataclass(frozen=True)
class RankNeed:
    """What one rank of a dry run holds: its layers, threads (None: its default, not known here) and RAM."""
    host: Host
    start: int
    end: int
    threads: int | None
    weights: float    # bytes of its stage's weights (a tensor group's member: its share)
    cache: float      # its context: KV cache (and a hybrid's states)
    draft: float      # the draft's file, on the rank that runs it
    runtime: float
    group: str = ""   # a tensor group's member: "slice k of G"

    @property
    def total(self) -> float:
        return self.weights + self.cache + self.draft + self.runtime


def rank_needs(config, stages: list[Host], draft_host: Host | None) -> list[RankNeed]:
    """Each stage rank's layers (as start-up plans them: core/topology.plan_layers over the GGUF header's
    stagefile.layer_costs and the architecture's range rules; `auto`, timed at start-up, shown balanced), threads
    (-t, else the host's described cores shared among its ranks as core/cpus.share deals them) and RAM
    (twin/machines.Target.rank_ram_bytes, as `plan` prices it; the draft's file beside rank 0, or on the draft host's
    rank, last)."""
    from ..core.cpus import share
    from ..core.topology import Groups, group_sizes, parse_per_rank_ints, plan_layers, stage_speeds
    from ..engine.ggufheader import model_size
    from ..engine.stagefile import layer_costs, range_check, read_info
    from ..twin.machines import GIB, RUNTIME_GIB, context_seqs, target_from_gguf
    info, target = read_info(config.model), target_from_gguf(config.model)
    groups = Groups(tuple(group_sizes(config.stage.groups, config.stage.tensor_parallel, len(stages))))
    n = len(groups.sizes)  # pipeline stages: a tensor group is one
    layer_cost, tail = layer_costs(config.model)
    split = config.stage.layer_split
    check = range_check(config.model) if n > 1 else None  # the architecture's rules on where a stage may start
    ranges = plan_layers(None if split is None or split.strip() == "auto" else split, info.n_layer, n, layer_cost, tail,
                         speeds=stage_speeds(None, groups),
                         allowed=(lambda a, b: check.refusal(a, b) is None) if check else None)
    index = [sum(h.name == s.name for s in stages[:i]) for i, h in enumerate(stages)]
    default = [share(h.cores, sum(s.name == h.name for s in stages), k) if h.cores else 0
               for h, k in zip(stages, index)]
    threads = parse_per_rank_ints(config.stage.threads, len(stages), "--threads", default=default)  # each rank's
    draft = float(model_size(config.draft.model)) if config.mode != "iterative" and config.draft.model else 0.0
    beside_head = draft_host is None or config.draft.at != "rank"
    n_seq, n_ctx = context_seqs(target, n), config.stage.n_ctx
    needs = []
    for r, h in enumerate(stages):
        i = groups.stage_of(r)
        rr, g, k = ranges[i], groups.sizes[i], r - groups.leaders[i]
        last = i == n - 1
        members = [threads[m] for m in groups.members(i)]
        share = threads[r] / sum(members) if all(members) else 1 / g  # a member's slice follows its threads
        cache = rr.n_layers * target.cache_bytes_per_layer(n_ctx, n_seq) * share  # a member's cache: its KV heads
        weights = target.stage_bytes(rr.n_layers, False, last) * share + (target.embd_bytes if r == 0 else 0.0)
        needs.append(RankNeed(h, rr.start, rr.end, threads[r] or None, weights,
                              cache, draft if r == 0 and beside_head else 0.0, RUNTIME_GIB * GIB,
                              f"slice {k + 1} of {g}" if g > 1 else ""))
    if draft_host is not None and not beside_head:
        threads_d = config.draft.threads or (draft_host.threads or draft_host.cores)
        needs.append(RankNeed(draft_host, 0, 0, threads_d, 0.0, 0.0, draft, RUNTIME_GIB * GIB))
    return needs


def _show_ranks(config, stages: list[Host], draft_host: Host | None) -> None:
    """A dry run's line per rank (host, layers, threads, RAM) and per described host (RAM against its mem=); a
    host that would not hold its ranks ends the dry run in one line."""
    from ..twin.machines import GIB
    try:
        needs = rank_needs(config, stages, draft_host)
    except (ValueError, OSError) as e:
        raise click.ClickException(f"launch --dry-run: {e}") from None
    for r, need in enumerate(needs):
        what = "the draft" if need.end == 0 else f"layers {need.start}-{need.end}" + (
            f" ({need.group} of a tensor group)" if need.group else "")
        threads = ("default threads" if need.threads is None
                   else f"{need.threads} thread{'s' * (need.threads != 1)}")
        click.echo(f"# rank {r} {need.host.name}: {what}, {threads}, {need.total / GIB:.1f} GiB of RAM (weights "
                   f"{need.weights / GIB:.1f} + KV cache {need.cache / GIB:.1f} + draft {need.draft / GIB:.1f} + "
                   f"runtime {need.runtime / GIB:.1f})", err=True)
    for host in dict.fromkeys(need.host.name for need in needs):
        ranks = [r for r, need in enumerate(needs) if need.host.name == host]
        total = sum(needs[r].total for r in ranks) / GIB
        mem = next(need.host.mem for need in needs if need.host.name == host)
        click.echo(f"# host {host}: {total:.1f} GiB of RAM" + (f" of its {mem:g} (mem=)" if mem else ""), err=True)
        if mem is not None and total > mem:
            raise click.ClickException(f"launch --dry-run: {host} would need {total:.1f} GiB of RAM for rank(s) "
                                       f"{', '.join(map(str, ranks))}, its hostfile line gives mem={mem:g}")


def _temporary(prefix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".txt")
    os.close(fd)
    return path


def _subcommand(pipeinfer_args) -> click.Command:
    """The pipeinfer command that `launch` runs (a one-line error for none, or one pipeinfer does not have)."""
    main = click.get_current_context().find_root().command
    assert isinstance(main, click.Group), "launch runs as a command of `pipeinfer`"
    name = pipeinfer_args[0] if pipeinfer_args else None
    command = main.commands.get(name) if name else None
    if command is None or name == "launch":
        runnable = ", ".join(n for n in sorted(main.commands) if n != "launch")
        raise click.ClickException(f"launch runs a pipeinfer command ({runnable}), not {name!r}: "
                                   "pipeinfer launch --hostfile HOSTS -- generate ..." if name else
                                   f"launch: which pipeinfer command to run? ({runnable}) e.g. "
                                   "pipeinfer launch --hostfile HOSTS -- generate ...")
    return command


def _check(command: click.Command, args: list[str], *, resolve: bool):
    """The command line `launch` would run on every rank, checked here first: its options as click parses them
    (always: one line here rather than one per rank), and with `resolve` (--dry-run) what the command makes of
    them before it starts MPI (models resolved, the configuration built and checked), so that a dry run that
    exits 0 names a command that runs. What the check made of them (None without one)."""
    try:
        with command.make_context(command.name, list(args[1:] if args[:1] == [command.name] else args)) as ctx:
            if resolve and isinstance(command, CheckedCommand) and command.check is not None:
                return command.check(ctx.params)
            return None
    except click.ClickException as e:
        raise click.ClickException(f"{command.name}: {e.format_message()}") from None
    except UserError as e:
        raise click.ClickException(f"{command.name}: {e}") from None


def _launch_supervised_serve(mpi_args, dry_run: bool, serve_args: list[str], where=None,
                             image_env: dict[str, str] | None = None) -> None:
    """`launch --hostfile H -- serve ARGS` is the supervised server, `serve --hostfile H ARGS` (no mpiexec: it
    starts the pipeline's job itself and re-forms it when a host is lost); --mpi-arg options reach its
    launcher through PIPEINFER_MPI_ARGS, and --image's variables (`image_env`) its jobs. A dry run also shows the
    server's first job (`where` it runs)."""
    cmd = [sys.executable, "-m", "pipeinfer", "serve"] + serve_args
    more = dict(image_env or {})
    if mpi_args:
        more["PIPEINFER_MPI_ARGS"] = shlex.join([*shlex.split(os.environ.get("PIPEINFER_MPI_ARGS", "")), *mpi_args])
    env = {**os.environ, **more}
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in more.items())
    click.echo(prefix + shlex.join(_keys_hidden(cmd)))
    if dry_run:
        if where is not None:
            _show_first_job(where, env)
        return
    proc = subprocess.Popen(cmd, env=env)
    signal.signal(signal.SIGTERM, lambda signum, _frame: proc.send_signal(signum))  # the server's own stop
    while True:
        try:
            sys.exit(proc.wait())
        except KeyboardInterrupt:  # the server stops on it too (same terminal, same signal): wait for its end
            continue


def _keys_hidden(cmd: list[str]) -> list[str]:
    """The command as it is shown: an --api-key's value as KEY (keys are never echoed, docs/serving.md)."""
    shown = list(cmd)
    for i, a in enumerate(shown):
        if a.startswith("--api-key="):
            shown[i] = "--api-key=KEY"
        elif a == "--api-key" and i + 1 < len(shown):
            shown[i + 1] = "KEY"
    return shown


def _show_first_job(where, env: dict) -> None:
    """The launcher line of the supervised server's first job and its hostfile, as the server would start it."""
    from ..supervisor.launch import first_job_command
    with tempfile.TemporaryDirectory(prefix="pipeinfer-") as work:
        try:
            job, more = first_job_command(where, work, env)
        except (ValueError, RuntimeError, OSError) as e:
            raise click.ClickException(str(e)) from None
        click.echo("# the pipeline's first job, as the server starts it:\n# " +
                   "".join(f"{k}={shlex.quote(v)} " for k, v in more.items()) + shlex.join(job))
        hosts = Path(work, "hosts.txt")
        click.echo("# its hostfile:\n" + "\n".join("# " + line for line in hosts.read_text().splitlines()))


def _run_forwarding_signals(cmd: list[str], mpi: str, env: dict) -> int:
    """Run cmd (the MPI's launcher) and return its status. It runs in a session of its own, with no stdin (no rank
    reads it), so a Ctrl-C in the terminal reaches only this process, which passes on one signal for each
    SIGINT/SIGTERM/SIGHUP it gets (signal_to_pass_on), never SIGKILL: the launcher stops the ranks on every host."""
    started: list[subprocess.Popen] = []
    got: list[int] = []

    def pass_on(signum: int, _frame) -> None:
        if started:  # (one that came while the launcher started is passed on once it runs)
            started[0].send_signal(signal_to_pass_on(mpi, signum, first=not got))
        if mpi == "openmpi" and not got:
            print("[pipeinfer] launch: stopping the job cleanly (once more: end it now)", file=sys.stderr, flush=True)
        got.append(signum)
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, pass_on) for s in sigs}
    try:
        started.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=launcher_env(env)))
        if got:
            started[0].send_signal(signal_to_pass_on(mpi, got[0], first=True))
        return started[0].wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
