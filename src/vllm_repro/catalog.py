"""The catalog: real vLLM bugs, one scenario file each in ``scenarios/`` (not ``found/`` nor
``stress/``). ``vllm-repro catalog`` lists them with their releases and last verdicts;
``vllm-repro catalog run`` runs each on its ``reproduces_on`` and ``clean_on`` releases.
The commands are in :mod:`vllm_repro.commands.catalog`; this module holds what they list
and run.
"""

from __future__ import annotations

from .records import RecordError, ReportDir
import shutil
from pathlib import Path
from typing import Callable, Iterable

DEFAULT_DIR = Path("scenarios")


def log_signature(path: Path) -> tuple[str | None, dict | None, bool]:
    """The triage signature of a catalog ``<name>.log`` (:func:`vllm_repro.triage.triage_log`):
    ``(exception type, innermost vLLM frame {"module", "function", "line"}, cut)``. ``cut`` is
    True when the excerpt marks elided frames with ``[...]`` (the issue's traceback was not
    available whole): its innermost frame is then an outer frame of the crash. Raises
    :class:`~vllm_repro.errors.InputError` when triage finds no crash in it."""
    from .triage import triage_log

    report, _ = triage_log(path)
    cut = any(line.strip().endswith("[...]") for line in Path(path).read_text().splitlines()
              if not line.lstrip().startswith("#"))
    return report.exception_type, report.last_vllm_frame, cut


def catalog_files(directory: Path = DEFAULT_DIR) -> list[Path]:
    """The catalog's scenario files, sorted by name (sub-folders excluded)."""
    return sorted(p for p in directory.glob("*.yaml") if p.is_file())


def last_verdict(reports: Path, name: str, version: str, source_text: str | None = None) -> str:
    """``observed [ok]`` from the last run's ``result.json``, or ``never run`` (also for a
    report that cannot be read as a :class:`~vllm_repro.records.RunResult`). With
    ``source_text`` (the entry's file as the lab read it, ``Scenario.source_text``): a report
    whose ``scenario.yaml`` (written from the same text, ``report.pages.write_run_page``) is
    other text came from another file of the same ``name`` (a variant, an edit since) and is
    not the entry's verdict: ``not run as in the catalog (the last run was of another file
    named NAME)``."""
    from .report.pages import SCENARIO_FILE

    report = ReportDir(reports, name, version)
    try:
        data = report.read_result()
    except (OSError, RecordError):
        return "never run"
    if source_text is not None:
        try:
            ran = (report.path / SCENARIO_FILE).read_bytes().decode("utf-8")  # newlines kept
        except (OSError, UnicodeDecodeError):
            ran = source_text  # an older report without its scenario: as before
        if ran != source_text:
            return f"not run as in the catalog (the last run was of another file named {name})"
    v = data.verdict or {}
    ok = {True: "ok", False: "MISMATCH", None: "-"}.get(v.get("ok"), "-")
    return f"{v.get('observed', data.outcome)} [{ok}]"


def catalog_rows(directory: Path = DEFAULT_DIR, reports: Path = Path("reports")) -> list[tuple[str, ...]]:
    """The rows of ``vllm-repro catalog``, one per entry: name, issue, reproduces_on,
    clean_on, and the last verdict on each concrete release (from ``reports``). Raises
    :class:`~vllm_repro.errors.InputError` when ``directory`` is not a folder."""
    from .errors import InputError
    from .scenario import load_scenario

    if not directory.is_dir():
        raise InputError(f"{directory}: no such catalog folder (--directory)")

    rows = []
    for p in catalog_files(directory):
        sc = load_scenario(p)
        concrete = sc.vllm.concrete()
        lasts = "; ".join(f"{v}: {last_verdict(reports, sc.name, v, sc.source_text)}"
                          for v in concrete)
        rows.append((sc.name, sc.vllm.issue or "-", ", ".join(sc.vllm.reproduces_on),
                     ", ".join(sc.vllm.clean_on), lasts))
    return rows


def catalog_items(directory: Path, only: Iterable[str] = (), extra: Iterable[str] = (),
                  say: Callable[[str], None] = lambda _msg: None) -> list:
    """The runs of ``vllm-repro catalog run`` (:class:`vllm_repro.lab.RunItem`): each entry
    (those in ``only`` when given) on the releases its lists and ranges cover, then on the
    ``extra`` releases. An entry with no release here is said and left out (installed mode:
    the installed vLLM is outside its lists; an ``extra`` release without the engine of the
    entry's ``level`` is left out after its run by :func:`run_catalog`). Raises :class:`~vllm_repro.errors.InputError`,
    before anything runs, when ``directory`` holds no entry, an ``only`` name is no entry's, or
    an ``extra`` release is not a version number."""
    from .errors import InputError
    from .lab import RunItem, releases_for
    from .scenario import load_scenario
    from .sources.sdist import validate_version

    only = list(dict.fromkeys(only))
    extra = [validate_version(v) for v in extra]
    files = catalog_files(directory)
    if not files:
        raise InputError(f"{directory}: no catalog entries (*.yaml) found")
    loaded = [load_scenario(p) for p in files]
    names = [sc.name for sc in loaded]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise InputError(f"--only {', '.join(unknown)}: no such entry in {directory} (its entries: "
                         f"{', '.join(names)})")
    items = []
    for sc in loaded:
        if only and sc.name not in only:
            continue
        versions = releases_for(sc, [], covering=True)
        if not versions:
            say(f"{sc.name}: not run; its releases and ranges say nothing about the "
                "installed vLLM")
        items += [RunItem(sc, v) for v in versions]
        items += [RunItem(sc, v, also_on=True) for v in extra if v not in versions]
    return items


def _lacks_level(item) -> str | None:
    """Why ``item``, an ``--also-on`` release the entry expects nothing on, could not run: the
    release has no engine of the entry's ``level`` (e.g. a V0 entry on a release without the V0
    engine), as the worker recorded it (:class:`~vllm_repro.records.RunError` ``lacks_level``,
    from the engine's ``LevelMissing``); its message, else None."""
    r = item.result
    if not item.also_on or r is None or r.outcome != "error" or r.error is None:
        return None
    if item.scenario.vllm.expectation_for(item.version) is not None:
        return None
    return r.error.message if r.error.lacks_level == item.scenario.level else None


def run_catalog(items: list, reports: Path, *, audit: bool = True, jobs: int | None = None,
                say: Callable[[str], None] = lambda _msg: None, ray: str | None = None,
                ray_remote: bool = False, on_run: Callable | None = None) -> list:
    """Run the items (:func:`vllm_repro.lab.run_pairs`; with ``ray``, one task per release on
    that Ray back end, :func:`vllm_repro.lab.run_pairs_on`; ``ray_remote``: ``--ray-remote``,
    see :func:`vllm_repro.task_executor.check_ray`) and rewrite the reports' index; returns the
    items, each with its verdict. ``on_run(item)``: as each local run ends (a progress bar)."""
    from .lab import run_pairs, run_pairs_on
    from .report.index import write_index

    if ray is None:
        run_pairs(items, reports, audit=audit, jobs=jobs, say=say, on_run=on_run)
    else:
        from .task_executor import open_executor

        with open_executor(ray, jobs, ray_remote) as executor:
            say(f"catalog: releases run on {executor.name}")
            run_pairs_on(executor, items, reports, audit=audit, say=say)
    left_out = [(i, why) for i in items if (why := _lacks_level(i))]
    for item, why in left_out:
        # an --also-on release without the entry's engine says nothing about the entry
        say(f"{item.scenario.name}: not on {item.version} ({why})")
        items.remove(item)
        if item.report_dir is not None:
            shutil.rmtree(item.report_dir, ignore_errors=True)
    write_index(reports)
    return items
