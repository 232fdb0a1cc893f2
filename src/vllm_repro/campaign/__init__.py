"""``vllm-repro campaign``: the fuzzer over a matrix of releases x seeds x feature sets.

:mod:`.spec` (what is asked: the release range, the matrix, the campaign's folder and its id),
:mod:`.task` (one task, (release, seed), run wherever the executor puts it:
:mod:`vllm_repro.task_executor`), :mod:`.report` (merging the tasks into one
:class:`~vllm_repro.records.CampaignReport`: the table, first and last releases, the shrunk
scenarios, the heat map), :mod:`.run` (the driver: resume, dispatch, progress).
"""
