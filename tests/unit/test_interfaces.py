"""The declared interfaces (engine/interfaces.py) are what the lab's classes implement: the
auditors are observers, the fake workers answer execute_model, every level's driver takes the
driver's arguments."""

import inspect
from types import SimpleNamespace

from vllm_repro.audit import Auditor
from vllm_repro.audit.v0 import V0Auditor
from vllm_repro.engine import interfaces
from vllm_repro.engine.fake_executor import FakeWorker
from vllm_repro.engine.run import LEVELS
from vllm_repro.engine.v0 import FakeV0Worker


def test_auditors_are_observers():
    adapter = SimpleNamespace(vllm_file="", caps=None)
    for cls in (Auditor, V0Auditor):
        obs = cls(adapter)
        assert isinstance(obs, interfaces.Observer), cls
        assert issubclass(obs.stop_exception, BaseException)
    assert not isinstance(object(), interfaces.Observer)


def test_fake_workers_answer_what_the_protocol_names():
    names = {n for n, _ in inspect.getmembers(interfaces.FakeWorker) if not n.startswith("_")}
    assert names == {"execute_model"}
    for cls in (FakeWorker, FakeV0Worker):
        assert all(callable(getattr(cls, n, None)) for n in names), cls


def test_every_level_has_a_driver_with_the_drivers_arguments():
    assert set(LEVELS) == {"scheduler", "engine-core", "v0-engine"}
    want = list(inspect.signature(interfaces.LevelDriver.__call__).parameters)[1:]
    for level, driver in LEVELS.items():
        assert list(inspect.signature(driver).parameters) == want, level
