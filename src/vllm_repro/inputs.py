"""The one loading layer for what a user hands the lab: files (a scenario, a patch, a bundle's
records), folders (``--reports``, the cache ``VLLM_REPRO_CACHE``), YAML text and release names.

Every OS and parser failure becomes an :class:`~vllm_repro.errors.InputError` (exit 2) whose
one-line message names the path (and the field, where there is one), what is wrong with it
and what to do: a symlink loop, a dangling link, a folder where a file is expected, a regular
file where a folder is expected, a FIFO or device, a file the user may not read, bytes that
are not UTF-8, a file over :data:`MAX_SCENARIO_BYTES`, YAML deeper than :data:`MAX_YAML_DEPTH`
or with more than :data:`MAX_YAML_NODES` nodes, a complex key (``? [a, b]``), a key given
twice. Standard library and PyYAML only: it runs before anything heavy is imported.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import InputError

#: a scenario file larger than this is refused before it is read (the catalog's largest, a
#: generated stress workload, is about 23 KB)
MAX_SCENARIO_BYTES = 8 * 1024 * 1024
#: nesting of YAML collections (a scenario needs 4: requests -> item -> a list field)
MAX_YAML_DEPTH = 64
#: scalars, sequences and mappings in one YAML document, every alias counted as the nodes it
#: expands to (a 100,000-request workload is about a million)
MAX_YAML_NODES = 3_000_000
#: the longest integer (in digits) a YAML file may hold: Python's own limit on reading one
#: (``sys.get_int_max_str_digits``); no field of a scenario takes more than 20
MAX_INT_DIGITS = 4300
#: the longest release name accepted (PEP 440 versions of vLLM are under 30 characters)
MAX_RELEASE_CHARS = 64

_KIND = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _why(exc: OSError) -> str:
    """What an OS error on a path means, in words."""
    if exc.errno == errno.ELOOP:
        return "a symlink loop (a link that leads back to itself)"
    if exc.errno == errno.ENOTDIR:
        return "a path through a regular file (a part of it is a file, not a folder)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ENAMETOOLONG:
        return "a name too long for the file system"
    return exc.strerror or exc.__class__.__name__


def _stat(p: Path) -> os.stat_result | None:
    """``os.stat`` of ``p``, or None when nothing is there. A dangling symlink, a loop or a
    path through a file raise :class:`InputError` (the caller adds the fix)."""
    try:
        return os.stat(p)
    except FileNotFoundError:
        if os.path.islink(p):
            raise _Problem(f"a dangling symlink (to {os.readlink(p)}, which does not exist)") from None
        return None
    except OSError as exc:
        raise _Problem(_why(exc), exc.errno) from None
    except ValueError:  # an embedded NUL byte
        raise _Problem("a name with a NUL byte") from None


class _Problem(Exception):
    """What is wrong with a path; turned into an InputError with the path and the fix."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


def input_file(path: str | Path, what: str, fix: str, *, fifo_ok: bool = False) -> Path:
    """``path`` as a regular file that can be opened, or :class:`InputError`
    ``PATH: problem; fix``. ``what`` names it (``scenario file``), ``fix`` says what to give
    instead. ``fifo_ok``: a pipe is fine too (a log from ``<(kubectl logs ...)``)."""
    p = Path(path)
    try:
        st = _stat(p)
    except _Problem as exc:
        raise InputError(f"{p}: {exc}; {fix}") from None
    if st is None:
        raise InputError(f"{p}: no such {what}; {fix}")
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{p}: is a folder, not a {what}; {fix}")
    if not stat.S_ISREG(st.st_mode) and not (fifo_ok and stat.S_ISFIFO(st.st_mode)):
        kind = _KIND.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise InputError(f"{p}: is {kind}, not a {what}; {fix}")
    if not os.access(p, os.R_OK):
        raise InputError(f"{p}: permission denied (the {what} is not readable by uid "
                         f"{os.getuid()}); chmod u+r it or give a readable copy")
    return p


def read_text(path: str | Path, what: str, fix: str, *, max_bytes: int = MAX_SCENARIO_BYTES) -> str:
    """The UTF-8 text of a file checked by :func:`input_file`; over ``max_bytes`` bytes,
    unreadable or not UTF-8 is an :class:`InputError` naming the line of the first bad byte."""
    p = input_file(path, what, fix)
    try:
        with open(p, "rb") as fh:
            raw = fh.read(max_bytes + 1)
    except OSError as exc:
        raise InputError(f"{p}: cannot read the {what}: {_why(exc)}; {fix}") from None
    if len(raw) > max_bytes:
        raise InputError(f"{p}: the {what} is over {max_bytes // (1024 * 1024)} MiB (the lab's "
                         f"limit for it); {fix}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{p}: line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save "
                         f"the {what} as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def folder(path: str | Path, what: str, hint: str, *, create: bool = False,
           writable: bool = False, creatable: bool = False) -> Path:
    """``path`` as a folder (made, with its parents, when ``create``), absolute and resolved.

    :class:`InputError` ``PATH: problem; hint`` for a symlink loop, a regular file (or a
    file among its parents), a folder that cannot be made, or one the user may not write
    (``writable``); ``creatable``: a missing folder must be one the user could make (its
    nearest existing parent writable). ``what`` names it (``--reports folder``,
    ``VLLM_REPRO_CACHE``)."""
    p = Path(path).expanduser()
    # the first part of the path that exists must be a folder (or a link to one)
    probe = p
    while True:
        try:
            st = _stat(probe)
        except _Problem as exc:
            if exc.errno == errno.ENOTDIR and probe.parent != probe:
                probe = probe.parent  # the file in the way is named below
                continue
            raise InputError(f"{probe}: {exc} (the {what}); {hint}") from None
        if st is not None:
            break
        if probe.parent == probe:
            break
        probe = probe.parent
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else _KIND.get(
            stat.S_IFMT(st.st_mode), "not a folder")
        where = "" if probe == p else f" in the path {p}"
        raise InputError(f"{probe}: is {kind}, not a folder{where} (the {what}); {hint}")
    try:
        resolved = p.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        why = _why(exc) if isinstance(exc, OSError) else "a symlink loop (a link that leads back to itself)"
        raise InputError(f"{p}: {why} (the {what}); {hint}") from None
    if creatable and st is not None and probe != p and not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"{p}: cannot be made: {probe} is not writable by uid {os.getuid()} "
                         f"(the {what}); {hint}")
    if create:
        try:
            resolved.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"{p}: cannot make the {what}: {_why(exc)}; {hint}") from None
    if writable and resolved.is_dir() and not os.access(resolved, os.W_OK | os.X_OK):
        raise InputError(f"{p}: the {what} is not writable by uid {os.getuid()} (in a container: "
                         f"mount a folder that user may write, or run it with --user); {hint}")
    return resolved


def reports_dir(path: str | Path, *, create: bool = True) -> Path:
    """The ``--reports`` folder: writable, and made if missing when ``create`` (:func:`folder`;
    without ``create`` it is only checked, so that an input error found next leaves nothing)."""
    return folder(path, "--reports folder", "give --reports a folder you can write "
                  "(it is made if missing)", create=create, writable=True)


def output_file(path: str | Path, what: str, option: str, *, force: bool = False) -> Path:
    """A file the lab is about to write: refused (:class:`InputError`) when something is
    already there and ``force`` is false, or when it is a folder, a link or a special file (even
    with ``force``), or when its folder is missing."""
    p = Path(path)
    if os.path.lexists(p):
        if os.path.islink(p) or not p.is_file():
            kind = "a symlink" if os.path.islink(p) else ("a folder" if p.is_dir() else "not a regular file")
            raise InputError(f"{p}: is {kind}; give {option} the path of a new {what}")
        if not force:
            raise InputError(f"{p}: already exists; give {option} a new path, or add --force "
                             "to overwrite it")
    parent = p.parent if str(p.parent) else Path(".")
    try:
        st = _stat(parent)
    except _Problem as exc:
        raise InputError(f"{parent}: {exc} (the folder of {p}); give {option} a path in an "
                         "existing folder") from None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{p}: its folder {parent} does not exist; make it first or give "
                         f"{option} a path in an existing folder")
    return p


def open_append(path: str | Path, what: str, mode: str = "a"):
    """``path`` opened for appending (text, ``mode`` ``"a"`` or ``"ab"``), made if missing,
    never through a symlink (``O_NOFOLLOW``) and never anything but a regular file: a link
    planted at a log's place would have the lab append to the link's target. Raises
    :class:`InputError` ``PATH: is a symlink ...; remove it``."""
    p = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(p, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(p):
            raise InputError(f"{p}: is a symlink (to {os.readlink(p)}), not the {what}; the lab "
                             "writes only its own files: remove the link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = _KIND.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise InputError(f"{p}: is {kind}, not the {what}; remove it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode)


# ---- YAML ---------------------------------------------------------------------------------
def _yaml():
    import yaml

    return yaml


def check_yaml_shape(text: str, source: str | Path, *, max_depth: int = MAX_YAML_DEPTH,
                     max_nodes: int = MAX_YAML_NODES) -> None:
    """Walk the YAML event stream (the parser keeps a stack, it does not recurse) and refuse
    nesting deeper than ``max_depth`` or more than ``max_nodes`` nodes, before the composer
    (which recurses) builds anything. An alias counts as the nodes of what it names (``*a``
    where ``&a`` is a list of 1,000 items is 1,001 nodes): what the loader and pydantic expand
    it to. The fallback of :func:`load_yaml` where PyYAML has no C loader."""
    yaml = _yaml()
    depth = nodes = 0
    # anchors being built: (name, nodes when it began); sizes: nodes each anchor expands to
    open_anchors: list[tuple[str | None, int]] = []
    sizes: dict[str, int] = {}
    try:
        for event in yaml.parse(text, Loader=_loader_base()):
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                nodes += 1
                open_anchors.append((event.anchor, nodes - 1))
                if depth > max_depth:
                    raise InputError(_too_deep(source, event.start_mark, max_depth))
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
                anchor, began = open_anchors.pop()
                if anchor is not None:
                    sizes[anchor] = nodes - began
            elif isinstance(event, yaml.ScalarEvent):
                nodes += 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                nodes += sizes.get(event.anchor, 1)
            if nodes > max_nodes:
                raise InputError(_too_many(source, max_nodes))
    except yaml.YAMLError as exc:
        raise InputError(_yaml_error(source, exc, text)) from None
    except RecursionError:
        raise InputError(f"{source}: YAML nested too deep to read; flatten it") from None


def _too_deep(source, mark, max_depth: int) -> str:
    line = mark.line + 1 if mark is not None else "?"
    return (f"{source}: line {line}: YAML nested deeper than {max_depth} levels (the lab's "
            "limit, aliases expanded; a scenario needs about 4); flatten it")


def _too_many(source, max_nodes: int) -> str:
    return (f"{source}: more than {max_nodes:,} YAML nodes, aliases counted as what they expand "
            "to (the lab's limit); split the workload or make it smaller")


def check_node_shape(root, source: str | Path, *, max_depth: int = MAX_YAML_DEPTH,
                     max_nodes: int = MAX_YAML_NODES) -> None:
    """The checks of :func:`check_yaml_shape` on a composed node graph (the C loader's, where
    an alias is the very node it names): its height (an alias at depth 3 naming a 62-deep
    list is 65 deep) and its nodes with every alias expanded, each node's size computed once
    (no recursion, no expansion: a billion-node alias bomb costs its own few nodes). A node that
    contains itself (``&a [*a]``) is refused."""
    yaml = _yaml()
    scalar = yaml.ScalarNode
    if isinstance(root, scalar):
        return
    size: dict[int, int] = {}
    height: dict[int, int] = {}

    def kids(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        return [n for pair in node.value for n in pair]

    # iterative post-order over the collections (a scalar is 1 node, 0 high, never stacked);
    # a collection met again while it is open is a cycle
    opened: set[int] = set()
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            opened.discard(key)
            total, high = 1, 0
            for k in kids(node):
                if isinstance(k, scalar):
                    total += 1
                    continue
                total += size[id(k)]
                if height[id(k)] > high:
                    high = height[id(k)]
            high += 1
            size[key], height[key] = total, high
            if high > max_depth:
                raise InputError(_too_deep(source, node.start_mark, max_depth))
            if total > max_nodes:
                raise InputError(_too_many(source, max_nodes))
            continue
        if key in size:
            continue
        if key in opened:
            line = node.start_mark.line + 1 if node.start_mark else "?"
            raise InputError(f"{source}: line {line}: a YAML alias that contains itself (a "
                             "recursive anchor); write the value out")
        opened.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids(node)
                     if not isinstance(k, scalar) and id(k) not in size)


def _yaml_error(source: str | Path, exc: Exception, text: str = "") -> str:
    """``FILE: line N: invalid YAML: problem`` (+ a fix where the problem does not say one)."""
    yaml = _yaml()
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        where = f"line {mark.line + 1}: "
    elif isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow
        where = f"line {text.count(chr(10), 0, exc.position) + 1}: " if text else ""
    else:
        where = ""
    if isinstance(exc, yaml.reader.ReaderError):
        ch = exc.character
        problem = f"character #x{ord(ch) if isinstance(ch, str) else ch:04x} is not allowed in YAML"
    else:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if "maximum nesting depth" in str(problem):  # libyaml's own limit (1,000 levels)
        return _too_deep(source, mark, MAX_YAML_DEPTH)
    syntax = isinstance(exc, (yaml.scanner.ScannerError, yaml.parser.ParserError,
                              yaml.reader.ReaderError))
    return f"{source}: {where}invalid YAML: {problem}" + ("; fix the YAML syntax there" if syntax else "")


def _loader_base():
    """PyYAML's C safe loader (libyaml: about 20 times faster, and nesting past 1,000 levels
    is a parse error, not a recursion) where PyYAML was built with it, else the Python one."""
    yaml = _yaml()
    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _strict_loader():
    """A safe loader (:func:`_loader_base`) that refuses a key given twice (YAML would keep
    the last), a complex key (a list or mapping used as a key: ``? [a, b]``), a key that is not
    a string (``1:``, ``null:``) and an integer longer than Python reads (4,300 digits: a
    ``ValueError`` inside PyYAML, not a YAML error)."""
    yaml = _yaml()

    class StrictLoader(_loader_base()):
        pass

    def construct_int(loader, node):
        try:
            return yaml.SafeLoader.construct_yaml_int(loader, node)
        except ValueError:
            digits = sum(ch.isdigit() for ch in str(node.value))
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits:,} digits (at most "
                f"{MAX_INT_DIGITS:,}); write a number the field can take", node.start_mark) from None

    StrictLoader.add_constructor("tag:yaml.org,2002:int", construct_int)

    def construct_mapping(loader, node, deep=False):
        if not isinstance(node, yaml.MappingNode):
            raise yaml.constructor.ConstructorError(
                None, None, f"expected a mapping, found {node.id}", node.start_mark)
        seen = set()
        loader.flatten_mapping(node)
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                raise yaml.constructor.ConstructorError(
                    None, None, f"a {kind} used as a key (complex key `? ...`); keys are plain "
                    "names", key_node.start_mark)
            key = loader.construct_object(key_node, deep=deep)
            if not isinstance(key, str):  # every key of the lab's files is a name or an id
                kind = ("null" if key is None else "a boolean" if isinstance(key, bool) else
                        "a number" if isinstance(key, (int, float)) else f"a {type(key).__name__}")
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key_node.value!r} is {kind}, not a name; quote it "
                    f"(\"{key_node.value}\") or use a field name", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


def load_yaml(text: str, source: str | Path, **limits) -> object:
    """Parse YAML text once under the lab's limits with a strict safe loader
    (:func:`_strict_loader`): with the C loader, the document is composed (aliases shared, not
    expanded), checked (:func:`check_node_shape`) and only then constructed; without it, the
    event stream is checked first (:func:`check_yaml_shape`). Raises :class:`InputError`
    naming ``source`` and the line."""
    yaml = _yaml()
    loader_class = _strict_loader()
    fast = getattr(yaml, "CSafeLoader", None) is not None
    if not fast:
        check_yaml_shape(text, source, **limits)
    try:
        loader = loader_class(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            if fast:
                check_node_shape(node, source, **limits)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise InputError(_yaml_error(source, exc, text)) from None
    except RecursionError:
        raise InputError(f"{source}: YAML nested too deep to read; flatten it") from None


def load_json_file(path: str | Path, what: str, fix: str) -> object:
    """A JSON file (a bundle's manifest or verdict): :func:`read_text`, then parsed; a file
    that is not JSON is an :class:`InputError` naming the line."""
    import json

    text = read_text(path, what, fix)
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deep to read; {fix}") from None
    except ValueError as exc:
        line = getattr(exc, "lineno", None)
        where = f" line {line}:" if line else ""
        raise InputError(f"{path}:{where} not valid JSON ({getattr(exc, 'msg', exc)}); {fix}") from None


# ---- release names ------------------------------------------------------------------------
def release_name(value: str, where: str = "--vllm") -> str:
    """A release name as typed, checked for shape before the version parser sees it: printable
    ASCII and at most :data:`MAX_RELEASE_CHARS` characters (``0.10.2``, ``v0.10.2``)."""
    text = str(value)
    if len(text) > MAX_RELEASE_CHARS:
        raise InputError(f"{where}: a release name of {len(text)} characters (at most "
                         f"{MAX_RELEASE_CHARS}); give a vLLM version number such as 0.10.1.1")
    if not text.strip() or not all(33 <= ord(ch) < 127 for ch in text.strip()):
        raise InputError(f"{where} {text!r}: not a vLLM version number (printable ASCII such as "
                         "0.10.1.1)")
    return text
