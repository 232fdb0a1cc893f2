"""The lab's error classes and the CLI exit code each maps to (README, "Exit codes").

0: observations match ``expect``; 1: a mismatch or an unexpected reproduction; 2: usage or
input error (a scenario, a log, an argument); 3: environment error (index, download, hash,
environment build, docker, ssh). A lab or input error is never reported as a reproduction.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_INPUT = 2
EXIT_ENV = 3


class LabError(Exception):
    """Base class: a one-line message for the user and the exit code it maps to; ``more``:
    further problems of the same input, one line each (a scenario with several bad fields), which
    the command line prints one per line after the first (:meth:`lines`)."""

    exit_code = EXIT_ENV

    def __init__(self, message: str, more: tuple[str, ...] | list[str] = ()):
        super().__init__(message)
        self.message = message
        self.more = [" ".join(str(m).split("\n")) for m in more]

    def __str__(self) -> str:  # one line, always (with the count of the other problems)
        first = " ".join(self.message.split("\n"))
        return first + (f" (+{len(self.more)} more)" if self.more else "")

    def lines(self) -> list[str]:
        """Every problem, one line each: the message, then ``more``."""
        return [" ".join(self.message.split("\n")), *self.more]


class InputError(LabError):
    """Bad input: a scenario file, a log, a patch, an unknown release. Exit code 2."""

    exit_code = EXIT_INPUT


class EnvError(LabError):
    """The environment failed: index unreachable, hash mismatch, install or import failure,
    docker or ssh trouble. Exit code 3."""

    exit_code = EXIT_ENV


class IndexUnreachable(EnvError):
    """The package index (or the file server it points to) could not be reached at all: no
    answer, DNS, TLS or connection failure. An :class:`EnvError` (exit code 3); apart so that a
    caller that steps around a release whose own environment fails (``bisect``) still stops
    when the network is what failed."""
