"""Hostile inputs (issue 18): every one is exit 2 (or the code named) with one line on stderr
naming the file or field, never a traceback, never a run.

Each row builds its input under ``tmp_path`` and runs the real entry point
(:func:`vllm_repro.cli.main`) in-process; nothing here needs a release: every row is refused
before a release is prepared. The rows of the issue's "Why" section are marked ``# issue``.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_repro.cli import main

GOOD = textwrap.dedent("""\
    name: t
    vllm: {reproduces_on: ["0.10.1.1"], clean_on: ["0.10.2"]}
    config: {num_gpu_blocks: 8}
    requests:
      - {id: A, prompt_len: 10}
      - {id: B, prompt_len: 20, at_step: 2}
    events:
      - {at_step: 3, abort: [A]}
    expect: {outcome: crash}
    """)

LOG = "INFO vLLM is starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom\n"

SYMLINK_PATCH = textwrap.dedent("""\
    diff --git a/vllm/evil b/vllm/evil
    new file mode 120000
    index 0000000..1234567
    --- /dev/null
    +++ b/vllm/evil
    @@ -0,0 +1 @@
    +/etc/passwd
    \\ No newline at end of file
    """)


class Case:
    """What one row hands the CLI: the arguments, extra environment."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.env: dict[str, str] = {}

    def file(self, name: str, content: str | bytes) -> Path:
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        return p

    def loop(self, name: str = "loop") -> Path:
        p = self.tmp / name
        p.symlink_to(p.name)
        return p

    def scenario(self, text: str) -> Path:
        return self.file("s.yaml", text)

    def good(self) -> Path:
        return self.scenario(GOOD)

    def run(self, scenario: Path, *extra: str) -> list[str]:
        return ["run", str(scenario), "--vllm", "0.10.2", "--reports", str(self.tmp / "r"), *extra]


def edit(old: str, new: str):
    def build(c: Case):
        assert old in GOOD
        return c.run(c.scenario(GOOD.replace(old, new, 1)))
    return build


def with_env(build, **env):
    """A row run with these settings in the environment."""
    def wrapped(c: Case):
        c.env.update(env)
        return build(c)
    return wrapped


def deep_list(n: int) -> str:
    return GOOD + "description: " + "[" * n + "]" * n + "\n"


def deep_map(n: int) -> str:
    return GOOD + "description: " + "{a: " * n + "1" + "}" * n + "\n"


def fifo(c: Case) -> Path:
    p = c.tmp / "fifo.yaml"
    os.mkfifo(p)
    return p


def patch_case(text: str | bytes):
    def build(c: Case):
        return ["verify", str(c.good()), "--patch", str(c.file("fix.diff", text)),
                "--vllm", "0.10.1.1", "--reports", str(c.tmp / "r")]
    return build


def bundle_case(setup):
    def build(c: Case):
        b = c.tmp / "bundle"
        setup(c, b)
        return ["gpu-verify", "--remote", "nohost", "--bundle", str(b), "--reports", str(c.tmp / "r")]
    return build


def _bundle(c: Case, b: Path, manifest: str | None = "{}", verdict: str | None = '{"verified": false}'):
    b.mkdir()
    if manifest is not None:
        (b / "manifest.json").write_text(manifest)
    if verdict is not None:
        (b / "verdict.json").write_text(verdict)


def triage_case(content: str | bytes | None, *extra: str):
    def build(c: Case):
        log = c.file("crash.log", content) if content is not None else c.tmp / "crash.log"
        return ["triage", str(log), *extra]
    return build


def triage_out(make):
    """triage --scenario OUT where ``make(c)`` returns OUT (made to be refused)."""
    def build(c: Case):
        return ["triage", str(c.file("crash.log", LOG)), "--scenario", str(make(c))]
    return build


def cache_case(make):
    def build(c: Case):
        c.env["VLLM_REPRO_CACHE"] = str(make(c))
        return c.run(c.good())
    return build


ROWS = [
    # ---- the scenario file as a path --------------------------------------------------
    ("scenario-symlink-loop", lambda c: c.run(c.loop("s.yaml")), 2, "symlink loop"),  # issue
    ("scenario-dangling-link", lambda c: c.run(_dangling(c)), 2, "dangling symlink"),
    ("scenario-is-a-folder", lambda c: c.run(c.tmp), 2, "is a folder, not a scenario file"),
    ("scenario-missing", lambda c: c.run(c.tmp / "none.yaml"), 2, "no such scenario file"),
    ("scenario-fifo", lambda c: c.run(fifo(c)), 2, "FIFO"),
    ("scenario-char-device", lambda c: c.run(Path("/dev/null")), 2, "character device"),
    ("scenario-under-a-file", lambda c: c.run(c.file("f", "x") / "s.yaml"), 2,
     "a path through a regular file"),
    ("scenario-markup-in-name", lambda c: c.run(c.tmp / "[red]x[/].yaml"), 2, "[red]x[/].yaml"),
    # ---- the scenario file's bytes ------------------------------------------------------
    ("scenario-latin1-byte", lambda c: c.run(c.scenario(b"name: t\xe9\n")), 2,  # issue
     "line 1: not UTF-8 text (byte 0xe9)"),
    ("scenario-utf16", lambda c: c.run(c.scenario(GOOD.encode("utf-16"))), 2, "not UTF-8"),
    ("scenario-empty", lambda c: c.run(c.scenario("")), 2, "must hold a mapping"),
    ("scenario-nul-bytes", lambda c: c.run(c.scenario(b"name: t\n\x00\n")), 2,
     "line 2: invalid YAML: character #x0000 is not allowed"),
    ("scenario-oversized", lambda c: c.run(c.scenario(GOOD + "#" * (8 * 1024 * 1024) + "\n")), 2,
     "over 8 MiB"),
    # ---- YAML structure ---------------------------------------------------------------
    ("yaml-100000-deep-list", lambda c: c.run(c.scenario(deep_list(100_000))), 2,  # issue
     "nested deeper than 64 levels"),
    ("yaml-5000-deep-mapping", lambda c: c.run(c.scenario(deep_map(5000))), 2,  # issue
     "nested deeper than 64 levels"),
    ("yaml-65-deep-list", lambda c: c.run(c.scenario(deep_list(65))), 2, "deeper than 64"),
    ("yaml-deep-block-style", lambda c: c.run(c.scenario(
        GOOD + "description:\n" + "".join("  " * i + "- \n" for i in range(1, 80)))), 2,
     "deeper than 64"),
    ("yaml-complex-list-key", lambda c: c.run(c.scenario("name: t\n? [a, b]\n: 1\n")), 2,  # issue
     "a list used as a key"),
    ("yaml-complex-mapping-key", lambda c: c.run(c.scenario("name: t\n? {a: 1}\n: 1\n")), 2,
     "a mapping used as a key"),
    ("yaml-duplicate-key", edit("name: t", "name: t\nname: u"), 2, "key 'name' appears twice"),
    ("yaml-top-level-list", lambda c: c.run(c.scenario("- a\n- b\n")), 2, "must hold a mapping"),
    ("yaml-top-level-scalar", lambda c: c.run(c.scenario("just text\n")), 2, "must hold a mapping"),
    ("yaml-unclosed-bracket", lambda c: c.run(c.scenario("name: [t\n")), 2, "invalid YAML"),
    ("crash-log-given-to-run", lambda c: c.run(c.file("engine.log", LOG)), 2,
     "engine.log: a crash log, not a scenario file; read it with `vllm-repro triage "),
    ("crash-log-pasted-into-yaml", lambda c: c.run(c.file("s.yaml", "Error: x\n" + LOG)), 2,
     "s.yaml: a crash log, not a scenario file"),
    ("crash-log-read-as-a-mapping", lambda c: c.run(c.file("one.log", "ERROR 01-01 core.py:1] "
                                                              "EngineCore failed\n")), 2,
     "one.log: a crash log, not a scenario file"),
    ("field-at-the-wrong-level", lambda c: c.run(c.scenario("issue: vllm-project/vllm#1\n" + GOOD)),
     2, "issue: not a field here; issue goes under vllm: (vllm.issue)"),
    ("yaml-tab-indent", lambda c: c.run(c.scenario("name: t\nconfig:\n\tnum_gpu_blocks: 8\n")), 2,
     "invalid YAML"),
    ("yaml-python-tag", lambda c: c.run(c.scenario("name: !!python/object/apply:os.system [id]\n")),
     2, "invalid YAML"),
    ("yaml-merge-of-a-list", lambda c: c.run(c.scenario("a: &x [1]\nb: {<<: *x}\n")), 2,
     "invalid YAML"),
    ("yaml-int-key", lambda c: c.run(c.scenario(GOOD + "1: x\n")), 2, "key '1' is a number, not a name"),
    ("yaml-null-key", lambda c: c.run(c.scenario(GOOD + "null: x\n")), 2, "key 'null' is null, not a name"),
    # ---- numbers ----------------------------------------------------------------------
    ("arrival-time-nan", edit("{id: A, prompt_len: 10}", "{id: A, prompt_len: 10, arrival_time: .nan}"),
     2, "requests[0].arrival_time: Input should be a finite number"),  # issue
    ("arrival-time-inf", edit("{id: A, prompt_len: 10}", "{id: A, prompt_len: 10, arrival_time: .inf}"),
     2, "finite number"),  # issue
    ("arrival-time-minus-inf", edit("{id: A, prompt_len: 10}",
                                    "{id: A, prompt_len: 10, arrival_time: -.inf}"), 2, "finite number"),
    ("passthrough-nan", edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8, gpu_memory_utilization: .nan}"),
     2, "config.gpu_memory_utilization: nan is not a finite number"),
    ("prompt-len-negative", edit("{id: A, prompt_len: 10}", "{id: A, prompt_len: -4}"), 2,
     "requests[0].prompt_len"),
    ("prompt-len-string", edit("{id: A, prompt_len: 10}", '{id: A, prompt_len: "10"}'), 2,
     "requests[0].prompt_len"),
    ("prompt-len-bool", edit("{id: A, prompt_len: 10}", "{id: A, prompt_len: true}"), 2,
     "requests[0].prompt_len"),
    ("prompt-len-float", edit("{id: A, prompt_len: 10}", "{id: A, prompt_len: 1.5}"), 2,
     "requests[0].prompt_len"),
    ("max-tokens-zero", edit("{id: A, prompt_len: 10}", "{id: A, prompt_len: 10, max_tokens: 0}"), 2,
     "requests[0].max_tokens"),
    ("num-gpu-blocks-one", edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 1}"), 2,
     "config.num_gpu_blocks"),
    # ---- fields -----------------------------------------------------------------------
    ("misspelled-required-request-field", edit("{id: A, prompt_len: 10}", "{id: A, promt_len: 10}"),
     2, "requests[0].promt_len: unknown field; did you mean prompt_len? (prompt_len is required)"),
    ("misspelled-num-gpu-blocks", edit("{num_gpu_blocks: 8}", "{num_gpu_block: 8}"), 2,
     "config.num_gpu_block: unknown field; did you mean num_gpu_blocks?"),
    ("misspelled-top-level-field", edit("events:", "evnts:"), 2,
     "evnts: unknown field; did you mean events?"),
    ("missing-config", edit("config: {num_gpu_blocks: 8}\n", ""), 2, "config: missing required field"),
    ("missing-num-gpu-blocks", edit("{num_gpu_blocks: 8}", "{}"), 2,
     "config.num_gpu_blocks: missing required field"),
    ("missing-requests", lambda c: c.run(c.scenario("name: t\nconfig: {num_gpu_blocks: 8}\n")), 2,
     "requests: missing required field"),
    ("empty-requests", edit("requests:\n  - {id: A, prompt_len: 10}\n  - {id: B, prompt_len: 20, "
                            "at_step: 2}\n", "requests: []\n"), 2, "requests"),
    ("config-key-uppercase", edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8, Num-Blocks: 3}"), 2,
     "not a vLLM config field name"),
    ("config-passthrough-list", edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8, foo: [1]}"), 2,
     "only plain values pass through"),
    ("policy-unknown", edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8, policy: lifo}"), 2,
     "config.policy"),
    ("request-id-with-space", edit("{id: A, prompt_len: 10}", '{id: "A A", prompt_len: 10}'), 2,
     "requests[0].id"),
    ("request-id-65-chars", edit("{id: A, prompt_len: 10}", "{id: " + "a" * 65 + ", prompt_len: 10}"),
     2, "requests[0].id"),
    ("request-id-twice", edit("{id: B, prompt_len: 20", "{id: A, prompt_len: 20"), 2, "used twice"),
    ("name-with-slash", edit("name: t", "name: ../t"), 2, "name: names start with a letter or digit"),
    ("name-empty", edit("name: t", 'name: ""'), 2, "name"),
    ("description-a-list", edit("name: t", "name: t\ndescription: [a]"), 2, "description"),
    ("abort-unknown-id", edit("abort: [A]", "abort: [Z]"), 2, "unknown request id 'Z'"),
    # ---- names the reports folder needs, drafts vLLM never makes (a newcomer's finds) --------
    ("empty-output-past-max-steps",
     edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8}\nmodel: {empty_at: {A: [1000000000]}}"), 2,
     "model.empty_at.A: step 1000000000 is past limits.max_steps 500"),
    ("name-index-html", edit("name: t", "name: index.html"), 2, "a name the lab uses inside the reports"),
    ("name-engine-logs", edit("name: t", "name: _engine"), 2, "a name the lab uses inside the reports"),
    ("name-300-chars", edit("name: t", "name: " + "n" * 300), 2, "300 characters, over 120"),
    ("drafts-without-spec-decode", edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8}\nmodel: {draft_tokens: [1, 2]}"),
     2, "model.draft_tokens: spec decode is off"),
    ("more-drafts-than-spec-tokens", edit("{num_gpu_blocks: 8}",
                                          "{num_gpu_blocks: 8, num_speculative_tokens: 2}\n"
                                          "model: {draft_tokens: [1, 2, 3, 4, 5]}"), 2,
     "5 drafts, over config.num_speculative_tokens 2"),
    # ---- the machine's limits (vllm_repro.limits) ---------------------------------------------
    ("kv-pool-a-billion-blocks", edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 1000000000}"), 2,  # issue
     "config.num_gpu_blocks: 1,000,000,000 is over this machine's limit"),
    ("kv-pool-over-the-setting", with_env(edit("{num_gpu_blocks: 8}", "{num_gpu_blocks: 9}"),
                                          VLLM_REPRO_MAX_KV_BLOCKS="8"), 2,
     "over the limit of 8 VLLM_REPRO_MAX_KV_BLOCKS sets"),
    ("tokens-over-the-setting", with_env(lambda c: c.run(c.good()), VLLM_REPRO_MAX_TOKENS="29"), 2,
     "prompt_len + max_tokens"),
    ("steps-over-the-setting", with_env(edit("abort: [A]}", "abort: [A]}\nlimits: {max_steps: 50}"),
                                        VLLM_REPRO_MAX_STEPS="40"), 2, "limits.max_steps: 50 is over"),
    ("limit-setting-not-a-number", with_env(lambda c: c.run(c.good()), VLLM_REPRO_MAX_KV_BLOCKS="lots"),
     2, "VLLM_REPRO_MAX_KV_BLOCKS='lots': expected a positive whole number"),
    ("trace-limit-setting-negative", with_env(lambda c: c.run(c.good()), VLLM_REPRO_MAX_TRACE_MB="-1"),
     2, "VLLM_REPRO_MAX_TRACE_MB='-1'"),
    ("abort-before-arrival", edit("{at_step: 3, abort: [A]}", "{at_step: 1, abort: [B]}"), 2,  # issue
     "B arrives at step 2, after this abort at step 1"),
    ("event-past-max-steps", edit("abort: [A]}", "abort: [A]}\nlimits: {max_steps: 2}"), 2,
     "past limits.max_steps 2"),
    ("request-past-max-steps", edit("at_step: 2}", "at_step: 9}\nlimits: {max_steps: 5}"), 2,
     "requests[1].at_step 9 is past limits.max_steps 5"),
    ("expect-message-bad-regex", edit("{outcome: crash}", '{outcome: crash, message: "(("}'), 2,
     "not a valid regular expression"),
    ("sliding-window-without-window", edit("{num_gpu_blocks: 8}",
                                           "{num_gpu_blocks: 8, kv_cache_groups: [{type: sliding_window}]}"),
     2, "sliding_window"),
    # ---- releases in the file and on the command line -----------------------------------
    ("release-in-both-lists", edit('clean_on: ["0.10.2"]', 'clean_on: ["0.10.2", "0.10.1.1"]'), 2,  # issue
     "vllm.reproduces_on: release 0.10.1.1 is also in vllm.clean_on"),
    ("release-in-a-range-of-the-other", edit('clean_on: ["0.10.2"]', 'clean_on: [">=0.10"]'), 2,
     "is also in vllm.clean_on ('>=0.10')"),
    ("release-banana-in-file", edit('clean_on: ["0.10.2"]', 'clean_on: ["banana"]'), 2,
     "neither a release version nor a version range"),
    ("release-5000-digits-in-file", edit('clean_on: ["0.10.2"]', 'clean_on: ["' + "9" * 5000 + '"]'),
     2, "vllm.clean_on: a release of 5000 characters is neither"),
    ("vllm-banana", lambda c: ["run", str(c.good()), "--vllm", "banana", "--reports", str(c.tmp / "r")],
     2, "'banana' is not a vLLM version number"),
    ("vllm-5000-digits", lambda c: ["run", str(c.good()), "--vllm", "9" * 5000, "--reports",
                                    str(c.tmp / "r")], 2, "a release name of 5000 characters"),
    ("vllm-empty", lambda c: ["run", str(c.good()), "--vllm", "", "--reports", str(c.tmp / "r")], 2,
     "not a vLLM version number"),
    ("vllm-with-space", lambda c: ["run", str(c.good()), "--vllm", "0.10 .2", "--reports",
                                   str(c.tmp / "r")], 2, "not a vLLM version number"),
    ("vllm-fullwidth-digits", lambda c: ["run", str(c.good()), "--vllm", "\uff10.10.2", "--reports",
                                         str(c.tmp / "r")], 2, "not a vLLM version number"),
    ("prepare-long-name", lambda c: ["prepare", "1" * 100], 2, "a release name of 100 characters"),
    ("bisect-good-banana", lambda c: ["bisect", str(c.good()), "--good", "banana"], 2,
     "not a vLLM version number"),
    ("catalog-also-on-banana", lambda c: ["catalog", "run", "--also-on", "banana", "--reports",
                                          str(c.tmp / "r")], 2, "not a vLLM version number"),
    # ---- --reports ----------------------------------------------------------------------
    ("reports-symlink-loop", lambda c: c.run(c.good())[:-1] + [str(c.loop())], 2,  # issue
     "symlink loop (a link that leads back to itself) (the --reports folder)"),
    ("reports-a-regular-file", lambda c: c.run(c.good())[:-1] + [str(c.file("f", "x"))], 2,
     "is a regular file, not a folder (the --reports folder)"),
    ("reports-under-a-regular-file", lambda c: c.run(c.good())[:-1] + [str(c.file("f", "x") / "r")],
     2, "not a folder in the path"),
    ("reports-dangling-link", lambda c: c.run(c.good())[:-1] + [str(_dangling(c))], 2,
     "dangling symlink"),
    # ---- VLLM_REPRO_CACHE ---------------------------------------------------------------
    ("cache-a-regular-file", cache_case(lambda c: c.file("cachefile", "x")), 2,  # issue
     "is a regular file, not a folder (the VLLM_REPRO_CACHE folder)"),
    ("cache-under-a-regular-file", cache_case(lambda c: c.file("cachefile", "x") / "sub"), 2,
     "not a folder in the path"),
    ("cache-symlink-loop", cache_case(lambda c: c.loop()), 2, "symlink loop"),
    ("cache-char-device", cache_case(lambda c: Path("/dev/null")), 2, "character device"),
    # ---- crash logs (triage) ------------------------------------------------------------
    ("log-symlink-loop", lambda c: ["triage", str(c.loop("crash.log"))], 2, "symlink loop"),
    ("log-a-folder", lambda c: ["triage", str(c.tmp)], 2, "is a folder, not a crash log"),
    ("log-missing", triage_case(None), 2, "no such crash log"),
    ("log-char-device", lambda c: ["triage", "/dev/zero"], 2, "character device"),
    ("log-empty", triage_case(""), 2, "the log is empty"),
    ("log-gzip", triage_case(gzip.compress(LOG.encode())), 2, "gzip-compressed"),
    # NUL runs are padding (a copy out of a container), dropped; lone NULs amid bytes are binary
    ("log-nul-bytes", triage_case(b"INFO x\n\x7fELF\x02\x01\x01\x00\x03\x00>\x00\x01\n"), 2,
     "line 2: binary data"),
    ("log-nul-padding-only", triage_case(b"\x00" * 5000), 2,
     "the log is empty (only 5000 NUL bytes of padding)"),
    ("log-nul-padding-no-crash", triage_case(b"INFO x\n\x00\x00\n"), 2, "no crash found"),
    ("log-vllm-banana", triage_case(LOG, "--vllm", "x" * 80), 2, "a release name of 80 characters"),
    ("triage-scenario-exists", triage_out(lambda c: c.file("old.yaml", "keep me")), 2,  # issue
     "already exists; give --scenario a new path, or add --force"),
    ("triage-scenario-a-folder", triage_out(lambda c: c.tmp), 2, "is a folder"),
    ("triage-scenario-a-symlink", triage_out(lambda c: _dangling(c)), 2, "is a symlink"),
    ("triage-scenario-folder-missing", triage_out(lambda c: c.tmp / "no" / "d.yaml"), 2,
     "does not exist"),
    # ---- patches (verify) ---------------------------------------------------------------
    ("patch-creates-symlink", patch_case(SYMLINK_PATCH), 2, "the patch makes a symlink"),  # issue
    ("patch-creates-submodule", patch_case(SYMLINK_PATCH.replace("120000", "160000")), 2,
     "makes a submodule"),
    ("patch-mode-change-to-link", patch_case("diff --git a/vllm/x.py b/vllm/x.py\nold mode 100644\n"
                                             "new mode 120000\n"), 2, "makes a symlink"),
    ("patch-outside-vllm", patch_case("--- a/../etc/passwd\n+++ b/../etc/passwd\n"), 2,
     "a fix may only change files under vllm/"),
    ("patch-rename-outside", patch_case("diff --git a/vllm/x.py b/setup.py\nrename from vllm/x.py\n"
                                        "rename to setup.py\n"), 2, "renames or copies 'setup.py'"),
    ("patch-not-a-diff", patch_case("hello\n"), 2, "not a unified diff"),
    ("patch-latin1", patch_case(b"--- a/vllm/x.py\n+++ b/vllm/x.py\n+caf\xe9\n"), 2, "not UTF-8"),
    ("patch-missing", lambda c: ["verify", str(c.good()), "--patch", str(c.tmp / "no.diff"),
                                 "--vllm", "0.10.1.1"], 2, "no such patch file"),
    ("patch-a-folder", lambda c: ["verify", str(c.good()), "--patch", str(c.tmp), "--vllm", "0.10.1.1"],
     2, "is a folder, not a patch file"),
    ("patch-symlink-loop", lambda c: ["verify", str(c.good()), "--patch", str(c.loop("p.diff")),
                                      "--vllm", "0.10.1.1"], 2, "symlink loop"),
    # ---- bundles (gpu-verify --bundle, gpu-judge) ----------------------------------------
    ("bundle-missing", bundle_case(lambda c, b: None), 2, "no such folder"),
    ("bundle-a-file", bundle_case(lambda c, b: b.write_text("x")), 2, "is a regular file, not a folder"),
    ("bundle-no-manifest", bundle_case(lambda c, b: _bundle(c, b, manifest=None)), 2,
     "not a verification bundle"),
    ("bundle-manifest-a-folder", bundle_case(lambda c, b: (_bundle(c, b, manifest=None),
                                                           (b / "manifest.json").mkdir())), 2,
     "is a folder, not a bundle manifest"),
    ("bundle-verdict-not-json", bundle_case(lambda c, b: _bundle(c, b, verdict="{nope")), 2,
     "not valid JSON"),
    ("bundle-verdict-a-list", bundle_case(lambda c, b: _bundle(c, b, verdict="[1]")), 2,
     "holds a list, not a JSON object"),
    ("bundle-verdict-missing", bundle_case(lambda c, b: _bundle(c, b, verdict=None)), 2,
     "no such bundle verdict.json"),
    ("gpu-judge-bundle-loop", lambda c: ["gpu-judge", str(c.loop()), "--out", str(c.tmp / "o")], 2,
     "symlink loop"),
    ("gpu-verify-ssh-config-loop", lambda c: ["gpu-verify", "--remote", "h", "--bundle", str(c.tmp),
                                              "--ssh-config", str(c.loop()), "--reports",
                                              str(c.tmp / "r")], 2, "symlink loop"),
    ("cache-cannot-be-made", cache_case(lambda c: _readonly(c) / "cache"), 2,
     "cannot be made"),
    ("slice-base-a-file", lambda c: ["slice", "0.10.2", "--base", str(c.file("f", "x"))], 2,
     "is a regular file, not a folder (the --base folder)"),
    ("slice-version-long", lambda c: ["slice", "1" * 70], 2, "a release name of 70 characters"),
    ("catalog-only-typo", lambda c: ["catalog", "run", "--only", "vllm-2347-priority", "--reports",
                                     str(c.tmp / "r")], 2, "--only vllm-2347-priority: no such entry"),  # issue
    # ---- the catalog folder -------------------------------------------------------------
    ("catalog-directory-a-file", lambda c: ["catalog", "--directory", str(c.file("f", "x"))], 2,
     "is a regular file, not a folder (the catalog folder"),
    ("catalog-directory-loop", lambda c: ["catalog", "run", "--directory", str(c.loop()),
                                          "--reports", str(c.tmp / "r")], 2, "symlink loop"),
]


def _readonly(c: Case) -> Path:
    """A folder nobody may write (even root: a read-only bind of the file system is not at
    hand in a test, so /proc stands for it)."""
    return Path("/proc/self")


def _dangling(c: Case) -> Path:
    p = c.tmp / "dangling"
    p.symlink_to(c.tmp / "nowhere")
    return p


def invoke(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(args, signals=False)
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out, err


def test_the_table_has_at_least_60_rows():
    assert len(ROWS) >= 60 and len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("build, code, fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_hostile_input(tmp_path, monkeypatch, capsys, build, code, fragment):
    case = Case(tmp_path)
    args = build(case)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    got, out, err = invoke(args, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert got == code, err
    assert "Traceback" not in err + out
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert not (tmp_path / "r").exists(), "an input error must not leave a report folder"


def test_triage_scenario_force_overwrites(tmp_path, capsys):
    """--force is the way to overwrite; the refusal above left the file as it was."""
    log = tmp_path / "crash.log"
    log.write_text(LOG)
    old = tmp_path / "old.yaml"
    old.write_text("keep me")
    code, _, err = invoke(["triage", str(log), "--scenario", str(old)], capsys)
    assert code == 2 and old.read_text() == "keep me"
    code, _, err = invoke(["triage", str(log), "--scenario", str(old), "--force"], capsys)
    assert "already exists" not in err  # it got past the guard (the log holds no dump to draft)


def test_a_lab_failure_is_exit_3_with_its_traceback_in_a_file(tmp_path, monkeypatch, capsys):
    import vllm_repro.scenario.load as load

    def broken(paths):
        raise ZeroDivisionError("a bug of the lab")

    monkeypatch.setattr(load, "unique_scenarios", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    code, out, err = invoke(["run", str(Case(tmp_path).good()), "--reports", str(tmp_path / "r")],
                            capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 3 and len(lines) == 1 and "Traceback" not in err, err
    assert "lab failure (ZeroDivisionError: a bug of the lab)" in lines[0]
    saved = Path(lines[0].split("the traceback is in ")[1].split(";")[0])
    assert saved.parent == tmp_path
    text = saved.read_text()
    assert "Traceback (most recent call last)" in text and "ZeroDivisionError" in text


def test_the_real_entry_point_says_one_line_too(tmp_path):
    """The console script as a user runs it (a subprocess): the issue's first row."""
    loop = tmp_path / "s.yaml"
    loop.symlink_to(loop.name)
    proc = subprocess.run([sys.executable, "-m", "vllm_repro.cli", "run", str(loop)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "symlink loop" in proc.stderr


def test_a_billion_block_pool_is_refused_in_under_five_seconds(tmp_path):
    """Issue 18: `num_gpu_blocks: 1000000000` grew the worker by 100 MB/s; now it ends at once,
    as a user runs it (a subprocess), with exit 2 naming the setting, and nothing started."""
    import time

    s = tmp_path / "huge.yaml"
    s.write_text(GOOD.replace("{num_gpu_blocks: 8}", "{num_gpu_blocks: 1000000000}"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vllm_repro.cli", "run", str(s), "--reports",
                           str(tmp_path / "r")], capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    assert took < 5, f"{took:.1f} s"
    assert "VLLM_REPRO_MAX_KV_BLOCKS" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()
