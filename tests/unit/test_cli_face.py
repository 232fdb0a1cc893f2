"""The command line as a vLLM debugger first meets it: ``--version`` (and the cached releases
with ``-v``), one line per command in ``--help``, the choices of a fixed-set option listed and
enforced in one line, shell completion, and no colour or bar when the output is not a terminal."""

from __future__ import annotations

import re

from vllm_repro.cli import SUMMARIES, app

WIDE = {"COLUMNS": "200", "TERM": "dumb"}


def test_version_and_the_cached_releases(cli, tmp_path):
    from vllm_repro import __version__

    proc = cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"vllm-repro {__version__}"
    cache = tmp_path / "cache"
    (cache / "sdists").mkdir(parents=True)
    (cache / "sdists" / "vllm-0.10.2.tar.gz").write_bytes(b"")
    (cache / "sdists" / "vllm-0.9.2.tar.gz").write_bytes(b"")
    (cache / "trees" / "0.10.2").mkdir(parents=True)
    (cache / "envs" / "0.10.2" / "bin").mkdir(parents=True)
    (cache / "envs" / "0.10.2" / "bin" / "python").write_text("")
    proc = cli("--version", "-v", env={"VLLM_REPRO_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    lines = [ln.split() for ln in proc.stdout.splitlines()]
    assert lines[1][-3:] == ["2", "vLLM", "release(s)"]
    # in version order (as strings 0.9.2 would come after 0.10.2), with what the cache holds
    assert lines[2:] == [["0.9.2", "sdist"], ["0.10.2", "sdist,", "tree,", "env"]]


def test_help_lists_every_command_in_one_line_each(cli):
    proc = cli("--help", env=WIDE)
    assert proc.returncode == 0, proc.stderr
    names = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert names == set(SUMMARIES)
    for name, summary in SUMMARIES.items():
        assert len(summary) <= 80 and summary.endswith(".") and "\n" not in summary
        [line] = [ln for ln in proc.stdout.splitlines() if re.search(rf"\s{re.escape(name)}\s", ln)
                  and summary[:20] in ln]
        assert summary in line, line
    assert "--version" in proc.stdout and "--install-completion" in proc.stdout


def test_a_fixed_set_option_lists_its_choices_and_refuses_others_in_one_line(cli, tmp_path):
    proc = cli("fuzz", "--help", env=WIDE)
    assert "scheduler|engine-core|v0-engine" in proc.stdout and "fcfs|priority" in proc.stdout
    bad = cli("run", "--tree", "thin", str(tmp_path / "x.yaml"), "--reports", str(tmp_path / "r"))
    assert bad.returncode == 2
    [line] = bad.stderr.strip().splitlines()
    assert line.startswith("error: ") and "'thin' is not one of 'full', 'slice', 'auto'" in line
    assert "vllm-repro run --help" in line
    assert not (tmp_path / "r").exists()


def test_shell_completion_is_typers(cli):
    proc = cli("--show-completion", "bash", env={"SHELL": "/bin/bash"})
    assert proc.returncode == 0, proc.stderr
    assert "_VLLM_REPRO_COMPLETE" in proc.stdout and "complete " in proc.stdout
    done = cli(env={"_VLLM_REPRO_COMPLETE": "complete_bash", "COMP_WORDS": "vllm-repro ca",
                    "COMP_CWORD": "1"})
    assert "campaign" in done.stdout and "catalog" in done.stdout


def test_no_colour_and_no_bar_when_not_a_terminal(cli, tmp_path):
    """Piped (as in CI or a log), a usage error and the version are plain text."""
    for args in (("--version",), ("matrix", "x.yaml", "--mode", "fast")):
        proc = cli(*args)
        assert "\x1b[" not in proc.stdout + proc.stderr, args
