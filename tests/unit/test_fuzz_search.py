"""The search's stop conditions without a release: a worker that fails like vLLM's grammar
compiler does, two bugs behind one ``exception@frame`` (#23215's empty grammar, #43920's
tuple-style ``items``), told apart by ``--target-message``; the shrinker bounded by runs."""

from __future__ import annotations

from dataclasses import replace

from vllm_repro.engine.capabilities import Capabilities
from vllm_repro.fuzz.search import SearchConfig, search
from vllm_repro.fuzz.strategies import DEFAULT
from vllm_repro.records import Crash, Frame, RunResult

CAPS = Capabilities("9.9", engine_core=True, events=("abort",), structured_outputs=True,
                    structured_backends=("xgrammar",))
WHERE = Frame(file="vllm/v1/structured_output/backend_xgrammar.py", function="compile_grammar")


class GrammarWorker:
    """Crashes as 0.12.0's xgrammar backend does: an empty EBNF grammar and a JSON schema with a
    list as ``items`` raise RuntimeError in compile_grammar, with their own messages."""

    capabilities = CAPS

    def __init__(self) -> None:
        self.runs = 0
        self.keep_going: set[bool] = set()

    def run(self, payload, _trace, audit=True, keep_going=False):
        self.runs += 1
        self.keep_going.add(keep_going)
        for r in payload["requests"]:
            so = r.get("structured_outputs") or {}
            if so.get("grammar") == "":
                msg = 'The root rule with name "root" is not found'
            elif isinstance((so.get("json") or {}).get("items"), list):
                msg = "items must be a boolean or an object"
            else:
                continue
            return RunResult(outcome="crash", crash=Crash(type="RuntimeError", message=msg,
                                                          where=WHERE, phase="schedule"))
        return RunResult(outcome="clean")


def _search(**kw):
    found = []
    kw.setdefault("use_database", False)
    cfg = SearchConfig(version="9.9", profile=replace(DEFAULT, kv_connectors=False), seed=3,
                       time_s=60, stop_on_first=True, target="crash:RuntimeError@", audit=False,
                       level="engine-core", **kw)
    worker = GrammarWorker()
    stats = search(0, cfg, None, None,
                   lambda kind, p: found.append(p) if kind == "finding" else None, worker=worker)
    return found, stats, worker


def test_the_target_message_picks_one_of_two_bugs_with_the_same_frame():
    for pattern, grammar_text in (("root rule", '"grammar": ""'), ("items must", "items")):
        found, _, worker = _search(target_message=pattern)
        assert len(found) == 1, pattern
        # a crash target is judged on the run's end, as the catalog judges an expected crash:
        # the audit keeps going past its findings (#46066's crash follows a REQ_STATE)
        assert worker.keep_going == {True}
        f = found[0]
        assert pattern.split()[0] in f.result.crash.message
        assert grammar_text.split(":")[0].strip('"') in str(f.scenario["requests"])


def test_the_shrinker_stops_after_shrink_runs_and_keeps_the_smallest_failure(tmp_path):
    from vllm_repro.fuzz.database import FindingsDatabase

    found, stats, worker = _search(target_message="root rule", shrink_runs=3,
                                   database=str(tmp_path), use_database=True)
    f = found[0]
    # hypothesis's final replay of the kept example fails as it did: the database keeps it
    assert FindingsDatabase(tmp_path, "engine-core").stored() >= 1
    assert f.examples - f.first_failure_example <= 3
    assert stats["examples"] == worker.runs == f.examples  # candidates past the bound never ran
    assert 'The root rule' in f.result.crash.message
    unbounded, _, _ = _search(target_message="root rule")
    assert unbounded[0].examples - unbounded[0].first_failure_example > 3


def test_a_release_refusing_input_is_counted_refused_not_found():
    """What the release refuses (a config at start-up, a prompt at the front door: V0's
    ``_validate_model_inputs`` from 0.8.4, the fuzzer's over-long V0 prompts) is ``refused``, never
    a finding; a ValueError anywhere else, or another exception at the front door, is a crash."""
    from vllm_repro.fuzz.search import _outcome_kind

    door = Frame(file="vllm/engine/llm_engine.py", function="_validate_model_input")

    def crash(type_, phase):
        return RunResult("crash", crash=Crash(type_, "x", door, phase=phase))

    assert _outcome_kind(crash("ValueError", "add_request")) == "refused"
    assert _outcome_kind(crash("ValueError", "engine-build")) == "refused"
    assert _outcome_kind(crash("ValueError", "schedule")) == "crash"
    assert _outcome_kind(crash("TypeError", "add_request")) == "crash"  # #29747's kind


class TwoBugWorker(GrammarWorker):
    """An empty grammar crashes with RuntimeError, a list as ``items`` with TypeError: two
    signatures, so a search shrinking one meets the other."""

    def run(self, payload, _trace, audit=True, keep_going=False):
        res = super().run(payload, _trace, audit, keep_going)
        if res.outcome == "crash" and res.crash.message.startswith("items"):
            res.crash.type = "TypeError"
        return res


def test_a_failure_met_while_shrinking_another_is_said_not_dropped():
    from vllm_repro.fuzz.search import Campaign

    found = []
    cfg = SearchConfig(version="9.9", profile=replace(DEFAULT, kv_connectors=False), seed=3,
                       time_s=60, stop_on_first=True, target=None, audit=False,
                       level="engine-core", use_database=False)
    stats = search(0, cfg, None, None,
                   lambda kind, p: found.append(p) if kind == "finding" else None,
                   worker=TwoBugWorker())
    assert len(found) == 1
    sigs = {f"crash:{t}@{WHERE.file}:compile_grammar" for t in ("RuntimeError", "TypeError")}
    assert found[0].signature in sigs
    # what the search met besides its finding: the other bug, and only that
    assert set(stats["others"]) == sigs - {found[0].signature}, stats["others"]
    camp = Campaign(findings={found[0].signature: found[0]}, others=stats["others"])
    line = camp.unshrunk()
    assert line.startswith("also failed, not shrunk") and (sigs - {found[0].signature}).pop() in line
    assert "--target" in line
    # a signature that is a finding too is not said again
    assert Campaign(findings={s: found[0] for s in sigs}, others=stats["others"]).unshrunk() is None


class SlowCleanWorker(GrammarWorker):
    """Never fails, and each run takes 50 ms: a search bounded by --time alone."""

    def run(self, payload, _trace, audit=True, keep_going=False):
        import time

        self.runs += 1
        time.sleep(0.05)
        return RunResult(outcome="clean")


def test_time_ends_the_search_at_the_next_example_not_the_chunks_end():
    """`fuzz --time 1s` ran 58 s (issue 47's breaker): time was looked at between chunks of 40
    examples only. Now the example after the deadline ends the search, nothing being shrunk."""
    import time

    cfg = SearchConfig(version="9.9", profile=replace(DEFAULT, kv_connectors=False), seed=3,
                       time_s=0.3, stop_on_first=True, target=None, audit=False,
                       level="engine-core", use_database=False)
    worker = SlowCleanWorker()
    t0 = time.perf_counter()
    stats = search(0, cfg, None, None, lambda kind, p: None, worker=worker)
    took = time.perf_counter() - t0
    assert stats["bound"] == "time"
    assert worker.runs < 20, worker.runs  # a chunk is 40; 0.3 s is about 6 runs of 50 ms
    assert took < 5, took
