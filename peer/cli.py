"""The `groundswell` command line: thin typer commands over the library.

User errors (bad config, missing data, malformed payloads, a training that diverged) end with one
clear red line and exit code 2, never a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from .config import TrainLocalConfig


class _Commands(typer.core.TyperGroup):
    """Typer's command group, its commands' help in click's plain style: `--state-dir PATH`,
    `--peers INTEGER`, and a flag with no type at all (typer 0.29 writes `<path>`, `<int>` and
    `<bool>`, which read as placeholders to type); an argument's usage name upper case."""

    def get_help_option(self, ctx: Any) -> Any:
        """This group's own --help, no type shown."""
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        """The named command, its parameters' metavars set as above."""
        command = super().get_command(ctx, cmd_name)
        if command is None:
            return None
        help_option = command.get_help_option(ctx)  # made on first use, after this hook otherwise
        for param in [*command.params, *([help_option] if help_option is not None else [])]:
            if param.metavar is not None:
                continue
            if isinstance(param, typer.core.TyperArgument):
                param.metavar = (param.name or "").upper()
                param.display_type_rich = lambda ctx, p=param: _click_type(p, ctx)  # its type column
            elif isinstance(param, typer.core.TyperOption) and param.is_flag:
                param.metavar = ""
            elif isinstance(param, typer.core.TyperOption):
                param.metavar = _click_type(param, ctx)
        return command


def _click_type(param: Any, ctx: Any) -> str:
    """A parameter's type as click names it (TEXT, INTEGER, PATH), from typer's `<str>` style."""
    label = param.display_type(ctx).strip("<>").removeprefix("list[").removesuffix("]")
    return {"str": "TEXT", "int": "INTEGER"}.get(label, label.upper())


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True,
                  help="groundswell: decentralized training peer.")
bench_app = typer.Typer(cls=_Commands, no_args_is_help=True,
                        help="Benchmarks that compare against a baseline measured in the same run.")
app.add_typer(bench_app, name="bench")


def _version() -> str:
    """The installed package's version ("unknown" in a checkout never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("groundswell")
    except PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        known = _version()
        print(f"groundswell {known}" if known != "unknown" else "groundswell (not installed: version unknown)")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                             metavar="", help="Print the version and exit.")) -> None:
    """groundswell: decentralized training peer."""


class _Console(Console):
    """rich's Console, but a stream closed under it (`join ... 2>&1 | tee log`: Ctrl+C ends the tee
    too) silences it: rich's default raised SystemExit from whatever print hit the closed pipe,
    the first Ctrl+C's notice included, so the peer left at once without its last round or
    checkpoint."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more to print; the peer goes on (its events.jsonl is a file)


# soft_wrap: a line is never broken by rich (to a file or a pipe it takes 80 columns), so a round stays one line for grep
console = _Console(stderr=True, emoji=False, soft_wrap=True)  # emoji off: ":ab:" in an IPv6 address is an emoji code to rich


# what to lower when a command runs out of memory, where it is not the manifest's sizes
# (a volunteer cannot change the run's batch sizes or model: they are the manifest's)
_OUT_OF_MEMORY_ADVICE = {"bench_codecs": "lower --params",
                         "join": "this run's model and batches need more memory than this device has (with "
                                 "--device cuda: try --device cpu), or a machine with more"}


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the library's typed user-facing errors into one line and exit code 2 (Ctrl+C: 130)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from groundswell.compression import CodecError
        from groundswell.protocol.identity import IdentityError

        from .bootstrap import BootstrapError
        from .config import ConfigError
        from .data import DataError
        from .manifest import ManifestError
        from .net_errors import NetworkError
        from .simulate import SimulationError
        from .workload import WorkloadError

        try:
            return fn(*args, **kwargs)
        except (ConfigError, ManifestError, BootstrapError, NetworkError, DataError, WorkloadError, CodecError,
                SimulationError, IdentityError, OSError,  # OSError: a missing file, a full disk...
                FloatingPointError) as exc:  # training diverged (the worker says which step): a learning rate to lower
            if isinstance(exc, (TimeoutError, ConnectionError)):  # network ones are OSErrors too: bugs here
                raise
            # escaped: messages quote manifest syntax ("[run]", "[a-z0-9-]") that rich would eat as markup
            console.print(f"[bold red]error:[/] {escape(str(exc) or type(exc).__name__)}", highlight=False,
                          soft_wrap=True)
            raise typer.Exit(2) from None
        except (MemoryError, RuntimeError) as exc:
            # out of memory (torch's CPU allocator raises a RuntimeError, CUDA an OutOfMemoryError):
            # a size to lower, not a bug to report. (typer's Exit is a RuntimeError too: it goes on.)
            if isinstance(exc, click.exceptions.Exit) or not (isinstance(exc, MemoryError) or _out_of_memory(exc)):
                raise
            what = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            lower = _OUT_OF_MEMORY_ADVICE.get(fn.__name__, "lower data.batch_size or eval.batch_size, or use a "
                                              "smaller model")
            console.print(f"[bold red]error:[/] out of memory ({escape(what)}); {lower}", highlight=False,
                          soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:  # Ctrl+C before a command's own handler, or pressed twice
            console.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


def _out_of_memory(exc: BaseException) -> bool:
    """Is this torch's out-of-memory error (CUDA's OutOfMemoryError, or the CPU allocator's)?"""
    import torch

    # (torch.OutOfMemoryError is new in torch 2.5; older ones have torch.cuda's)
    cuda_oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    return isinstance(exc, cuda_oom) or "can't allocate memory" in str(exc)


def _set_threads(threads: int) -> None:
    """Set torch's thread count from --threads (0: torch's default); a negative one is refused."""
    from .config import ConfigError

    if threads < 0:  # read as 0 it would run silently on torch's default
        raise ConfigError(f"--threads must be 0 (torch's default) or more, not {threads}")
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def _load_config(config: Optional[Path], overrides: dict[str, Any], sets: list[str]) -> TrainLocalConfig:
    """The train-local config: the file, then the flags, then every --set, merged and validated once."""
    from .config import ConfigError, TrainLocalConfig, from_mapping, set_path

    data: dict[str, Any] = {}
    if config is not None:
        import tomllib

        if not config.is_file():
            raise ConfigError(f"--config {config}: {'a folder, not a file' if config.is_dir() else 'no such file'}")
        try:
            data = tomllib.loads(config.read_text())
        except (ValueError, RecursionError) as exc:  # (and an int too long to read, arrays nested too deep)
            raise ConfigError(f"{config}: not valid TOML: {str(exc)[:300] or type(exc).__name__}") from None
    # One mapping, checked once: checked after each override, a valid final config could be
    # refused for a value that a later override replaces (see config.set_path).
    for key, value in overrides.items():
        if value is not None:
            set_path(data, TrainLocalConfig, key, value)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            import tomllib

            value = tomllib.loads(f"v = {raw}")["v"]
        except (ValueError, RecursionError):  # (TOMLDecodeError; an int too long to read)
            value = raw  # a bare word is a string
        set_path(data, TrainLocalConfig, key.strip(), value)
    outer = data.get("outer")
    if "workers" not in data and isinstance(outer, Mapping) and outer.get("algorithm") == "single":
        data["workers"] = 1  # single trains one worker; the default of 4 would only be refused
    return from_mapping(TrainLocalConfig, data)


def _check_out(out: Optional[Path]) -> None:
    """Refuse an --out that could not be written, before the training whose result it would hold."""
    from .config import ConfigError

    if out is None or _not_a_plain_file(out):
        return
    try:
        out = out.resolve() if out.is_symlink() else out  # (a dangling link: its target is made)
    except (RuntimeError, OSError) as exc:  # a loop of links
        raise ConfigError(f"--out {out}: {exc}") from None
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: give the path of a file to write")
    if not out.parent.is_dir():
        what = "is not a folder" if out.parent.exists() else "does not exist"
        raise ConfigError(f"--out {out}: {out.parent} {what}")
    import tempfile

    try:  # a read-only disk or a folder of another user's: said now, not after the training (it was)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write in {out.parent} ({exc.strerror or exc})") from None


def _not_a_plain_file(out: Path) -> bool:
    """Is --out a pipe, a device or an open file of ours (`>(jq .)`'s /dev/fd/N, /dev/stdout)?
    Appended to in place, never replaced: replacing /dev/stdout's target replaced the log that
    stdout was redirected to (a review, 2026-12-07); a link to a file has its target written."""
    return str(out.absolute()).startswith(("/dev/", "/proc/")) or (out.exists() and not out.is_file()
                                                                    and not out.is_dir())


def _write_out(out: Optional[Path], result: object) -> None:
    """Write a command's result to --out whole or not at all (it is printed first, so a failed
    write, a disk full since the start say, loses nothing); a pipe or a link is written in place."""
    import os

    from .config import ConfigError
    from .state_files import write_atomically

    if out is None:
        return
    data = json.dumps(result, indent=2).encode()
    try:
        if _not_a_plain_file(out):
            with open(out, "ab") as f:  # (appended: "wb" truncated a file stdout was appending to)
                f.write(data)
            return
        out = out.resolve() if out.is_symlink() else out  # the link's target is written, the link kept
        if out.exists():
            mode = out.stat().st_mode & 0o777  # a file replaced keeps its mode (a private one stays so)
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # as a file the shell makes, not a state file's 0600
        write_atomically(out, lambda f: f.write(data), mode=mode)
    except OSError as exc:
        raise ConfigError(f"--out {out} could not be written ({exc.strerror or exc}); the result is printed "
                          "above") from None


@app.command("train-local")
@_user_errors
def train_local(
    workers: Optional[int] = typer.Option(None, help="Workers trained in this process.", show_default="4"),
    steps: Optional[int] = typer.Option(None, help="Inner steps per worker.", show_default="200"),
    preset: Optional[str] = typer.Option(None, "--model", "--preset",
                                         help="Preset (tiny, small, base, 100m) or module:callable."),
    algorithm: Optional[str] = typer.Option(None, help="diloco, sparseloco, data-parallel or single."),
    codec: Optional[str] = typer.Option(None, help="Outer codec: fp32, fp16, bf16, int8, sparseloco."),
    inner_steps: Optional[int] = typer.Option(None, "--inner-steps", "-H", help="Inner steps per round (H)."),
    outer_lr: Optional[float] = typer.Option(None, help="Outer learning rate."),
    inner_lr: Optional[float] = typer.Option(None, help="Peak inner AdamW learning rate."),
    data: Optional[str] = typer.Option(None, help="stdlib, a folder of text files, or a folder with train.bin/val.bin."),
    seed: Optional[int] = typer.Option(None, help="Run seed."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda."),
    config: Optional[Path] = typer.Option(None, help="A TOML file with the full config tree."),
    set_: list[str] = typer.Option([], "--set", help="Override any config key, e.g. --set inner.warmup_steps=10."),
    threads: int = typer.Option(0, help="torch threads (0 = torch's default)."),
    table: bool = typer.Option(False, "--table", help="Run the miniature paper table instead of one job."),
    jobs: Optional[int] = typer.Option(None, help="With --table: rows run in this many processes (one torch "
                                       "thread each).", show_default="1"),
    quick: bool = typer.Option(False, "--quick", help="With --table: a short smoke-test budget."),
    out: Optional[Path] = typer.Option(None, help="Write the result as JSON to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Train several workers in one process (DiLoCo / SparseLoCo / baselines) and report held-out loss."""
    from .config import ConfigError

    _set_threads(threads)
    table_only = [flag for flag, given in (("--jobs", jobs is not None), ("--quick", quick)) if given]
    if table_only and not table:  # one job has no rows to share out or shorten: silently dropping them would mislead
        raise ConfigError(f"{' and '.join(table_only)} go{'es' if len(table_only) == 1 else ''} with --table only")
    if table:
        from .mini_table import format_table, run_mini_table

        job_flags = {"--workers": workers, "--steps": steps, "--model": preset, "--algorithm": algorithm,
                     "--codec": codec, "-H": inner_steps, "--outer-lr": outer_lr, "--inner-lr": inner_lr,
                     "--data": data, "--seed": seed, "--device": device, "--config": config, "--set": set_ or None}
        ignored = [flag for flag, value in job_flags.items() if value is not None]
        if ignored:  # its rows are fixed (see peer/mini_table.py): silently dropping them would mislead
            raise ConfigError(f"--table runs its fixed rows and takes only --jobs, --quick, --threads, --out and "
                              f"--json, not {', '.join(ignored)}")
        jobs = 1 if jobs is None else jobs
        if jobs < 1:
            raise ConfigError(f"--jobs must be at least 1, got {jobs}")
        _check_out(out)

        result = run_mini_table(jobs=jobs, quick=quick, progress=lambda msg: console.print(msg, highlight=False))
        print(json.dumps(result, indent=2) if as_json else format_table(result))
        _write_out(out, result)
        return

    from .train_local import run_train_local

    overrides = {
        "workers": workers, "steps": steps, "model.spec": preset, "outer.algorithm": algorithm,
        "outer.codec": codec, "outer.inner_steps": inner_steps, "outer.lr": outer_lr, "inner.lr": inner_lr,
        "data.source": data, "seed": seed, "device": device,
    }
    from .config import check_device

    cfg = _load_config(config, overrides, set_)
    check_device(cfg.device)
    _check_out(out)
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, disable=as_json or not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task(f"{cfg.outer.algorithm} x{cfg.workers}", total=None, info="")

        def progress(done: int, total: int, info: dict) -> None:
            bar.update(task, completed=done, total=total,
                       info=f"step {info['step']}  train {info['train_loss']:.3f}  eval {info['eval_loss']:.3f}")

        result = run_train_local(cfg, progress=progress)
    payload = result.as_dict()
    if as_json:
        print(json.dumps(payload, indent=2))
    else:
        console.print(
            f"[bold]{result.name}[/]: held-out loss {result.eval_loss:.4f} after {result.steps} steps x "
            f"{result.workers} workers; {result.bytes_per_worker / 1e6:.2f} MB sent per worker "
            f"({result.bytes_vs_data_parallel:.4f} of data-parallel fp32); {result.wall_s:.1f} s; "
            f"replicas identical: {result.params_identical}",
            highlight=False,
        )
    _write_out(out, payload)


@bench_app.command("codecs")
@_user_errors
def bench_codecs(
    params: int = typer.Option(25_000_000, help="Number of parameters in the benchmark tensor."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    repeats: int = typer.Option(3, help="Timed repetitions per codec (median reported)."),
    threads: int = typer.Option(0, help="torch threads (0 = torch's default)."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON result on stdout."),
) -> None:
    """Encode/decode throughput, wire bytes and error per codec, next to a reference SparseLoCo."""
    _set_threads(threads)
    from .bench_codecs import format_codec_table, run_codec_bench
    from .config import check_device

    check_device(device)

    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        console.print("[yellow]note:[/] OMP_WAIT_POLICY is not PASSIVE; CPU timings may be noisy on small machines")
    result = run_codec_bench(params, device=device, repeats=repeats)
    # how the numbers were made (the threads and OMP_WAIT_POLICY are in the result already)
    result["run"] = {"argv": ["groundswell", *sys.argv[1:]], "version": _version(),
                     "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(result, indent=2) if as_json else format_codec_table(result))


# Registering the commands, in the order `--help` lists them: keygen, launch, join, status; simulate.
from . import cli_swarm  # noqa: F401, I001
from . import cli_status  # noqa: F401
from . import cli_simulate  # noqa: F401


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    # Run as a script, this file is `__main__`, and `cli_swarm` registered its commands on the
    # importable `groundswell.peer.cli` instead: use that one's app.
    from groundswell.peer.cli import main as _main

    _main()
