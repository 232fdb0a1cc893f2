"""What a campaign asks: the releases (a range over the index), the seeds, the feature sets,
the fuzzer's options and each task's bound; the campaign's id and folder.

Releases come from the package index (:func:`vllm_repro.sources.index.list_releases`, the list
``bisect`` also reads), never from a list in the lab: the releases
(:func:`vllm_repro.sources.index.release_version`, the rule ``matrix`` and ``bisect`` share: no
pre-, dev- or local part, not yanked, post releases kept) inside the ``--releases`` range (a
``packaging`` specifier set such as ``>=0.10,<0.34``; empty: every one), from the first release with the V1 engine on
(:data:`vllm_repro.sources.prepare.FIRST_V1`: older releases have nothing the lab can drive;
a release in range whose tree turns out to lack the V1 scheduler is a ``refused`` task).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..errors import InputError
from ..records import Record

#: the feature sets a campaign may name (``--features``): the fuzzer's profiles
FEATURE_SETS = ("default", "single", "concurrent", "long", "mixed")


@dataclass
class CampaignSpec(Record):
    """The campaign's inputs (``spec.json`` in its folder). ``releases_range``: the
    ``--releases`` text; ``seeds``: the campaign seeds; ``features``: feature sets
    (:data:`FEATURE_SETS`), each searched in every task; ``examples``: the bound of each
    search (examples per feature set and task), ``time_s`` its safety cap in seconds;
    ``db``: the example database folder, None for none (the repeatable choice); ``shrink``:
    whether failures are shrunk (hypothesis's shrinker: most of a finding's cost)."""

    releases_range: str
    seeds: list[int]
    features: list[str]
    level: str = "scheduler"
    policy: str | None = None
    spec_decode: bool | None = None
    target: str | None = None
    examples: int = 200
    time_s: float = 600.0
    audit: bool = True
    db: str | None = None
    shrink: bool = True
    extra: dict = field(default_factory=dict)

    def campaign_id(self) -> str:
        """12 hex digits naming the campaign: a digest of the spec (the releases as a range, so
        a campaign resumed after a new release appeared is still the same campaign)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def parse_range(text: str | None) -> SpecifierSet:
    """``--releases`` as a :class:`SpecifierSet` (``None``: every release): the matrix's own
    parser (:func:`vllm_repro.matrix.parse_range`), so an empty or malformed range is the same
    InputError (exit 2) for both commands, never "every release" by accident."""
    from ..matrix import parse_range as matrix_range

    return SpecifierSet("") if text is None else matrix_range(text)


def select_releases(index: dict[str, dict], text: str | None, first_v1: str) -> list[str]:
    """The releases of ``index`` (:func:`~vllm_repro.sources.index.list_releases`'s
    ``{version: file dict}``) in the range ``text``, oldest first: releases as
    :func:`~vllm_repro.sources.index.release_version` says (post releases kept, yanked ones
    not), ``first_v1`` or newer. Raises InputError when none is left."""
    from ..sources.index import release_version

    spec = parse_range(text)
    out = []
    for name, f in index.items():
        v = release_version(name, bool(f.get("yanked")))
        if v is None or v < Version(first_v1):
            continue
        if spec.contains(v, prereleases=False):
            out.append(name)
    if not out:
        raise InputError(f"--releases {text!r}: no final V1 release ({first_v1} or newer) on the "
                         "index is in that range; widen it (e.g. '>=0.10,<0.34')")
    return sorted(out, key=Version)


def parse_features(text: str) -> list[str]:
    """``--features default,mixed`` -> the names, in order, once each. Raises InputError."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in FEATURE_SETS]
    if bad or not names:
        raise InputError(f"--features {text!r}: use one or more of {', '.join(FEATURE_SETS)}, "
                         "comma-separated")
    return names
