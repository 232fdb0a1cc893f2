"""The release matrix (``vllm-repro matrix``): one scenario on every release in a range, in
each mode the release's :class:`~vllm_repro.engine.capabilities.Capabilities` allow.

Modes are overlays of the scenario (:func:`mode_scenario`): ``plain`` (as written), ``async``
(``async_scheduling: true``: ``AsyncScheduler``), ``spec`` (ngram spec decode,
:data:`SPEC_TOKENS` drafts a step, all accepted unless the scenario says) and ``prefix-caching``
(``enable_prefix_caching: true``); a mode the scenario already is (its own config has it) is the
plain run and is left out. Every mode of a release runs in one worker, through
:func:`vllm_repro.lab.run_pairs`; a mode whose feature the release lacks is refused by the
release's own adapter (exit 2) and shown ``n/a`` with the Capabilities' one-line reason
(:data:`MODE_FEATURE`), as is every run of a release without the engine the scenario's level
drives (:data:`LEVEL_NEEDS`). A mode with no meaning at the scenario's level (``async`` and
``spec`` at ``level: v0-engine``: :func:`level_refusal`) is not run and shown ``n/a`` on every
release. The releases come from the index (:func:`index_releases`), never from a list kept
here.

Writes ``<reports>/_matrix/<scenario>/matrix.json`` (:class:`~vllm_repro.records.MatrixReport`)
and ``matrix.png`` (:func:`draw`); each run's own report is under
``<reports>/<scenario>[.<mode>]/<release>/``, which a cell names relative to the reports folder
(:func:`cell_report` reads it back), so that a copied reports folder still holds its links.
"""

from __future__ import annotations

import contextlib
import shutil

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

from .errors import EXIT_ENV, EXIT_INPUT, EXIT_MISMATCH, EXIT_OK, InputError
from .records import MatrixCell, MatrixReport
from .scenario.schema import Scenario

Say = Callable[[str], None]

#: the modes, in the table's order
MODES = ("plain", "async", "spec", "prefix-caching")
#: the Capabilities feature (:data:`~vllm_repro.engine.capabilities.FEATURES`) a mode needs
MODE_FEATURE = {"async": "async scheduling", "spec": "spec decode"}
#: the scenario config field each mode's overlay turns on (:func:`mode_scenario`)
MODE_FIELD = {"async": "async_scheduling", "spec": "num_speculative_tokens",
              "prefix-caching": "enable_prefix_caching"}
#: what a scenario's ``level`` needs of a release, in the order they are checked: the
#: Capabilities generation or feature (:data:`~vllm_repro.engine.capabilities.GENERATIONS`,
#: :data:`~vllm_repro.engine.capabilities.FEATURES`) whose absence makes every run there ``n/a``
LEVEL_NEEDS = {"scheduler": ("v1-engine",), "engine-core": ("v1-engine", "engine-core"),
               "v0-engine": ("v0-engine",)}
#: ``--releases``' default: every final release from the first with a V1 engine scheduler
#: (``vllm/v1/core``; :func:`~vllm_repro.sources.prepare.require_v1_scheduler` refuses the
#: earlier ones)
DEFAULT_RANGE = ">=0.6.5"
#: drafts a step in the ``spec`` mode (where the scenario has no ``num_speculative_tokens``)
SPEC_TOKENS = 2
#: where the matrices go, under the reports folder (a scenario name never starts with ``_``)
MATRIX_DIR = "_matrix"


def parse_range(text: str | None):
    """``--releases`` as a :class:`packaging.specifiers.SpecifierSet` (``">=0.10,<0.34"``;
    default :data:`DEFAULT_RANGE`). Raises :class:`InputError` naming the option and the fix."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    raw = DEFAULT_RANGE if text is None else text.strip()
    try:
        spec = SpecifierSet(raw)
    except InvalidSpecifier:
        raise InputError(f"--releases {text!r}: not a PEP 440 version range; give one such as "
                         "'>=0.10,<0.34' or '==0.15.1'") from None
    if not str(spec):
        raise InputError("--releases '': an empty range; give one such as '>=0.10,<0.34'")
    return spec


def final_releases(versions: Iterable[str], specs) -> list[str]:
    """The releases among ``versions`` (:func:`~vllm_repro.sources.index.release_version`: no
    pre-, dev- or local part, ``0.11.0rc1`` left out; post releases such as ``0.6.6.post1``
    kept, as ``campaign`` and ``bisect`` keep them) that one of ``specs`` (a specifier set, or a
    list of them: their union) holds, oldest first; names that are not PEP 440 versions are
    skipped."""
    from .sources.index import release_version

    specs = specs if isinstance(specs, (list, tuple)) else [specs]
    chosen = []
    for v in versions:
        pv = release_version(v)
        if pv is not None and any(spec.contains(pv) for spec in specs):
            chosen.append((pv, v))
    return [v for _, v in sorted(chosen)]


def index_releases(specs, settings=None) -> list[str]:
    """The final releases of vLLM on the index (an sdist, or only wheels) in ``specs`` (a
    specifier set or a list of them, :func:`final_releases`). Raises :class:`InputError` when
    they hold none; :class:`~vllm_repro.errors.EnvError` when the index cannot be read."""
    from .sources.index import list_versions

    found = final_releases(list_versions("vllm", settings), specs)
    if not found:
        text = " | ".join(str(s) for s in (specs if isinstance(specs, (list, tuple)) else [specs]))
        raise InputError(f"--releases {text!r}: no final vLLM release on the index is in "
                         "that range; widen it")
    return found


def check_modes(modes: Iterable[str]) -> list[str]:
    """``--mode`` values in :data:`MODES` order (all when none). Raises :class:`InputError`
    for one that is not a mode."""
    asked = list(modes)
    for m in asked:
        if m not in MODES:
            raise InputError(f"--mode {m!r}: expected one of {', '.join(MODES)}")
    return [m for m in MODES if m in asked] if asked else list(MODES)


def mode_scenario(scenario: Scenario, mode: str) -> Scenario | None:
    """The scenario in ``mode``, named ``<name>.<mode>`` (``plain``: the scenario itself);
    None when the scenario already is that mode (its config has it on). Raises
    :class:`InputError` when the overlay makes the scenario invalid."""
    if mode == "plain":
        return scenario
    data = scenario.model_dump(mode="json", exclude_unset=True)
    config = data["config"]
    model = data.setdefault("model", {})
    if mode == "async":
        if scenario.config.async_scheduling:
            return None
        config["async_scheduling"] = True
    elif mode == "spec":
        if scenario.config.num_speculative_tokens:
            return None
        config["num_speculative_tokens"] = SPEC_TOKENS
        if not scenario.model.draft_tokens:
            model["draft_tokens"] = [scenario.model.token] * SPEC_TOKENS
    elif mode == "prefix-caching":
        if scenario.config.enable_prefix_caching:
            return None
        config["enable_prefix_caching"] = True
    else:
        raise InputError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    data["name"] = f"{scenario.name}.{mode}"
    from pydantic import ValidationError

    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InputError(f"{scenario.name} in mode {mode}: {where}: {first.get('msg')}") from None


def level_refusal(scenario: Scenario, mode: str) -> str | None:
    """Why ``mode`` has no meaning at the scenario's ``level`` on any release (one line), or
    None. At ``level: v0-engine`` the ``async`` and ``spec`` overlays set V1-only config fields
    (``engine/v0.py``'s ``V1_ONLY``, which the V0 adapter refuses on every release), so those
    cells are ``n/a``, not runs the release refused."""
    if scenario.level != "v0-engine":
        return None
    from .engine.v0 import V1_ONLY

    key = MODE_FIELD.get(mode)
    if mode == "spec":
        # the overlay sets num_speculative_tokens alone (a V1 drafter); V0 spec decode is its
        # SpecDecodeWorker with a drafter named in the scenario (speculative_model "[ngram]"),
        # which the overlay does not choose
        return ("level: v0-engine: the spec mode sets config.num_speculative_tokens alone, which "
                "V0 needs with a drafter (speculative_model: \"[ngram]\" in the scenario's "
                "config); the mode applies at level scheduler or engine-core")
    if key not in V1_ONLY:
        return None
    return (f"level: v0-engine: config.{key} is the V1 engine's (vLLM's V0 LLMEngine has no "
            f"{MODE_FEATURE[mode]} the lab drives); the mode applies at level scheduler or "
            "engine-core")


def _level_missing(level: str, caps, err) -> str | None:
    """Why the run's release lacks the engine ``level`` drives, or None: only a run the worker
    refused as such (``err``, its :class:`~vllm_repro.records.RunError`, has ``lacks_level``),
    said with the Capabilities' reason (:data:`LEVEL_NEEDS`; ``caps`` None when unknown), else
    the refusal's own message."""
    if err is None or not err.lacks_level:
        return None
    for need in (LEVEL_NEEDS.get(level, ()) if caps is not None else ()):
        reason = caps.refusal(need)
        if reason:
            return reason
    return err.message


def cell_report(reports: Path, cell: MatrixCell) -> Path | None:
    """The run's report folder of ``cell`` under ``reports`` (the folder its ``matrix.json``
    is in, two levels up): its ``report`` is relative to the reports folder; one written as an
    absolute path by an older lab is taken as it is. None when the cell has no report."""
    if not cell.report:
        return None
    p = Path(cell.report)
    return p if p.is_absolute() else Path(reports) / p


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def cell_for(release: str, mode: str, result, verdict, caps, report: Path | None,
             level: str = "scheduler", reports: Path | None = None) -> MatrixCell:
    """The cell of one run: its result (:class:`~vllm_repro.records.RunResult`) and verdict
    as outcome, exit code (``vllm-repro run``'s for that run alone: a crash, violation or stall
    the scenario expects on ``release`` is exit 0, ``expected``) and one-line cause; a run that
    ``vllm-repro run`` judges clean with
    audit findings outside the scenario's bug (a ``clean_on`` release) is ``clean``, exit 0,
    ``audit_findings`` and ``cause`` saying them; a run the release refused in a mode its
    Capabilities (``caps``, None when unknown) lack, or at a ``level`` whose engine it lacks
    (the worker's ``RunError.lacks_level``; :data:`LEVEL_NEEDS`), is ``n/a`` with their reason.
    A clean run where the scenario expects its bug (``verdict.ok`` False) is ``clean
    (unexpected)``, exit 1, as ``run`` judges it. ``report``: the run's folder, kept relative to
    ``reports`` when it is under it."""
    subs = result.substitutions or None
    where = None
    if report is not None:
        where = str(report)
        if reports is not None:
            try:
                where = Path(report).resolve().relative_to(Path(reports).resolve()).as_posix()
            except ValueError:
                pass
    observed = verdict.observed if verdict is not None else None
    err = result.error
    if result.outcome == "error" and err is not None and err.kind == "input":
        missing = _level_missing(level, caps, err)
        if missing:
            return MatrixCell(release, mode, "n/a", None, _one_line(missing), None, where, subs)
        feature = MODE_FEATURE.get(mode)
        if feature and caps is not None and not caps.supports(feature):
            return MatrixCell(release, mode, "n/a", None, _one_line(caps.refusal(feature)),
                              None, where, subs)
        return MatrixCell(release, mode, "refused", EXIT_INPUT, _one_line(err.message), observed,
                          where, subs)
    if result.outcome == "error":
        message = err.message if err is not None else "the run produced no result"
        return MatrixCell(release, mode, "error", EXIT_ENV, _one_line(message), observed, where,
                          subs)
    if result.outcome == "clean":
        if getattr(verdict, "ok", None) is False:
            # the scenario expects its bug here (a reproduces_on release) and the run went clean:
            # `vllm-repro run` says NO, exit 1; so does the cell
            why = verdict.reason or f"expected {verdict.expected}, observed {verdict.observed}"
            return MatrixCell(release, mode, "clean", EXIT_MISMATCH, _one_line(
                f"not what the scenario expects on {release}: {why}"), observed, where, subs)
        return MatrixCell(release, mode, "clean", EXIT_OK, None, observed, where, subs)
    also = getattr(verdict, "also", None)
    if result.outcome == "violation" and also and getattr(verdict, "ok", None) is True:
        # a clean_on release whose run went to its end without the scenario's own bug: clean,
        # as `vllm-repro run` judges it, with the audit's other findings said (verdict.py)
        from .verdict import violations_at

        n = len(also)
        shown = violations_at(also)
        cause = (f"{n} audit finding{'s' if n > 1 else ''} outside the scenario's own bug: "
                 f"{shown}; {also[0].code}: {also[0].message}")
        return MatrixCell(release, mode, "clean", EXIT_OK, _one_line(cause), observed, where,
                          subs, audit_findings=n)
    cause = observed or result.outcome
    if result.outcome == "crash" and result.crash is not None and result.crash.message:
        cause = f"{cause}: {result.crash.message}"
    if getattr(verdict, "ok", None) is True:
        # what the scenario expects on this release (its bug on a reproduces_on release, or
        # its fix's own outcome): `vllm-repro run` says ok, exit 0
        return MatrixCell(release, mode, result.outcome, EXIT_OK, _one_line(
            f"as the scenario expects on {release}: {cause}"), observed, where, subs,
            expected=True)
    return MatrixCell(release, mode, result.outcome, EXIT_MISMATCH, _one_line(cause), observed,
                      where, subs)


def run(scenario: Scenario, releases: list[str], modes: list[str], reports: Path,
        releases_range: str, jobs: int | None = None, say: Say = lambda s: None,
        source: str | None = None, timelines: bool = False,
        on_run: Callable | None = None) -> MatrixReport:
    """Run ``scenario`` on every release in every mode (:func:`mode_scenario`; the modes the
    scenario already is are left out) and return the matrix, written to
    ``<reports>/_matrix/<scenario>/matrix.json`` with its picture (``matrix.png``).

    A release's modes run in one worker (:func:`vllm_repro.lab.run_pairs`); an environment
    failure marks that release's cells ``error`` and the rest go on. ``timelines``: draw each
    run's ``timeline.png`` too (off by default: about 2 s a run, for a hundred and more runs);
    ``on_run(item)``: as each run ends (a progress bar)."""
    from .engine import capabilities
    from .lab import RunItem, run_pairs
    from .settings import cache_dir

    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    variants = [(m, sc) for m in modes if (sc := mode_scenario(scenario, m)) is not None]
    for m in modes:
        if all(m != v for v, _ in variants):
            say(f"{scenario.name}: mode {m} is the scenario as written (plain); left out")
    not_here = {m: why for m, _ in variants if (why := level_refusal(scenario, m))}
    for m, why in not_here.items():
        say(f"{scenario.name}: mode {m} is n/a on every release ({why})")
    items = [(m, RunItem(sc, v)) for v in releases for m, sc in variants if m not in not_here]
    run_pairs([item for _, item in items], reports, jobs=jobs, say=say, timelines=timelines,
               on_run=on_run)
    ran: dict = {}
    caps_of: dict = {}
    for mode, item in items:
        if item.version not in caps_of:
            caps_of[item.version] = capabilities.load(cache_dir(), item.version)
        cell = cell_for(item.version, mode, item.result, item.verdict, caps_of[item.version],
                        item.report_dir, scenario.level, reports)
        if cell.outcome == "n/a" and item.report_dir is not None:
            # refused before anything ran, for a mode the release lacks: no run to report (its
            # result.json said "error" and the reports index listed it as one); the cell says why
            shutil.rmtree(item.report_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                item.report_dir.parent.rmdir()  # <scenario>.<mode>/ when no release ran it
            cell.report = None
        ran[item.version, mode] = cell
    cells = [ran.get((v, m)) or MatrixCell(v, m, "n/a", None, _one_line(not_here[m]))
             for v in releases for m, _ in variants]
    report = MatrixReport(scenario=scenario.name, releases_range=releases_range,
                          releases=list(releases), modes=[m for m, _ in variants], cells=cells,
                          started=started, seconds=round(time.perf_counter() - t0, 1),
                          source=source)
    out = matrix_dir(reports, scenario.name)
    write(report, out)
    try:
        draw(report, out / "matrix.png")
    except Exception as exc:  # noqa: BLE001 - a failed picture never fails the matrix
        from .extras import why

        say(f"{scenario.name}: no matrix.png ({why(exc)})")
    return report


def matrix_dir(reports: Path, name: str) -> Path:
    """``<reports>/_matrix/<name>/``."""
    return Path(reports) / MATRIX_DIR / name


def write(report: MatrixReport, folder: Path) -> Path:
    """Write ``matrix.json`` into ``folder`` (made if missing; replaced whole); its path."""
    import json
    import os
    import tempfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "matrix.json"
    fd, tmp = tempfile.mkstemp(prefix=".matrix.", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(report.to_dict(), f, indent=1)
    os.replace(tmp, path)
    return path


#: a cell's colour in the picture and the table
COLOURS = {"clean": "#4caf50", "n/a": "#d9d9d9", "refused": "#ffb300", "error": "#e53935",
           "crash": "#8e24aa", "violation": "#8e24aa", "stall": "#8e24aa",
           "incomplete": "#8e24aa", "hang": "#8e24aa"}
STYLES = {"clean": "green", "n/a": "dim", "refused": "yellow", "error": "red"}


def draw(report: MatrixReport, path: Path) -> Path:
    """``matrix.png``: one row per release (oldest at the top), one column per mode, each cell
    coloured by its outcome (:data:`COLOURS`) and labelled with it; the title gives the
    scenario, the range, the counts and the time it took."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows, cols = report.releases, report.modes
    fig_h = 1.6 + 0.24 * max(1, len(rows))
    fig, ax = plt.subplots(figsize=(2.0 + 1.5 * max(1, len(cols)), fig_h))
    for i, release in enumerate(rows):
        for j, mode in enumerate(cols):
            cell = report.cell(release, mode)
            outcome = cell.outcome if cell is not None else "n/a"
            ax.add_patch(Rectangle((j, i), 0.96, 0.92, color=COLOURS.get(outcome, "#8e24aa")))
            label = outcome + (f" +{cell.audit_findings}" if cell is not None
                               and outcome == "clean" and cell.audit_findings else "")
            ax.text(j + 0.48, i + 0.46, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([j + 0.48 for j in range(len(cols))], cols, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.46 for i in range(len(rows))], rows, fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    clean = sum(1 for c in report.cells if c.outcome == "clean")
    ran = sum(1 for c in report.cells if c.outcome != "n/a")
    ax.set_title(f"{report.scenario} on {len(rows)} releases ({report.releases_range}): "
                 f"{clean} of {ran} runs clean, {report.seconds:.0f} s", fontsize=9, pad=24)
    seen = sorted({c.outcome for c in report.cells}, key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[o], label=o) for o in seen], loc="upper center",
              bbox_to_anchor=(0.5, 0.0), ncol=max(1, len(seen)), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(report: MatrixReport):
    """The rich table: release x mode, each cell its outcome (coloured)."""
    from rich.text import Text

    from .console import table as plain_table

    t = plain_table(("release", *report.modes), edge=False)
    for release in report.releases:
        row = []
        for mode in report.modes:
            cell = report.cell(release, mode)
            outcome = cell.outcome if cell is not None else "-"
            label = cell.label() if cell is not None else "-"
            row.append(Text(label, style=STYLES.get(outcome, "magenta")))
        t.add_row(Text(release), *row)
    return t


def cause_lines(report: MatrixReport) -> list[str]:
    """One line per cell that was not clean, or clean with audit findings outside the scenario's
    bug: ``<release> <mode>: <label> (exit N): cause`` (``n/a`` cells left out), then one per
    mode with its counts, then one per mode with ``n/a`` cells: which releases and why (the last
    one's reason, e.g. ``async: n/a on 16 releases (0.6.5 to 0.9.2): vLLM 0.9.2 has no
    AsyncScheduler (...)``)."""
    lines = [f"{c.release} {c.mode}: {c.label()} (exit {c.exit}): {c.cause}"
             for c in report.cells if c.outcome != "n/a" and (c.outcome != "clean" or c.cause)]
    for mode, counts in report.counts().items():
        ran = sum(n for o, n in counts.items() if o != "n/a")
        text = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        lines.append(f"{mode}: {counts.get('clean', 0)} of {ran} clean ({text})")
    for mode in report.counts():
        na = [c for c in report.cells if c.mode == mode and c.outcome == "n/a"]
        if na:
            span = na[0].release if len(na) == 1 else f"{na[0].release} to {na[-1].release}"
            n = f"{len(na)} release{'s' if len(na) > 1 else ''}"
            lines.append(f"{mode}: n/a on {n} ({span}): {na[-1].cause}")
    return lines


__all__ = ["MODES", "MODE_FEATURE", "MODE_FIELD", "LEVEL_NEEDS", "DEFAULT_RANGE", "SPEC_TOKENS",
           "parse_range", "final_releases", "index_releases", "check_modes", "mode_scenario",
           "level_refusal", "cell_report", "cell_for", "run", "matrix_dir", "write", "draw",
           "table", "cause_lines"]
