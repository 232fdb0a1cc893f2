"""Read what ``vllm/logging_utils/dump_input.py`` logs when the V1 engine crashes.

``_dump_engine_exception`` logs three things (0.9.0 to 0.33, see that file):

- ``V1 LLM engine (vX) with config: <VllmConfig.__str__>`` -- ``key=value, key=value`` with
  ``max_seq_len``, ``enable_prefix_caching``, ``chunked_prefill_enabled`` (or
  ``enable_chunked_prefill``), ``speculative_config=SpeculativeConfig(...)``...
- the ``SchedulerOutput`` through ``prepare_object_to_dump``: ``Name(k=v, ...)`` objects,
  ``[...]`` lists, ``{k: v}`` dicts with unquoted keys, ``'...'`` strings, JSON scalars
  (``true``/``null``), ``anon_repr`` forms such as ``NewRequestData(req_id=x,
  prompt_token_ids_len=N,...)`` (no space after commas) and numpy arrays over several lines.
- ``SchedulerStats(num_running_reqs=N, num_waiting_reqs=M, gpu_cache_usage=f|kv_cache_usage=f,
  prefix_cache_stats=PrefixCacheStats(...), ...)``.

:func:`parse_repr` reads that notation leniently (it never raises; unreadable parts become raw
strings); :func:`read_config`, :func:`read_scheduler_output` and :func:`read_stats` turn the
pieces into plain values. Server arguments (``args: Namespace(...)`` and ``non-default args:
{...}``) are read with the same parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_BARE = re.compile(r"[^,()\[\]{}]*")
_DICT_KEY = re.compile(r"[^:,()\[\]{}]*")
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)")
_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")
_IDENT = re.compile(r"[A-Za-z_][\w.]*$")
_MAX_DEPTH = 64


class Call(dict):
    """A ``Name(k=v, ...)`` object: a dict of its keyword arguments; ``name`` and ``args``
    (positional arguments) as attributes."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.args: list[Any] = []
        #: its closing bracket was read (False: the text ended inside it, cut off)
        self.closed = False


class _Parser:
    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.n = len(text)
        #: the text ended inside a bracket or a string: it was cut off
        self.open_at_end = False
        #: the last separator looked for was the end of the text
        self.sep_at_end = False

    def ws(self) -> None:
        s, i, n = self.s, self.i, self.n
        while i < n and s[i] in " \t\n\r":
            i += 1
        self.i = i

    def value(self, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError("too deep")
        self.ws()
        if self.i >= self.n:
            return None
        c = self.s[self.i]
        if c in "'\"":
            return self.string(c)
        if c == "[":
            self.i += 1
            return self.seq("]", depth)
        if c == "(":
            self.i += 1
            return self.seq(")", depth)
        if c == "{":
            self.i += 1
            return self.mapping(depth)
        m = _BARE.match(self.s, self.i)
        token = m.group(0).strip()
        self.i = m.end()
        if self.i < self.n and self.s[self.i] == "(" and _IDENT.match(token):
            self.i += 1
            return self.call(token, depth)
        return scalar(token)

    def string(self, q: str) -> str:
        s, i = self.s, self.i + 1
        out = []
        while i < self.n:
            c = s[i]
            if c == "\\" and i + 1 < self.n:
                out.append(s[i + 1])
                i += 2
                continue
            if c == q:
                self.i = i + 1
                return "".join(out)
            out.append(c)
            i += 1
        self.i = self.n
        self.open_at_end = True
        return "".join(out)

    def _sep(self, close: str) -> bool:
        """After an item: True to go on (a comma), False at the closing bracket or the end."""
        self.ws()
        self.sep_at_end = self.i >= self.n
        if self.sep_at_end:
            self.open_at_end = True
            return False
        c = self.s[self.i]
        if c == ",":
            self.i += 1
            return True
        if c == close:
            self.i += 1
            return False
        if c in ")]}":  # a mismatched bracket: end this container here
            self.i += 1
            return False
        # junk: skip it up to the next separator
        m = _BARE.match(self.s, self.i)
        self.i = max(m.end(), self.i + 1)
        return self._sep(close)

    def seq(self, close: str, depth: int) -> list:
        out: list[Any] = []
        while True:
            self.ws()
            if self.i >= self.n:
                self.open_at_end = True
                return out
            if self.s[self.i] == close:
                self.i += 1
                return out
            out.append(self.value(depth + 1))
            if not self._sep(close):
                return out

    def mapping(self, depth: int) -> dict:
        out: dict[Any, Any] = {}
        while True:
            self.ws()
            if self.i >= self.n:
                self.open_at_end = True
                return out
            c = self.s[self.i]
            if c == "}":
                self.i += 1
                return out
            if c in "'\"":
                key: Any = self.string(c)
            else:
                m = _DICT_KEY.match(self.s, self.i)
                key = m.group(0).strip()
                self.i = m.end()
            self.ws()
            if self.i < self.n and self.s[self.i] == ":":
                self.i += 1
                out[key] = self.value(depth + 1)
            else:  # a set printed with braces
                out[key] = None
            if not self._sep("}"):
                return out

    def call(self, name: str, depth: int) -> Call:
        out = Call(name)
        while True:
            self.ws()
            if self.i >= self.n:
                self.open_at_end = True
                return out
            if self.s[self.i] == ")":
                self.i += 1
                out.closed = True
                return out
            m = _KWARG.match(self.s, self.i)
            if m:
                self.i = m.end()
                out[m.group(1)] = self.value(depth + 1)
            else:
                out.args.append(self.value(depth + 1))
            if not self._sep(")"):
                out.closed = not self.sep_at_end
                return out


def scalar(token: str) -> Any:
    """A bare token as a Python value: numbers, ``True``/``true``, ``None``/``null``, or the
    text itself."""
    if token in ("True", "true"):
        return True
    if token in ("False", "false"):
        return False
    if token in ("None", "null", ""):
        return None
    if _NUM.match(token):
        try:
            return int(token) if re.fullmatch(r"-?\d+", token) else float(token)
        except ValueError:
            return token
    return token


def parse_repr(text: str) -> Any:
    """Parse dump notation (see the module docstring) into dicts (:class:`Call` for objects),
    lists and scalars. Never raises: returns None for text it cannot read at all."""
    return _parse(text)[0]


def _parse(text: str) -> tuple[Any, bool]:
    """:func:`parse_repr`'s value and whether the text ended inside a bracket or a string (cut
    off: what is parsed is the part before the cut)."""
    parser = _Parser(text)
    try:
        return parser.value(), parser.open_at_end
    except (ValueError, RecursionError, IndexError):
        return None, False


def parse_pairs(text: str) -> dict[str, Any]:
    """Top-level ``key=value, key=value`` pairs (``VllmConfig.__str__``) as a dict."""
    v = parse_repr("X(" + text.rstrip().rstrip(",") + ")")
    return dict(v) if isinstance(v, dict) else {}


# ---- interpretations --------------------------------------------------------------------------
@dataclass
class DumpedRequest:
    """One request in the dumped SchedulerOutput (tokens; None where the dump does not say).

    ``new``: first scheduled in the crashing step (``scheduled_new_reqs``); else a cached
    (running or resumed) request. ``prompt_len`` is known for new requests only;
    ``num_computed_tokens`` is what the KV cache already held; ``num_scheduled`` what the step
    scheduled; ``num_output_tokens`` (0.33's dump) the tokens generated so far.
    """

    id: str
    new: bool
    num_computed_tokens: int
    num_scheduled: int | None = None
    prompt_len: int | None = None
    num_output_tokens: int | None = None
    max_tokens: int | None = None
    resumed: bool = False
    num_blocks: int | None = None
    spec_tokens: int = 0


@dataclass
class SchedulerOutputDump:
    """The dumped ``SchedulerOutput``: requests in dump order, totals, finished ids, and
    ``num_common_prefix_blocks`` (blocks shared by all running requests, per KV cache group)."""

    requests: list[DumpedRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int | None = None
    finished_req_ids: list[str] = field(default_factory=list)
    num_common_prefix_blocks: list[int] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    #: draft tokens per request the step scheduled (``num_spec_tokens_to_schedule``, newest
    #: releases), else the most spec tokens any dumped request carries; 0 when none
    num_spec_tokens: int = 0
    #: the step held structured-output requests (``structured_output_request_ids`` non-empty
    #: up to 0.10, ``has_structured_output_requests`` later); None when the dump does not say
    structured_output: bool | None = None
    #: the text ends before the SchedulerOutput closes (the log, or the line, was cut off
    #: mid-dump): ``requests`` are those printed whole before the cut
    cut: bool = False
    #: requests the cut fell in before what the draft needs of them was printed: left out of
    #: ``requests`` (their ids, ``...`` where the id itself is cut)
    cut_requests: list[str] = field(default_factory=list)
    #: requests the cut fell in after that: in ``requests``, their later fields unread
    partial_requests: list[str] = field(default_factory=list)
    #: how many requests the step scheduled, by its ``num_scheduled_tokens`` (one entry a
    #: request), where the dump shows that map whole; else None
    announced: int | None = None

    def cut_warning(self, line: int | None, running: int | None = None,
                    running_source: str | None = None) -> str | None:
        """One line when the dump is cut off: the requests read from it against the count
        announced (its ``num_scheduled_tokens``, else ``running`` from the scheduler stats at
        ``running_source``), and any request the cut fell in; None when it is whole."""
        if not self.cut:
            return None
        where = f" (line {line})" if line else ""
        n = len(self.requests)
        text = (f"the dumped SchedulerOutput{where} is cut off mid-line: {n} request(s) read "
                "from it")
        if self.announced is not None:
            text += f" of {self.announced} its num_scheduled_tokens announces"
        elif running is not None:
            text += (f" of {running} running by the scheduler stats ({running_source}); its "
                     "num_scheduled_tokens is cut off")
        else:
            text += "; how many it held is not in the log (its num_scheduled_tokens is cut off)"
        if self.partial_requests:
            text += (f" (the cut fell in {', '.join(self.partial_requests)}: its fields after "
                     "the cut are unread)")
        if self.cut_requests:
            text += (f"; left out: {', '.join(self.cut_requests)} (the cut fell in it before its "
                     "lengths)")
        missing = (self.announced if self.announced is not None else running or 0) - n
        if missing > 0:
            text += f"; {missing} request(s) missing from the draft"
        return text


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _list(v: Any) -> list:
    if isinstance(v, list):
        return v
    if isinstance(v, dict) and not isinstance(v, Call):
        return list(v)  # sets printed with braces
    return []


def _count_blocks(v: Any) -> int | None:
    """Blocks in ``block_ids`` (a list per KV cache group): those of the first group."""
    groups = _list(v)
    if groups and isinstance(groups[0], list):
        return len(groups[0])
    if groups and all(isinstance(x, int) for x in groups):
        return len(groups)
    return None


def read_scheduler_output(text: str) -> SchedulerOutputDump | None:
    """Interpret a dumped ``SchedulerOutput(...)`` (vLLM 0.8.x to 0.33 layouts; mirrors
    ``vllm/v1/core/sched/output.py``: ``NewRequestData``, ``CachedRequestData`` per request
    (0.9.x) or batched (0.10+)). None when the text is not one."""
    v, cut = _parse(text)
    if not isinstance(v, Call) or v.name != "SchedulerOutput":
        return None
    out = SchedulerOutputDump(cut=cut)
    sched = v.get("num_scheduled_tokens")
    sched = dict(sched) if isinstance(sched, dict) else {}
    spec = v.get("scheduled_spec_decode_tokens")
    spec = dict(spec) if isinstance(spec, dict) else {}

    def add(req: DumpedRequest) -> None:
        rid = req.id
        req.num_scheduled = _int(sched.get(rid))
        toks = spec.get(rid)
        req.spec_tokens = len(toks) if isinstance(toks, list) else 0
        out.requests.append(req)

    def readable(r: Any, fields: tuple[str, ...]) -> bool:
        """Whether a request of the dump is read: printed whole, or cut after ``fields`` (what
        the draft needs of it, of which one is enough) were printed whole (a value the cut fell
        in is not). One the cut fell in before that is left out and named in ``cut_requests``
        (``...`` marks an id the cut fell in; ``(id cut off)`` one with none)."""
        if not isinstance(r, dict):
            return False
        rid = r.get("req_id")
        last = list(r)[-1] if r else None
        if not cut or getattr(r, "closed", True):
            return rid is not None
        if rid is not None and last != "req_id" and any(
                k in r and k != last for k in fields):
            out.partial_requests.append(str(rid))
            return True
        out.cut_requests.append("(id cut off)" if rid is None else
                                f"{rid}..." if last == "req_id" else str(rid))
        return False

    for r in _list(v.get("scheduled_new_reqs")):
        if not readable(r, ("prompt_token_ids_len", "prompt_token_ids", "prefill_token_ids_len",
                            "prompt_embeds_shape")):
            continue
        plen = _int(r.get("prompt_token_ids_len"))
        if plen is None and isinstance(r.get("prompt_token_ids"), list):
            plen = len(r["prompt_token_ids"])
        if plen is None:  # prompt embeds: prefill_token_ids_len (newest), else the shape's rows
            plen = _int(r.get("prefill_token_ids_len")) or _embeds_rows(r.get("prompt_embeds_shape"))
        sp = r.get("sampling_params")
        max_tokens = _int(sp.get("max_tokens")) if isinstance(sp, dict) else None
        add(DumpedRequest(str(r["req_id"]), True, _int(r.get("num_computed_tokens")) or 0,
                          prompt_len=plen, max_tokens=max_tokens,
                          num_blocks=_count_blocks(r.get("block_ids"))))
    cached = v.get("scheduled_cached_reqs")
    if isinstance(cached, list):  # 0.8/0.9: one CachedRequestData per request
        for r in cached:
            if not readable(r, ("num_computed_tokens",)):
                continue
            add(DumpedRequest(str(r["req_id"]), False, _int(r.get("num_computed_tokens")) or 0,
                              resumed=bool(r.get("resumed_from_preemption")),
                              num_blocks=_count_blocks(r.get("new_block_ids"))
                              if r.get("resumed_from_preemption") else None))
    elif isinstance(cached, dict):  # 0.10+: one CachedRequestData with lists
        ids = [str(x) for x in _list(cached.get("req_ids"))]
        computed = _list(cached.get("num_computed_tokens"))
        outputs = _list(cached.get("num_output_tokens"))
        resumed_flags = _list(cached.get("resumed_from_preemption"))
        resumed_ids = {str(x) for x in _list(cached.get("resumed_req_ids"))}
        # cut inside it: a request whose num_computed_tokens is past the cut, or is the value the
        # cut fell in (the last field read), was printed only in part
        known = len(computed)
        if cut and not getattr(cached, "closed", True) and list(cached)[-1:] == ["num_computed_tokens"]:
            known -= 1
        for k, rid in enumerate(ids):
            if cut and k >= known:
                out.cut_requests.append(rid)
                continue
            resumed = (bool(resumed_flags[k]) if k < len(resumed_flags) else False) \
                or rid in resumed_ids
            add(DumpedRequest(rid, False, _int(computed[k]) or 0 if k < len(computed) else 0,
                              num_output_tokens=_int(outputs[k]) if k < len(outputs) else None,
                              resumed=resumed))
    out.total_num_scheduled_tokens = _int(v.get("total_num_scheduled_tokens"))
    if isinstance(v.get("num_scheduled_tokens"), dict) and (
            not cut or "total_num_scheduled_tokens" in v):  # the map whole: the field after it
        out.announced = len(sched)
    out.finished_req_ids = [str(x) for x in _list(v.get("finished_req_ids"))]
    out.preempted_req_ids = [str(x) for x in _list(v.get("preempted_req_ids"))]
    out.num_common_prefix_blocks = [x for x in _list(v.get("num_common_prefix_blocks"))
                                    if isinstance(x, int)]
    out.num_spec_tokens = _int(v.get("num_spec_tokens_to_schedule")) or max(
        (r.spec_tokens for r in out.requests), default=0)
    new_so = [r for r in _list(v.get("scheduled_new_reqs")) if isinstance(r, dict)
              and isinstance(r.get("sampling_params"), dict)
              and (r["sampling_params"].get("structured_outputs")
                   or r["sampling_params"].get("guided_decoding"))]
    if "has_structured_output_requests" in v:
        out.structured_output = bool(v["has_structured_output_requests"])
    elif "structured_output_request_ids" in v:
        out.structured_output = bool(_list(v["structured_output_request_ids"]))
    if new_so:  # a new request's sampling params name its grammar
        out.structured_output = True
    return out


def _embeds_rows(v: Any) -> int | None:
    """Rows of a dumped ``prompt_embeds_shape`` (``torch.Size([N, H])``): the prompt's tokens."""
    while isinstance(v, Call) and v.args:
        v = v.args[0]
    return _int(v[0]) if isinstance(v, list) and v else None


def read_stats(text: str) -> dict | None:
    """Interpret ``SchedulerStats(...)`` (``vllm/v1/metrics/stats.py``): running, waiting,
    KV cache usage (fraction ``gpu_cache_usage`` <= 0.10, ``kv_cache_usage`` later), prefix
    cache queries/hits. None when the text is not one."""
    v = parse_repr(text)
    if not isinstance(v, Call) or v.name != "SchedulerStats":
        return None
    out: dict[str, Any] = {}
    if _int(v.get("num_running_reqs")) is not None:
        out["running"] = _int(v["num_running_reqs"])
    if _int(v.get("num_waiting_reqs")) is not None:
        out["waiting"] = _int(v["num_waiting_reqs"])
    if _int(v.get("num_skipped_waiting_reqs")):  # newest releases: waiting, but passed over
        out["skipped_waiting"] = _int(v["num_skipped_waiting_reqs"])
    usage = v.get("gpu_cache_usage", v.get("kv_cache_usage"))
    if isinstance(usage, (int, float)) and not isinstance(usage, bool):
        out["kv_cache_usage_pct"] = round(float(usage) * 100, 1)
        out["gpu_cache_usage_raw"] = float(usage)
    pcs = v.get("prefix_cache_stats")
    if isinstance(pcs, dict) and _int(pcs.get("queries")) is not None:
        out["prefix_cache"] = f"queries={pcs['queries']} hits={pcs.get('hits')}"
        out["prefix_cache_queries"] = _int(pcs.get("queries"))
        out["prefix_cache_hits"] = _int(pcs.get("hits"))
    return out


_CONFIG_KEYS = ("max_seq_len", "max_model_len", "enable_prefix_caching",
                "chunked_prefill_enabled", "enable_chunked_prefill", "speculative_config",
                "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                "async_scheduling", "model",
                "served_model_name", "block_size", "max_num_seqs", "max_num_batched_tokens",
                "scheduling_policy", "num_gpu_blocks_override", "num_speculative_tokens",
                "long_prefill_token_threshold", "enforce_eager", "kv_cache_dtype")


def read_config(text: str) -> dict[str, Any]:
    """The scheduler-relevant fields of a dumped ``VllmConfig`` string or of server arguments
    (``Namespace(...)`` / ``{...}``), under their printed names; speculative config flattened
    to ``num_speculative_tokens`` and ``speculative_method``."""
    t = text.strip()
    if t.startswith("Namespace("):
        v = parse_repr(t)
        raw = dict(v) if isinstance(v, dict) else {}
    elif t.startswith("{"):
        v = parse_repr(t)
        raw = {str(k): x for k, x in v.items()} if isinstance(v, dict) else {}
    else:
        raw = parse_pairs(t)
    out = {k: raw[k] for k in _CONFIG_KEYS if k in raw}
    spec = raw.get("speculative_config")
    if isinstance(spec, str) and spec.startswith("{"):
        spec = parse_repr(spec)
    if isinstance(spec, dict):
        n = _int(spec.get("num_spec_tokens", spec.get("num_speculative_tokens")))
        if n:
            out["num_speculative_tokens"] = n
        method = spec.get("method")
        if isinstance(method, str):
            out["speculative_method"] = method
        elif isinstance(spec.get("model"), str):
            out["speculative_method"] = spec["model"]
    if "max_seq_len" in out and "max_model_len" not in out:
        out["max_model_len"] = out["max_seq_len"]
    if "chunked_prefill_enabled" in out and "enable_chunked_prefill" not in out:
        out["enable_chunked_prefill"] = out["chunked_prefill_enabled"]
    return out
