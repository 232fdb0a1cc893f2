"""vLLM's crash dump as real logs print it, release by release (issue 17, item 2): the
``SchedulerOutput`` / ``SchedulerStats`` reprs of 0.9 to the newest releases, read from the
corpus logs (``tests/data/crashlogs``) through the whole scanner, so a dump wrapped over lines or
cut by the excerpt is read the way ``triage`` reads it.

Reprs mirrored: ``vllm/v1/core/sched/output.py`` (``NewRequestData.anon_repr``,
``CachedRequestData``: one per request up to 0.9, batched lists from 0.10, ``resumed_req_ids``
set, ``new_token_ids_lens`` / ``all_token_ids_lens`` and ``num_spec_tokens_to_schedule`` in the
newest) and ``vllm/v1/metrics/stats.py`` (``SchedulerStats``: ``kv_cache_usage``,
``kv_cache_eviction_events``, ``num_skipped_waiting_reqs``, ``cudagraph_stats``, ``perf_stats``).
"""

from __future__ import annotations

from vllm_repro.triage import triage_log
from vllm_repro.triage.dump import read_scheduler_output, read_stats

from ..conftest import ROOT

CORPUS = ROOT / "tests" / "data" / "crashlogs"


def _dump(prefix: str):
    (log,) = CORPUS.glob(f"{prefix}-*.log")
    report, sc = triage_log(log)
    assert sc.dump is not None, log.name
    return report, sc.dump


def test_newest_cached_request_repr_with_spec_tokens():
    # yhfgyyf/vllm-deepseek-v4-sm89#43: resumed_req_ids=set(), new_token_ids_lens,
    # all_token_ids_lens={}, five KV cache groups, num_spec_tokens_to_schedule=6
    _, d = _dump("135")
    so = read_scheduler_output(d.scheduler_output)
    (r,) = so.requests
    assert (r.id, r.new, r.resumed) == ("chatcmpl-b1273fe0564cc030-965e8d89", False, False)
    assert (r.num_computed_tokens, r.num_scheduled, r.num_output_tokens, r.spec_tokens) == \
        (6035, 7, 1, 6)
    assert so.total_num_scheduled_tokens == 7
    assert so.num_common_prefix_blocks == [24, 0, 0, 0, 0]
    assert so.num_spec_tokens == 6 and so.structured_output is False
    # the stats line is cut by the excerpt after connector_prefix_cache_stats
    st = read_stats(d.stats)
    assert (st["running"], st["waiting"], st["kv_cache_usage_pct"]) == (1, 0, 0.3)


def test_newest_repr_without_num_spec_tokens_to_schedule_counts_the_spec_tokens():
    # vllm-project/vllm#41834: the same repr one step older, no num_spec_tokens_to_schedule
    _, d = _dump("138")
    so = read_scheduler_output(d.scheduler_output)
    (r,) = so.requests
    assert (r.num_computed_tokens, r.num_output_tokens, r.num_scheduled, r.spec_tokens) == \
        (84945, 5320, 3, 2)
    assert so.num_spec_tokens == 2
    assert read_stats(d.stats)["kv_cache_usage_pct"] == 34.3


def test_011_new_request_repr_wrapped_over_two_lines():
    # vllm-project/vllm#28125 (0.11's NewRequestData with mm_features and prompt_embeds_shape);
    # the stored copy wraps the dump inside block_ids, and the excerpt ends in the cached ids
    _, d = _dump("144")
    so = read_scheduler_output(d.scheduler_output)
    new = [r for r in so.requests if r.new]
    (r,) = new
    assert (r.prompt_len, r.num_computed_tokens, r.max_tokens, r.num_blocks) == (746, 320, 8000, 47)
    assert so.structured_output is None  # cut before the flags; no grammar in its params


def test_newest_new_request_repr_with_prefill_token_ids_len():
    # eugr/spark-vllm-docker#348: prompt_token_ids_len and prefill_token_ids_len, several KV
    # cache groups of block ids (the first group is counted), cut inside them
    _, d = _dump("145")
    (r,) = read_scheduler_output(d.scheduler_output).requests
    assert (r.new, r.prompt_len, r.max_tokens, r.num_blocks) == (True, 890, 32000, 4)


def test_prefill_token_ids_len_and_embeds_shape_stand_in_for_a_missing_prompt_len():
    so = read_scheduler_output(
        "SchedulerOutput(scheduled_new_reqs=[NewRequestData(req_id=a,prompt_token_ids_len=None,"
        "prefill_token_ids_len=40,block_ids=([1, 2, 3],),num_computed_tokens=0), NewRequestData("
        "req_id=b,prompt_token_ids_len=None,block_ids=([4],),num_computed_tokens=0,"
        "prompt_embeds_shape=torch.Size([12, 4096]))], num_scheduled_tokens={a: 40, b: 12})")
    assert [(r.id, r.prompt_len) for r in so.requests] == [("a", 40), ("b", 12)]


def test_stats_reprs_from_012_to_the_newest():
    seen = {}
    for prefix in ("133", "134", "136", "140", "141"):
        _, d = _dump(prefix)
        seen[prefix] = read_stats(d.stats)
    # 0.12 (LMCache#2238): kv_cache_eviction_events, a connector prefix cache
    assert seen["133"]["running"] == 1 and seen["133"]["prefix_cache_queries"] == 4
    # the newest (vllm#41125): num_skipped_waiting_reqs, cudagraph_stats, perf_stats
    assert (seen["136"]["running"], seen["136"]["waiting"], seen["136"]["kv_cache_usage_pct"]) == \
        (8, 0, 6.4)
    assert "skipped_waiting" not in seen["136"]  # 0 skipped: nothing to report
    assert read_stats("SchedulerStats(num_running_reqs=2, num_waiting_reqs=5, "
                      "num_skipped_waiting_reqs=3, kv_cache_usage=0.5)")["skipped_waiting"] == 3
    assert all(s["running"] == 1 for k, s in seen.items() if k in ("134", "140", "141"))


def test_a_dumped_step_with_spec_tokens_drafts_spec_decode(tmp_path):
    from vllm_repro.triage.scenario import draft_scenario

    (log,) = CORPUS.glob("135-*.log")
    report, sc = triage_log(log)
    text, _ = draft_scenario(report, sc, version="0.20.2")
    assert "num_speculative_tokens: 6  # derived:" in text


def test_a_dump_wrapped_mid_word_is_joined_back():
    # vllm-project/vllm#20558 (0.10.0's repr): the stored copy wraps the dump inside
    # "total_num_sche" / "duled_tokens=13", the second half without the logger header
    _, d = _dump("131")
    so = read_scheduler_output(d.scheduler_output)
    assert so.total_num_scheduled_tokens == 13
    (r,) = so.requests
    assert (r.new, r.prompt_len, r.num_scheduled, r.max_tokens, r.num_blocks) == (True, 13, 13, 15987, 1)
    assert so.num_common_prefix_blocks == [1] and so.structured_output is False
