"""The fuzzer's memory: hypothesis's example database in the lab's cache, keyed per level.

``<cache>/fuzz/examples/`` is a :class:`hypothesis.database.DirectoryBasedExampleDatabase`.
Hypothesis keys a test's examples by a digest of the test function; the fuzzer's test is built
afresh for every campaign (its machine class depends on the profile and the release's
capabilities), so :class:`FindingsDatabase` puts every campaign of a level under one key of its
own, ``vllm-repro-fuzz/v<MACHINE_VERSION>/<level>``: a failure found once is replayed first
(hypothesis's ``reuse`` phase) by the next campaign on the same release and by campaigns on
other releases, whatever their seed, profile or target.

One change to hypothesis's bookkeeping, on purpose: hypothesis deletes a stored failure from
the primary key when it replays without failing. Here that happens all the time without the
failure being gone: on a fixed release, on a release without the feature it needs, under
another ``--target``, or once its signature was already written this campaign. So deletes from
the primary key are dropped (the failure stays for the releases it fails on); ``move`` (a
failing example superseded by a smaller one during shrinking, sent to the secondary key) and
everything on the secondary and pareto keys behave as hypothesis expects. The primary key thus
holds the shrunk failures, one file each; ``vllm-repro fuzz --db none`` runs without memory,
and removing the folder forgets everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from .machine import MACHINE_VERSION

#: the sub-keys hypothesis appends to a test's key (``ConjectureRunner.sub_key``)
_SUB_KEYS = (b".secondary", b".pareto")


def default_path() -> Path:
    """``<cache>/fuzz/examples`` (:func:`vllm_repro.settings.cache_dir`; raises InputError for
    a cache that is not a folder)."""
    from ..settings import cache_dir

    return cache_dir() / "fuzz" / "examples"


def campaign_key(level: str) -> bytes:
    """The key every campaign of ``level`` stores its failures under."""
    return f"vllm-repro-fuzz/v{MACHINE_VERSION}/{level}".encode()


class FindingsDatabase(ExampleDatabase):
    """A directory database under ``path`` where every key hypothesis asks for is mapped to
    ``campaign_key(level)`` (with its ``.secondary`` / ``.pareto`` suffix kept), and replays that
    do not fail never delete a stored failure (see the module docstring). Writes that fail
    (a read-only cache, as in the CPU image) are dropped by hypothesis's directory database."""

    def __init__(self, path: Path, level: str) -> None:
        super().__init__()
        self.path = Path(path)
        self.key = campaign_key(level)
        self.inner = DirectoryBasedExampleDatabase(self.path)

    def _map(self, key: bytes) -> bytes:
        for sub in _SUB_KEYS:
            if key.endswith(sub):
                return self.key + sub
        return self.key

    def fetch(self, key: bytes) -> Iterable[bytes]:
        yield from self.inner.fetch(self._map(key))

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self._map(key), value)

    def delete(self, key: bytes, value: bytes) -> None:
        mapped = self._map(key)
        if mapped == self.key:
            return  # a failure that did not fail here still fails where it was found
        self.inner.delete(mapped, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self._map(src), self._map(dest), value)

    def stored(self) -> int:
        """How many failures the primary key holds."""
        return sum(1 for _ in self.inner.fetch(self.key))

    def __repr__(self) -> str:
        return f"FindingsDatabase({str(self.path)!r}, key={self.key.decode()!r})"
