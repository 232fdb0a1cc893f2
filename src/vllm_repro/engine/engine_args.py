"""What a ``level: v0-engine`` scenario's pass-through ``config:`` fields may be, as the
release's V0 ``EngineArgs`` (``vllm/engine/arg_utils.py``, a dataclass) declares them: a field
it lacks, and a value of the wrong type for the field's annotation.

vLLM's own command line parses each ``EngineArgs`` field with its argparse type (``--swap-space``
a float, ``--preemption-mode`` a string, ``--disable-async-output-proc`` a flag, ``--block-size``
one of its choices); the lab builds ``EngineArgs(**kwargs)`` directly, where a dataclass checks
nothing. So a value the command line could never have produced (``disable_async_output_proc:
"no"``, a truthy string that turns the setting on; ``swap_space: true``; ``block_size: 15``
where the field is a ``Literal``) is refused here instead of run, and a number for a field that
takes text is given as its text, as ``type=str`` would (:func:`as_command_line_text`). Used before
vLLM is imported (names, from the tree's source: ``scenario/release_fields.py``) and in the worker
(types, from the imported class: ``engine/v0.py``). Standard library only.
"""

from __future__ import annotations

import difflib
import types
import typing

NONE_TYPE = type(None)
#: the n-gram drafter's flat fields, which the V0 adapter folds into ``speculative_config`` where
#: the release's ``EngineArgs`` has no such field (``engine/v0.py:V0Adapter._fold_speculative``)
NGRAM_FLAT_FIELDS = ("speculative_model", "num_speculative_tokens", "ngram_prompt_lookup_max",
                     "ngram_prompt_lookup_min")


#: the vLLM config classes a scenario's pass-through ``config:`` field may belong to, in lookup
#: order; the last two are handed to ``VllmConfig`` as ``structured_outputs_config`` /
#: ``decoding_config`` (releases have one or the other, or neither): used by the worker
#: (``adapter/build.py``) and by the host's check before vLLM is imported
#: (``scenario/release_fields.py``) alike
PASSTHROUGH_CLASSES = ("SchedulerConfig", "CacheConfig", "ParallelConfig", "SpeculativeConfig",
                       "StructuredOutputsConfig", "DecodingConfig")
#: of those, the ones a release may lack altogether
OPTIONAL_PASSTHROUGH_CLASSES = ("StructuredOutputsConfig", "DecodingConfig")


def _near(key: str, known) -> str | None:
    """The one of ``known`` that ``key`` likely misspells, or None."""
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
    return near[0] if near else None


def _listed(keys: list[str], known) -> str:
    """``foo, max_num_seqz (did you mean max_num_seqs?)``: each key with the field it likely
    misspells."""
    return ", ".join(k + (f" (did you mean {near}?)" if (near := _near(k, known)) else "")
                     for k in keys)


def engine_arg_refusal(keys: str | list[str], version: str, known) -> str:
    """The one-line refusal of the ``config:`` field(s) ``keys`` vLLM ``version``'s
    ``EngineArgs`` (field names ``known``) lacks: each with the field it likely misspells, else
    drop it. One key: ``config.preemtion_mode: vLLM 0.6.3.post1 has no EngineArgs field
    'preemtion_mode' (level: v0-engine); did you mean preemption_mode?``; several: ``config:
    vLLM 0.7.3 has no EngineArgs fields foo, enable_chunked_prefil (did you mean
    enable_chunked_prefill?) at level: v0-engine; correct the misspelt names, drop the others
    for this release``."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    if len(keys) == 1:
        key = keys[0]
        near = _near(key, known)
        fix = f"did you mean {near}?" if near else "drop it for this release"
        return (f"config.{key}: vLLM {version} has no EngineArgs field {key!r} (level: "
                f"v0-engine); {fix}")
    guessed = sum(1 for k in keys if _near(k, known))
    fix = ("drop them for this release" if not guessed else "correct the misspelt names"
           if guessed == len(keys) else "correct the misspelt names, drop the others for this "
           "release")
    return (f"config: vLLM {version} has no EngineArgs fields {_listed(keys, known)} at level: "
            f"v0-engine; {fix}")


def passthrough_refusal(keys: list[str], version: str, classes, known) -> str:
    """The one-line refusal of the pass-through ``config:`` field(s) ``keys`` that none of the
    release's config ``classes`` (``SchedulerConfig``, ...; their field names and the lab's
    ``known``, for the likely misspelling) has, at the V1 levels. One key: ``config.blok_size:
    vLLM 0.10.2 has no such field in SchedulerConfig, ...; did you mean block_size? If not, check the
    name against that release's vllm/config, or drop it for this release``; several:
    ``config: vLLM 0.10.2 has no fields foo, blok_size (did you mean block_size?) in
    SchedulerConfig, ...; check the names ...``."""
    where = ", ".join(classes)
    if len(keys) == 1:
        near = _near(keys[0], known)
        guess = f"did you mean {near}? If not, " if near else ""
        return (f"config.{keys[0]}: vLLM {version} has no such field in {where}; {guess}check "
                "the name against that release's vllm/config, or drop it for this release")
    return (f"config: vLLM {version} has no fields {_listed(keys, known)} in {where}; check the "
            "names against that release's vllm/config, or drop them for this release")


def _accepts(value, annotation) -> tuple[bool, list[str]] | None:
    """Whether ``value`` fits ``annotation`` (``bool``, ``int``, ``float``, ``str``, ``None``,
    ``Optional`` / ``Union`` / ``X | None`` of those, ``Literal[...]``), with what would fit, as
    words; None when the annotation is none of those (not checked)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        ok = any(type(value) is type(c) and value == c for c in choices)
        return ok, [", ".join(repr(c) for c in choices)]
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        words: list[str] = []
        for arm in typing.get_args(annotation):
            got = _accepts(value, arm)
            if got is None:
                return None
            if got[0]:
                return True, []
            words += got[1]
        return False, words
    if annotation is NONE_TYPE or annotation is None:
        return value is None, ["null"]
    if annotation is bool:
        return isinstance(value, bool), ["true or false"]
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), ["a whole number"]
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), ["a number"]
    if annotation is str:
        return isinstance(value, str), ["a string"]
    return None


def as_command_line_text(value, annotation):
    """``value`` as the command line would have given it: a number for a field that takes a
    string and no number (``revision: 1.0``, ``show_hidden_metrics_for_version: 0.7``; a
    quoted ``"0.7"`` is refused at load as a quoted number) becomes its text, as argparse's
    ``type=str`` makes it; anything else is returned as it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        fits, as_text = _accepts(value, annotation), _accepts(str(value), annotation)
        if fits is not None and not fits[0] and as_text is not None and as_text[0]:
            return str(value)
    return value


def engine_arg_type_error(key: str, value, annotation, version: str) -> str | None:
    """The one-line refusal of ``config.<key>: value`` when it does not fit the release's
    ``EngineArgs`` annotation of that field (see :func:`_accepts`), else None (it fits, or the
    annotation is not one checked here)."""
    got = _accepts(value, annotation)
    if got is None or got[0]:
        return None
    words = [w for w in got[1] if w != "null"]
    want = " or ".join(dict.fromkeys(words)) or "null"
    if typing.get_origin(annotation) is typing.Literal or any(
            typing.get_origin(a) is typing.Literal for a in typing.get_args(annotation)):
        want = f"one of {want}"
    name = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
    takes_text = "a string" in words or any("'" in w for w in words)  # a Literal of strings
    quoted = " (without quotes)" if isinstance(value, str) and not takes_text else ""
    return (f"config.{key}: {yaml_word(value)} does not fit EngineArgs.{key} ({name}) of vLLM "
            f"{version}; write {want}{quoted}")


def yaml_word(value) -> str:
    """``value`` as the scenario's YAML wrote it, for a message: ``true``, ``null``, ``7``,
    ``'no'`` (a string quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)
