"""The ``vllm-repro`` command line (typer): the app, its commands (one module each in
:mod:`vllm_repro.commands`) and :func:`main`, the entry point.

Exit codes (README, "Exit codes"): 0 observations match ``expect``; 1 mismatch or reproduction found;
2 usage or input error; 3 environment error (fetch, import, docker, ssh).
"""

from __future__ import annotations

import sys

import typer

from .commands import bisect, catalog, fuzz, prepare, remote, run, triage, verify
from .commands import slice as slice_
from .console import err, error
from .errors import EXIT_INPUT, LabError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Reproduce vLLM engine crashes on CPU with vLLM's real scheduler code.")

# the order of `vllm-repro --help`
app.command("run")(run.run)
app.command("prepare")(prepare.prepare)
app.add_typer(catalog.app, name="catalog")
app.command("triage")(triage.triage)
app.command("fuzz")(fuzz.fuzz)
app.command("slice")(slice_.slice_cmd)
app.command("verify")(verify.verify)
app.command("gpu-verify")(remote.gpu_verify)
app.command("gpu-judge")(remote.gpu_judge)
app.command("bisect")(bisect.bisect)


def main() -> None:
    """Entry point: one-line messages and the exit codes (README) for lab and input errors."""
    try:
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except LabError as exc:
        error(str(exc))
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:
        # usage errors from click (bundled inside typer in newer releases): they know how to
        # show themselves and carry their exit code (2 for usage)
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(EXIT_INPUT)
        raise


if __name__ == "__main__":
    main()
