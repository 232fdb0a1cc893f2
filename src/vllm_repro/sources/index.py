"""A client for the package index's simple API, JSON form (PEP 691), with an HTML fallback (PEP 503).

It honours pip's configured index URL and CA bundle (:class:`vllm_repro.settings.IndexSettings`)
and the usual proxy variables. Used to find a vLLM release's sdist: its URL, sha256, size and
upload time (PEP 700), without ``pip download`` (which would try to build the sdist).
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from html.parser import HTMLParser

from ..errors import EnvError, IndexUnreachable, InputError
from ..settings import IndexSettings

#: how a user lists vLLM's releases on the index the lab reads (pip's own configuration, which
#: :meth:`~vllm_repro.settings.IndexSettings.from_pip` follows too)
LIST_RELEASES = "`pip index versions vllm` lists every release on the index"
JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"
HTML_ACCEPT = "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
TIMEOUT_S = 60


@dataclass(frozen=True)
class SdistInfo:
    """One release's source distribution on the index.

    ``size`` in bytes (None when the index does not say); ``upload_time`` in UTC (None when the
    index does not give PEP 700 data).
    """

    project: str
    version: str
    filename: str
    url: str
    sha256: str
    size: int | None
    upload_time: datetime | None
    #: ``sdist``, or ``wheel`` for a release the index has only as wheels (0.15.0, 0.15.1): its
    #: Python sources are taken from the wheel (``sources/sdist.py``)
    kind: str = "sdist"


def ssl_context(settings: IndexSettings) -> ssl.SSLContext:
    """An SSL context trusting pip's configured CA bundle, else the system's default store."""
    ctx = ssl.create_default_context()
    if settings.cert:
        try:
            ctx.load_verify_locations(cafile=settings.cert)
        except (OSError, ssl.SSLError) as exc:
            raise EnvError(f"cannot load the CA bundle {settings.cert} from pip's config: {exc}") from exc
    return ctx


def open_url(url: str, settings: IndexSettings, accept: str | None = None):
    """``urllib`` GET with the index's CA bundle; raises :class:`IndexUnreachable` (an
    :class:`EnvError`) on any network failure; an HTTP error status is raised as urllib's
    ``HTTPError`` for the caller to judge."""
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        if url.startswith("file:"):
            return urllib.request.urlopen(req, timeout=TIMEOUT_S)  # noqa: S310 - local index
        return urllib.request.urlopen(req, timeout=TIMEOUT_S, context=ssl_context(settings))  # noqa: S310
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise IndexUnreachable(f"the package index is unreachable: GET {url} failed: {reason}") from exc


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str, dict[str, str | None]]] = []
        self._href: str | None = None
        self._attrs: dict[str, str | None] = {}

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._attrs = dict(attrs)
            self._href = self._attrs.get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href, self._attrs))

    def handle_endtag(self, tag):
        if tag == "a":
            self._href = None


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def project_files(project: str, settings: IndexSettings | None = None) -> list[dict]:
    """All files of ``project`` on the index as PEP 691 file dicts (filename, url, hashes, ...).

    Raises :class:`InputError` when the index does not know the project (404) and
    :class:`EnvError` when the index cannot be reached or answers nonsense.
    """
    settings = settings or IndexSettings.from_pip()
    base = settings.index_url.rstrip("/") + "/"
    url = urllib.parse.urljoin(base, f"{project}/")
    try:
        with open_url(url, settings, accept=f"{JSON_ACCEPT}, {HTML_ACCEPT}") as resp:
            ctype = resp.headers.get("Content-Type", "")
            body = resp.read()
            final_url = resp.geturl()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise InputError(f"project {project!r} is not on the index {settings.index_url}") from exc
        raise EnvError(f"the package index answered HTTP {exc.code} for {url}") from exc
    if "json" in ctype:
        try:
            data = json.loads(body)
            files = data["files"]
        except (ValueError, KeyError) as exc:
            raise EnvError(f"the package index sent an unreadable JSON page for {url}") from exc
        for f in files:
            f["url"] = urllib.parse.urljoin(final_url, f["url"])
        return files
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    files = []
    for text, href, attrs in parser.links:
        full = urllib.parse.urljoin(final_url, href)
        path, _, frag = full.partition("#")
        hashes = {}
        if "=" in frag:
            algo, _, digest = frag.partition("=")
            hashes[algo] = digest
        files.append({"filename": text or path.rsplit("/", 1)[-1], "url": path, "hashes": hashes,
                      "yanked": attrs.get("data-yanked") is not None})
    return files


def sdist_name_version(filename: str, project: str = "vllm") -> str | None:
    """``vllm-0.10.1.1.tar.gz`` -> ``0.10.1.1``; None for anything that is not this project's sdist."""
    m = re.fullmatch(rf"{re.escape(project)}-(.+)\.tar\.gz", filename, flags=re.IGNORECASE)
    return m.group(1) if m else None


def release_version(name: str, yanked: bool = False):
    """The :class:`packaging.version.Version` of ``name`` when it is a release the lab's range
    commands (``matrix``, ``campaign``, ``bisect``'s span) go over, else None: a PEP 440 version
    with no pre-release, dev-release or local part, not yanked. Post releases are kept
    (``0.6.6.post1`` is a real release users install and bisect over; so is a four-part one
    like ``0.10.1.1``, which is not a post release to PEP 440). The one rule of the three
    commands, so they never disagree on which releases a range holds."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(name)
    except InvalidVersion:
        return None
    if yanked or v.is_prerelease or v.is_devrelease or v.local:
        return None
    return v


def list_releases(project: str = "vllm", settings: IndexSettings | None = None) -> dict[str, dict]:
    """``{version: file dict}`` for every sdist of ``project`` on the index (yanked ones included)."""
    out = {}
    for f in project_files(project, settings):
        version = sdist_name_version(f.get("filename", ""), project)
        if version:
            out[version] = f
    return out


def wheel_name_version(filename: str, project: str = "vllm") -> str | None:
    """``vllm-0.15.1-cp38-abi3-manylinux_2_31_x86_64.whl`` -> ``0.15.1``; None for anything that
    is not this project's wheel (PEP 427 names)."""
    m = re.fullmatch(rf"{re.escape(project)}-([^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl", filename,
                     flags=re.IGNORECASE)
    return m.group(1) if m else None


def list_versions(project: str = "vllm", settings: IndexSettings | None = None) -> dict[str, str]:
    """``{version: "sdist" or "wheel"}`` for every release of ``project`` on the index: ``sdist``
    where it has one, ``wheel`` where it has only wheels (yanked files left out)."""
    out: dict[str, str] = {}
    for f in project_files(project, settings):
        if f.get("yanked"):
            continue
        name = f.get("filename", "")
        version = sdist_name_version(name, project)
        if version:
            out[version] = "sdist"
        elif (version := wheel_name_version(name, project)) and version not in out:
            out[version] = "wheel"
    return out


def _wheel_of(version: str, files: list[dict], project: str) -> dict | None:
    """The wheel of ``version`` to take Python sources from: any platform tag (the Python files
    are the same in each), the smallest download; None when there is none."""
    wheels = [f for f in files if not f.get("yanked")
              and wheel_name_version(f.get("filename", ""), project) == version]
    return min(wheels, key=lambda f: (f.get("size") or 1 << 62, f["filename"])) if wheels else None


def find_sdist(version: str, project: str = "vllm", settings: IndexSettings | None = None) -> SdistInfo:
    """The sdist of ``project==version``, or, for a release the index has only as wheels, one of
    its wheels (``kind="wheel"``: see :func:`_wheel_of`).

    Raises :class:`InputError` naming the nearest known releases when the version does not exist,
    :class:`EnvError` when the index gives no sha256 for it (the lab refuses unchecked downloads).
    """
    files = project_files(project, settings)
    releases = {v: f for f in files if (v := sdist_name_version(f.get("filename", ""), project))}
    f = releases.get(version)
    kind = "sdist"
    if f is None and (f := _wheel_of(version, files, project)) is not None:
        kind = "wheel"
    if f is None:
        releases.update({v: {} for f in files if (v := wheel_name_version(f.get("filename", ""),
                                                                           project))})
        from packaging.version import InvalidVersion, Version

        try:
            want = Version(version)
            same = [v for v in releases if _same_version(v, want)]
            if same:  # 0.10.2.0 is 0.10.2 under PEP 440; the cache is keyed by the index's name
                raise InputError(f"vLLM {version} is published as {same[0]}; use --vllm {same[0]}")
            known = sorted(releases, key=lambda v: abs(_vkey(v) - _vkey(str(want))))[:3]
        except InvalidVersion:
            known = []
        hint = f"; nearest releases: {', '.join(sorted(known, key=_vkey))}" if known else ""
        raise InputError(f"vLLM {version} is not a release on the index{hint} ({LIST_RELEASES})")
    sha = (f.get("hashes") or {}).get("sha256")
    if not sha:
        raise EnvError(f"the index gives no sha256 for {f['filename']}; refusing an unchecked download")
    return SdistInfo(
        project=project,
        version=version,
        filename=f["filename"],
        url=f["url"],
        sha256=sha.lower(),
        size=f.get("size"),
        upload_time=_parse_time(f.get("upload-time")),
        kind=kind,
    )


def _same_version(name: str, want) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(name) == want
    except InvalidVersion:
        return False


def _vkey(v: str) -> float:
    """A rough numeric distance key for 'nearest release' hints (not an ordering used for logic)."""
    from packaging.version import InvalidVersion, Version

    try:
        rel = Version(v).release + (0, 0, 0, 0)
    except InvalidVersion:
        return 0.0
    return rel[0] * 1e6 + rel[1] * 1e3 + rel[2] + rel[3] * 1e-3
