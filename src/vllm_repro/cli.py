"""The ``vllm-repro`` command line (typer): the app, its commands (one module each in
:mod:`vllm_repro.commands`) and :func:`main`, the entry point.

Exit codes (README, "Exit codes"): 0 observations match ``expect``; 1 mismatch or reproduction found;
2 usage or input error; 3 environment error (fetch, import, docker, ssh) or a lab failure (the
traceback saved to a file); 130 / 143 interrupted by SIGINT / SIGTERM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from .commands import bisect, campaign, catalog, fuzz, matrix, prepare, remote, run, triage, verify
from .commands.doctor import doctor
from .commands import slice as slice_
from .commands.diff import diff as diff_
from .console import err, error
from .errors import EXIT_ENV, EXIT_INPUT, LabError

app = typer.Typer(no_args_is_help=True, invoke_without_command=True,
                  help="Reproduce vLLM engine crashes on CPU with vLLM's real scheduler code.")

#: each command's line in `vllm-repro --help` (its own --help has the whole docstring)
SUMMARIES = {
    "run": "Run scenarios on vLLM releases; print the verdict table.",
    "prepare": "Fetch, check and build releases' CPU environments ahead of a run.",
    "catalog": "List the catalog of real vLLM bugs, or run it (catalog run).",
    "triage": "Read a vLLM crash log: root cause, where, release; draft a scenario.",
    "fuzz": "Search workloads on one release until vLLM fails; shrink the failure.",
    "campaign": "Fuzz releases x seeds x feature sets; a heat map of the findings.",
    "slice": "Trace and commit the slice of a release's tree that runs use.",
    "verify": "Prove a patch on CPU: reproduced before, clean after.",
    "gpu-verify": "Confirm a patch on a GPU host over SSH (full vLLM, CUDA image).",
    "gpu-judge": "Inside the CUDA image: judge a verification bundle (gpu-verify runs it).",
    "bisect": "Find the first release (or commit) where a scenario's outcome changes.",
    "matrix": "Run a scenario on every release in a range, in each mode; a picture.",
    "doctor": "Smoke-test releases at every level and mode: works, degraded or fails.",
    "diff": "Run a scenario on two releases; the first step their decisions differ.",
}

# the order of `vllm-repro --help`
app.command("run", short_help=SUMMARIES["run"])(run.run)
app.command("prepare", short_help=SUMMARIES["prepare"])(prepare.prepare)
app.add_typer(catalog.app, name="catalog", short_help=SUMMARIES["catalog"])
app.command("triage", short_help=SUMMARIES["triage"])(triage.triage)
app.command("fuzz", short_help=SUMMARIES["fuzz"])(fuzz.fuzz)
app.command("campaign", short_help=SUMMARIES["campaign"])(campaign.campaign)
app.command("slice", short_help=SUMMARIES["slice"])(slice_.slice_cmd)
app.command("verify", short_help=SUMMARIES["verify"])(verify.verify)
app.command("gpu-verify", short_help=SUMMARIES["gpu-verify"])(remote.gpu_verify)
app.command("gpu-judge", short_help=SUMMARIES["gpu-judge"])(remote.gpu_judge)
app.command("bisect", short_help=SUMMARIES["bisect"])(bisect.bisect)
app.command("matrix", short_help=SUMMARIES["matrix"])(matrix.matrix)
app.command("doctor", short_help=SUMMARIES["doctor"])(doctor)
app.command("diff", short_help=SUMMARIES["diff"])(diff_)


def cached_releases() -> list[tuple[str, list[str]]]:
    """The vLLM releases in the cache (``VLLM_REPRO_CACHE``), in version order, each with what
    of it is there: ``sdist``, ``tree``, ``env`` (the full tree's CPU environment), ``slice``
    (a slice's environment)."""
    from packaging.version import InvalidVersion, Version

    from .settings import cache_dir

    root = cache_dir()
    found: dict[str, list[str]] = {}
    for f in (root / "sdists").glob("vllm-*.tar.gz"):
        found.setdefault(f.name[len("vllm-"):-len(".tar.gz")], []).append("sdist")
    for d in (root / "trees").glob("*"):
        if d.is_dir():
            found.setdefault(d.name, []).append("tree")
    for d in (root / "envs").glob("*"):
        if (d / "bin" / "python").exists():
            name, _, key = d.name.partition("-slice-")
            what = "slice" if key else "env"
            if what not in found.setdefault(name, []):
                found[name].append(what)

    def key(v: str):
        try:
            return (0, Version(v))
        except InvalidVersion:
            return (1, Version("0"))
    return sorted(found.items(), key=lambda kv: (key(kv[0]), kv[0]))


@app.callback()
def top(ctx: typer.Context,
        version: bool = typer.Option(False, "--version", help="Print the lab's version (with -v, "
                                     "also the vLLM releases in the cache) and exit."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="With --version: the "
                                     "cached releases too.")) -> None:
    """Reproduce vLLM engine crashes on CPU with vLLM's real scheduler code."""
    if version:
        from . import __version__
        from .console import out

        out.print(f"vllm-repro {__version__}", highlight=False)
        if verbose:
            from .settings import cache_dir

            releases = cached_releases()
            out.print(f"cache {cache_dir()}: {len(releases)} vLLM release(s)", highlight=False)
            for name, what in releases:
                out.print(f"  {name}  {', '.join(what)}", highlight=False)
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        from .console import out

        out.print(ctx.get_help())
        raise typer.Exit(0)


def _check_cache() -> None:
    """The cache folder (``VLLM_REPRO_CACHE``) before any command uses it: a regular file, a
    file among its parents or a symlink loop is exit 2 naming it (:func:`settings.cache_dir`)."""
    from .settings import cache_dir

    cache_dir()


def crash_report(exc: BaseException) -> Path | None:
    """Write ``exc``'s traceback to a new file in the temporary folder; its path, or None
    when even that cannot be written."""
    import tempfile
    import traceback

    try:
        fd, name = tempfile.mkstemp(prefix="vllm-repro-crash-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as fh:
            fh.write(f"vllm-repro {' '.join(sys.argv[1:])}\n\n")
            fh.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return Path(name)
    except Exception:  # noqa: BLE001 - a last resort must not fail itself
        return None


def usage_error(exc) -> None:
    """A usage error from click (an unknown option, a value not among an option's choices, a
    missing argument) as one line, ``error: MESSAGE (vllm-repro CMD --help: ...)``, as every
    input error is said (README, "Exit codes")."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None and ctx.command_path else "vllm-repro"
    try:
        message = exc.format_message()
    except Exception:  # noqa: BLE001 - a click exception without it: its text
        message = str(exc)
    error(f"{message} ({where} --help lists the arguments and options)")


def main(args: list[str] | None = None, *, signals: bool = True) -> None:
    """Entry point: one-line messages and the exit codes (README) for lab and input errors.

    SIGINT / SIGTERM stop every child process and exit 130 / 143 (:mod:`vllm_repro.procs`);
    any other exception of the lab is a lab failure: its traceback goes to a file, one line
    says where, exit 3. ``signals=False`` (tests calling it in-process) leaves the signal
    handlers alone and never sweeps the caller's child processes."""
    from . import procs

    if signals:
        procs.install_signal_handlers()
    argv = sys.argv[1:] if args is None else list(args)
    try:
        if not {"--help", "-h"} & set(argv):
            _check_cache()
        code = app(args=argv, standalone_mode=False, prog_name="vllm-repro")
        sys.exit(code if isinstance(code, int) else 0)
    except procs.Interrupted as exc:
        if signals:  # the entry point owns its children; a caller in-process owns its own
            procs.kill_all()
        err.print("aborted", highlight=False)
        if signals:  # now: not after the threads still reading the killed workers' pipes
            _exit_now(exc.exit_code)
        sys.exit(exc.exit_code)
    except LabError as exc:
        for line in exc.lines():  # one line each (several only for several problems of an input)
            error(line)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        if signals:  # the entry point owns its children; a caller in-process owns its own
            procs.kill_all()
        err.print("aborted", highlight=False)
        sys.exit(130)
    except Exception as exc:
        # usage errors from click (bundled inside typer in newer releases): they know how to
        # show themselves and carry their exit code (2 for usage)
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            usage_error(exc)
            sys.exit(EXIT_INPUT)
        full = _disk_full(exc)
        if full is not None:  # the machine's, not the lab's: exit 3 saying where
            if signals:
                procs.kill_all()
            error(full)
            sys.exit(EXIT_ENV)
        if signals:  # the entry point owns its children; a caller in-process owns its own
            procs.kill_all()
        where = crash_report(exc)
        saved = f"the traceback is in {where}" if where else "the traceback could not be saved"
        first = " ".join(str(exc).split())[:200]
        error(f"lab failure ({type(exc).__name__}{': ' + first if first else ''}); {saved}; "
              "please report it with that file")
        sys.exit(EXIT_ENV)
    finally:
        if signals:  # what a worker's code left behind (the lab is their subreaper)
            procs.sweep()


def _exit_now(code: int) -> None:
    """End the lab at once with ``code`` (after an abort: every child is killed already; the
    interpreter's shutdown would wait on the threads still reading their pipes). Runs
    multiprocessing's own finalizers first (a fuzz campaign's queue semaphores: left, the
    resource tracker warns of leaked ones)."""
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        try:
            mp_util._run_finalizers(0)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe
            pass
    os._exit(code)


def _written_file(exc: BaseException) -> str | None:
    """The file a failed write was writing (a write's OSError names none): the innermost frame
    of the traceback holding an open file or a path."""
    import io

    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        values = list(frame.f_locals.values())
        for value in values:  # an open file says it best
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                return value.name
        for value in values:
            if isinstance(value, Path):
                return str(value)
    return None


def _disk_full(exc: BaseException) -> str | None:
    """The one line for a full disk or an exceeded quota anywhere in ``exc``'s chain
    (``no space left on device: PATH``), else None."""
    import errno

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            where = exc.filename or _written_file(exc) or "a file the lab was writing"
            what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
            return (f"{what}: {where}; free some space there (or point --reports / "
                    "VLLM_REPRO_CACHE at a disk with room) and run it again")
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


if __name__ == "__main__":
    main()
