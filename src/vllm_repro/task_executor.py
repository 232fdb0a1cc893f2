"""Where the lab's independent tasks run: local worker processes, or a Ray cluster.

One abstraction for every command that fans work out (``campaign``: a task per (release,
seed); ``catalog run``: a task per release; ``bisect``: a task per release of a round), so the
dispatch lives here once:

- :class:`LocalExecutor`: a :class:`concurrent.futures.ProcessPoolExecutor` of ``jobs``
  processes (``spawn``: a task starts from a clean interpreter, as a Ray worker does, so the two
  back ends run a task the same way);
- :class:`RayExecutor`: ``--ray auto`` starts a local Ray cluster bound to 127.0.0.1 (no
  dashboard, no usage statistics: nothing listens on or talks to another address), ``--ray
  ADDRESS`` joins an existing one (``ray start --head`` on one machine, ``ray start --address``
  on the others; each node needs the lab installed, and prepares releases in its own cache).
  An address on another host than this one's loopback (``127.0.0.0/8``, ``::1``,
  ``localhost``) is joined only with ``--ray-remote``: without it the lab refuses before it
  contacts anything (a mistyped or copied address would otherwise be dialled).
  A task asks for one CPU (``num_cpus=1``): it runs one engine worker at a time.

A task is a module-level function of one picklable argument returning a picklable value (the
campaign's and the catalog's tasks return typed records as dicts). :meth:`Executor.run` yields
``(index, TaskOutcome)`` as tasks complete, in completion order; a task that raised, or whose
process or node died, is an outcome with ``error`` set, never an exception of ``run`` (the
caller decides: a campaign records it and re-runs it on resume).

Errors: :class:`~vllm_repro.errors.InputError` for a ``--ray`` value that is not ``auto`` or
an address, or a non-loopback address without ``--ray-remote``;
:class:`~vllm_repro.errors.EnvError` when Ray is not installed or the cluster cannot be started
or joined.
"""

from __future__ import annotations

import ipaddress
import os
import re
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from .errors import EnvError, InputError

#: ``--ray``'s help text, shared by the commands that take it
RAY_HELP = ("Run the tasks on Ray: 'auto' starts a local cluster on 127.0.0.1, an address "
            "(host:port, ray://host:port) joins an existing one; one not on 127.0.0.1/localhost "
            "needs --ray-remote. Default: local worker processes.")
#: ``--ray-remote``'s help text
RAY_REMOTE_HELP = ("Allow --ray ADDRESS on another host (the lab connects to it); without it only "
                   "loopback addresses are joined.")

#: environment of a Ray cluster the lab starts or joins: no usage statistics sent anywhere
_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
#: Ray's switch of multi-machine clusters (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``)
_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _non_loopback_listeners() -> list[str]:
    """``address:port (process)`` of every TCP socket this process's descendants (a local Ray
    cluster's GCS, raylet, workers and agents) listen on outside the loopback addresses."""
    import psutil  # a dependency of Ray

    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            conns = proc.net_connections(kind="tcp")
            name = proc.name()
        except (psutil.Error, OSError):
            continue
        for c in conns:
            if c.status != psutil.CONN_LISTEN:
                continue
            ip = c.laddr.ip.removeprefix("::ffff:")
            if not (ip.startswith("127.") or ip == "::1"):
                out.append(f"{c.laddr.ip}:{c.laddr.port} ({name})")
    return out


@dataclass
class TaskOutcome:
    """What one task gave: its ``value``, or ``error`` (one line and a traceback's tail) when it
    raised or its process died."""

    value: Any = None
    error: str | None = None


def _guarded(fn: Callable[[Any], Any], arg: Any) -> TaskOutcome:
    """Run ``fn(arg)`` where the task runs; an exception becomes the outcome's ``error``."""
    try:
        return TaskOutcome(value=fn(arg))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which decides
        tail = traceback.format_exc()[-1500:]
        return TaskOutcome(error=f"{type(exc).__name__}: {exc}\n{tail}")


class Executor:
    """Base of the back ends: ``slots`` (tasks run at once), ``name`` (said to the user)."""

    name = "executor"
    slots = 1

    def run(self, fn: Callable[[Any], Any], args: list[Any]) -> Iterator[tuple[int, TaskOutcome]]:
        raise NotImplementedError

    def close(self, abort: bool = False) -> None:
        """Stop the back end; ``abort`` (an exception or an interrupt left the ``with``): do
        not wait for running tasks (an interrupted campaign resumes them)."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        self.close(abort=exc_type is not None)


class LocalExecutor(Executor):
    """``jobs`` local worker processes (spawned)."""

    def __init__(self, jobs: int) -> None:
        import multiprocessing as mp

        self.slots = max(1, jobs)
        self.name = f"{self.slots} local worker process{'es' if self.slots > 1 else ''}"
        self._pool = ProcessPoolExecutor(max_workers=self.slots, mp_context=mp.get_context("spawn"))

    def run(self, fn, args):
        futures = {self._pool.submit(_guarded, fn, a): i for i, a in enumerate(args)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    outcome = f.result()
                except BaseException as exc:  # noqa: BLE001 - the process died (BrokenProcessPool)
                    outcome = TaskOutcome(error=f"{type(exc).__name__}: {exc}")
                yield futures[f], outcome

    def close(self, abort: bool = False) -> None:
        self._pool.shutdown(wait=not abort, cancel_futures=True)


class RayExecutor(Executor):
    """Tasks as Ray remote functions (one CPU each) on a local cluster (``address`` None: started
    here, bound to 127.0.0.1) or on the cluster at ``address``."""

    def __init__(self, address: str | None, jobs: int | None = None) -> None:
        for k, v in _RAY_ENV.items():
            os.environ.setdefault(k, v)
        if address is None:
            # Ray's single-machine mode (its default on macOS and Windows): the node's address
            # is the loopback one, and every gRPC server of the cluster (GCS, raylet, workers,
            # agents) then listens on 127.0.0.1 only; read when ray is imported
            os.environ[_LOCAL_ONLY] = "0"
        try:
            import ray
            import ray._private.ray_constants as ray_constants
        except ImportError:
            raise EnvError("--ray needs Ray installed in the lab's environment: pip install "
                           "'vllm-repro[ray]' (make venv installs it)") from None
        if address is None:
            ray_constants.ENABLE_RAY_CLUSTER = False  # ray imported before this: the same
        self._ray = ray
        kwargs: dict[str, Any] = dict(configure_logging=False, log_to_driver=False,
                                      ignore_reinit_error=False)
        try:
            if address is None:
                # a local cluster: its processes bind to the loopback address only, with no
                # dashboard (its own HTTP server) and ``jobs`` CPUs (default: this machine's)
                self._started = True
                ray.init(num_cpus=jobs or os.cpu_count() or 1, include_dashboard=False,
                         _node_ip_address="127.0.0.1", **kwargs)
            else:
                self._started = False
                ray.init(address=address, **kwargs)
        except Exception as exc:  # noqa: BLE001 - ray raises many kinds here
            raise EnvError(f"--ray {address or 'auto'}: Ray could not "
                           f"{'start a local cluster' if address is None else 'join ' + address}: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        if address is None:
            exposed = _non_loopback_listeners()
            if exposed:
                ray.shutdown()
                raise EnvError("--ray auto: the local Ray cluster listened on "
                               f"{', '.join(exposed)} (not 127.0.0.1 only); stopped it")
        cpus = int(ray.cluster_resources().get("CPU", 1))
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        self.slots = max(1, cpus)
        where = "a local Ray cluster on 127.0.0.1" if address is None else f"the Ray cluster at {address}"
        self.name = f"{where} ({nodes} node{'s' if nodes != 1 else ''}, {cpus} CPU{'s' if cpus != 1 else ''})"
        self._remote = ray.remote(num_cpus=1, max_retries=0)(_guarded)

    def run(self, fn, args):
        ray = self._ray
        refs = {self._remote.remote(fn, a): i for i, a in enumerate(args)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    outcome = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the worker or node died
                    outcome = TaskOutcome(error=f"{type(exc).__name__}: {str(exc)[:1500]}")
                yield refs[ref], outcome

    def close(self, abort: bool = False) -> None:
        try:
            self._ray.shutdown()  # a cluster started here stops with it
        except Exception:  # noqa: BLE001 - nothing left to stop
            pass


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address's host part, ``[::1]`` brackets allowed) is this machine's
    loopback: ``localhost`` or a literal address in ``127.0.0.0/8`` or ``::1``. Any other name is
    not resolved (that would ask a DNS server) and counts as remote."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_ray(value: str | None, remote: bool = False) -> str | None:
    """``--ray``: None (local processes), ``auto`` or an address (``host:port``,
    ``ray://host:port``); a host that is not loopback (:func:`is_loopback`) only with
    ``remote`` (``--ray-remote``). Raises InputError otherwise, before anything is contacted."""
    if value is None:
        return None
    value = value.strip()
    if value == "auto":
        return value
    m = re.fullmatch(r"(?:ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):\d+", value)
    if not m:
        raise InputError(f"--ray {value!r}: give auto (a local cluster on 127.0.0.1) or a "
                         "cluster's address such as 127.0.0.1:6379 or ray://head:10001")
    if not remote and not is_loopback(m.group(1)):
        raise InputError(f"--ray {value!r}: {m.group(1)} is not this machine's loopback address; "
                         "to join a Ray cluster on another host add --ray-remote (the lab will "
                         "connect to it), or use --ray auto for a local cluster")
    return value


def open_executor(ray: str | None, jobs: int | None = None, remote: bool = False) -> Executor:
    """The back end ``--ray`` names (:func:`check_ray`; ``remote``: ``--ray-remote``), ``jobs``
    slots locally (default: the CPUs, at most 4) or CPUs of a cluster started here."""
    ray = check_ray(ray, remote)
    if ray is None:
        return LocalExecutor(jobs or max(1, min(4, os.cpu_count() or 1)))
    return RayExecutor(None if ray == "auto" else ray, jobs)


__all__ = ["Executor", "LocalExecutor", "RayExecutor", "TaskOutcome", "check_ray", "is_loopback",
           "open_executor",
           "RAY_HELP"]
