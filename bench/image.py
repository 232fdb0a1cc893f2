"""The CPU images in numbers (prints them; not a test): the size of the flagship image and of the
catalog image against their goals, each one's layers, build time cold and warm, `make cpu-repro`
wall time in the flagship image (and natively, for comparison) cold and warm.

    python bench/image.py                 # both images: warm build (nothing changed), sizes,
                                          # layers; cpu-repro runs in the flagship image
    python bench/image.py --only flagship # one of them (flagship | catalog)
    python bench/image.py --cold          # also a build without the layer cache, and a native
                                          # run on an empty cache (both take minutes)

The flagship image (`make image-flagship`, tag ``FLAGSHIP_IMAGE``, default
vllm-repro-cpu:flagship): only the releases of the default scenario (#23347: 0.10.1.1 and 0.10.2,
both as their slices); goal <= 1.5 GB (issue 20). The catalog image (`make images`, tag
``CPU_IMAGE``, default vllm-repro-cpu:latest): every release the catalog names; goal <= 3 GB.

Needs a Docker engine (on this workplace's machines: eval "$(../shared/tools/docker-host.sh)"
first, which also gives BASE_IMAGE, EXTRA_CA_CERT and TORCH_WHEEL_DIR). The size includes the
base image's (printed too: the local Debian base made here is larger than python:3.11-slim;
`eval "$(scripts/slim-base.sh)"` makes a slim stand-in of 125 MB and points BASE_IMAGE at it).

    python bench/image.py --cuda      # the CUDA image instead (make image-cuda on BASE_IMAGE, a
                                      # Python base: full vLLM of VLLM_VERSION from the index,
                                      # ~9 GB): size, layers, build time, the cut-off and the
                                      # versions it gave; with --cold a --no-cache build (15+ min)

"cold" build: `docker build --no-cache` (the base image present: it cannot be pulled here);
"warm" build: the same build again, every layer cached. "cold" cpu-repro in the image: the first
run after that cold build (every run is a fresh container); "warm": the median of the next runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sh(cmd: list[str], env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return dt, proc


#: (name, Make target, the tag's variable and default, goal in GB)
IMAGES = (("flagship", "image-flagship", "FLAGSHIP_IMAGE", "vllm-repro-cpu:flagship", 1.5),
          ("catalog", "image-cpu", "CPU_IMAGE", "vllm-repro-cpu:latest", 3.0))


def build(target: str, var: str, image: str, no_cache: bool) -> float:
    extra = ["DOCKER_BUILD_FLAGS=--no-cache"] if no_cache else []
    dt, _ = sh(["make", "--no-print-directory", target, f"{var}={image}", *extra])
    return dt


def image_size(image: str) -> int:
    return int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", image],
                              capture_output=True, text=True, check=True).stdout)


def cpu_repro(runner: str, image: str, env: dict | None = None) -> float:
    dt, _ = sh(["make", "--no-print-directory", "cpu-repro", f"RUNNER={runner}",
                *([f"CPU_IMAGE={image}"] if image else []),
                f"REPORTS={tempfile.mkdtemp(prefix='bench-image-')}"], env=env)
    return dt


def layers(image: str) -> list[tuple[int, str]]:
    out = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{json .}}", image],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        d = json.loads(line)
        size = d["Size"]
        mult = {"GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1}
        num = next((float(size[: -len(u)]) * m for u, m in mult.items() if size.endswith(u)), 0.0)
        if num >= 1e6:
            rows.append((int(num), d["CreatedBy"].replace("/bin/bash -o pipefail -c ", "")))
    return rows[::-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cold", action="store_true", help="also build without the cache and run natively on an "
                    "empty cache")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=[name for name, *_ in IMAGES],
                    help="one image (default: both)")
    ap.add_argument("--cuda", action="store_true", help="the CUDA image on BASE_IMAGE instead (see above)")
    args = ap.parse_args()
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        sys.exit("no Docker engine answers (here: eval \"$(../shared/tools/docker-host.sh)\")")
    if args.cuda:
        return cuda(args.cold)
    base = os.environ.get("BASE_IMAGE") or "python:3.11-slim-bookworm"
    try:
        base_bytes = image_size(base)
    except subprocess.CalledProcessError:
        base_bytes = None  # (not pulled here: counted as 0 below)
    sizes, lines = [], []
    for name, target, var, default, goal in IMAGES:
        if args.only and name != args.only:
            continue
        image = os.environ.get(var, default)
        if args.cold:
            lines.append(f"{name}: build cold (--no-cache, base present): "
                         f"{build(target, var, image, True):.0f} s")
        else:
            build(target, var, image, False)  # make sure it is there and current
        lines.append(f"{name}: build warm (nothing changed): {build(target, var, image, False):.1f} s")
        size = image_size(image)
        met = "met" if size <= goal * 1e9 else "NOT met"
        rows = layers(image)
        # a torch wheel copied in from images/stage/wheels is a layer of its own (COPY), which a
        # build from an index does not have (make images serves TORCH_WHEEL_DIR's instead: 0)
        staged = sum(n for n, what in rows if "COPY" in what and "/tmp/wheels" in what)
        sizes.append(f"{name} image {image}: {size / 1e9:.2f} GB (goal <= {goal} GB: {met}); "
                     f"less the base and the staged torch wheel ({staged / 1e9:.2f} GB): "
                     f"{(size - (base_bytes or 0) - staged) / 1e9:.2f} GB")
        lines.append(f"{name}: layers of 1 MB or more:")
        lines += [f"    {n / 1e6:7.0f} MB  {what[:90]}" for n, what in rows]
        if name != "flagship":
            continue
        if args.cold:
            lines.append(f"make cpu-repro in the flagship image, cold (first run after that build): "
                         f"{cpu_repro('docker', image):.1f} s")
        warm = [cpu_repro("docker", image) for _ in range(args.repeat)]
        lines.append(f"make cpu-repro in the flagship image, warm: median {statistics.median(warm):.1f} s "
                     f"(min {min(warm):.1f}, max {max(warm):.1f}, {args.repeat} runs)")
    shown = f"{base_bytes / 1e9:.2f} GB" if base_bytes is not None else "not here"
    sizes.append(f"(base image {base}: {shown}, included in each)")
    if args.cold:
        env = dict(os.environ, VLLM_REPRO_CACHE=tempfile.mkdtemp(prefix="bench-cold-cache-"))
        lines.append(f"make cpu-repro natively, cold (empty cache): {cpu_repro('native', '', env):.1f} s")
    nat = [cpu_repro("native", "") for _ in range(args.repeat)]
    lines.append(f"make cpu-repro natively, warm: median {statistics.median(nat):.1f} s "
                 f"(min {min(nat):.1f}, max {max(nat):.1f})")
    print("\n".join(sizes + lines))


#: shown with their upload dates: the ones today's index would give far newer versions of
CUDA_SHOWN = ("vllm", "torch", "transformers", "tokenizers", "protobuf", "xformers", "fastapi", "numpy")


def uploads(name: str, version: str) -> tuple[str | None, str]:
    """(first upload time of ``name==version`` on the index, ISO; the newest final release there)."""
    from packaging.utils import parse_sdist_filename, parse_wheel_filename

    sys.path.insert(0, str(ROOT / "src"))
    from vllm_repro.sources.index import project_files

    first, seen = None, set()
    for f in project_files(name):
        fn = f["filename"]
        try:
            v = parse_wheel_filename(fn)[1] if fn.endswith(".whl") else parse_sdist_filename(fn)[1]
        except ValueError:
            continue
        seen.add(v)
        t = f.get("upload-time")
        if str(v) == version and t and (first is None or t < first):
            first = t
    final = [v for v in seen if not v.is_prerelease]
    return first, str(max(final)) if final else "?"


def cuda(cold: bool) -> None:
    """The CUDA image built on ``BASE_IMAGE`` (a Python base; ``make image-cuda``): build time,
    size and layers, the ``--exclude-newer`` cut-off, and what it gave for :data:`CUDA_SHOWN`."""
    version = os.environ.get("VLLM_VERSION", "0.10.1.1")
    base = os.environ.get("BASE_IMAGE")
    if not base:
        sys.exit("--cuda needs BASE_IMAGE=<a Python base image> (here: eval \"$(../shared/tools/docker-host.sh)\")")
    image = os.environ.get("CUDA_IMAGE", f"vllm-repro-cuda:{version}")
    make = ["make", "--no-print-directory", "image-cuda", f"VLLM_VERSION={version}", f"BASE_IMAGE={base}",
            f"CUDA_IMAGE={image}"]
    lines = [f"CUDA image {image}: vLLM {version} installed on {base}"]
    if cold:
        lines.append(f"build cold (--no-cache, base present): {sh([*make, 'DOCKER_BUILD_FLAGS=--no-cache'])[0]:.0f} s")
    else:
        sh(make)
    lines.append(f"build warm (nothing changed): {sh(make)[0]:.1f} s")
    size = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", image],
                              capture_output=True, text=True, check=True).stdout)
    lines.append(f"size {size / 1e9:.2f} GB; layers of 1 MB or more:")
    out = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{json .}}", image],
                         capture_output=True, text=True, check=True).stdout
    for d in map(json.loads, out.splitlines()[::-1]):  # oldest first, as layers() lists them
        num = next((float(d["Size"][:-len(u)]) * m for u, m in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
                    if d["Size"].endswith(u)), 0.0)
        # the step without its build arguments (|N A=1 B=2 ...) and shell
        step = re.sub(r"^[|][0-9]+ (?:[A-Z_]+=[^ ]* )*(?:/bin/bash -o pipefail -c )?(?:set -eux; *)?", "",
                      d["CreatedBy"]).strip()
        if num >= 1e6:
            lines.append(f"    {num / 1e6:7.0f} MB  {' '.join(step.split())[:100] or '(the base)'}")

    def inside(*cmd: str) -> str:
        return subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", cmd[0], image,
                               *cmd[1:]], capture_output=True, text=True, check=True).stdout

    cutoff = inside("cat", "/opt/vllm/EXCLUDE_NEWER").strip()
    versions = dict(x.split("==", 1) for x in inside("python3", "-m", "pip", "list", "--format=freeze").split()
                    if "==" in x)
    lines.append(f"dependencies as of {cutoff} ({len(versions)} distributions): installed, first "
                 "uploaded, the newest release on the index today:")
    for name in CUDA_SHOWN:
        have = versions.get(name, "-")
        first, newest = uploads(name, have)
        lines.append(f"    {name:13} {have:14} {first[:10] if first else '?':10}  today: {newest}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
