"""What `vllm-repro run` and `prepare` say about a worker's import time."""

from vllm_repro.engine.host import Worker


def _worker(hello: dict) -> Worker:
    w = Worker.__new__(Worker)  # no process: only the hello is read
    w.hello = hello
    return w


def test_import_time_is_rounded_to_a_tenth_with_its_unit():
    assert _worker({"import_s": 10.708}).import_time == "10.7 s"
    assert _worker({"import_s": 1}).import_time == "1.0 s"


def test_import_time_before_the_worker_said_hello():
    assert _worker({}).import_time == "?"
    assert _worker({"import_s": None}).import_time == "?"
