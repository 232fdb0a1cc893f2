"""The platform seam (engine/adapter/platform.py) and the scenario's ``platform:`` field."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from vllm_repro.engine.adapter import platform as plat
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

BASE = """name: p
config: {block_size: 16, num_gpu_blocks: 8, max_num_seqs: 2, max_num_batched_tokens: 64, max_model_len: 256}
requests: [{id: A, at_step: 1, prompt_len: 10, max_tokens: 2}]
"""


def scenario(tmp_path, extra: str = ""):
    p = tmp_path / "p.yaml"
    p.write_text(BASE + extra)
    return load_scenario(p)


def test_the_default_platform_is_the_gpu_deployments(tmp_path):
    sc = scenario(tmp_path)
    assert sc.platform.name == "cuda" and sc.platform.capability == "9.0"
    assert json.loads(sc.platform.key())["name"] == "cuda"


def test_a_yaml_number_capability_reads_as_major_minor(tmp_path):
    assert scenario(tmp_path, "platform: {capability: 8.0}\n").platform.capability == "8.0"
    assert scenario(tmp_path, "platform: {capability: '10.0'}\n").platform.capability == "10.0"


@pytest.mark.parametrize("bad, field", [
    ("platform: {name: rocm}", "platform.name"),
    ("platform: {capability: nine}", "platform.capability"),
    ("platform: {total_memory_gib: 0}", "platform.total_memory_gib"),
    ("platform: {gpu: h100}", "platform.gpu"),
])
def test_a_bad_platform_names_the_field(tmp_path, bad, field):
    with pytest.raises(InputError) as err:
        scenario(tmp_path, bad + "\n")
    assert field in str(err.value)


def test_different_platforms_are_different_workers(tmp_path):
    a = scenario(tmp_path).platform.key()
    b = scenario(tmp_path, "platform: {name: cpu}\n").platform.key()
    c = scenario(tmp_path, "platform: {capability: '8.0'}\n").platform.key()
    assert len({a, b, c}) == 3


@pytest.mark.parametrize("name, stood_in", [
    ("_C", True), ("_moe_C", True), ("_C_stable_libtorch", True), ("_vllm_fa2_C", True),
    ("_flashmla_C", True), ("_custom_ops", False), ("config", False), ("_Cache", False),
])
def test_compiled_extensions_are_recognised_by_their_names(name, stood_in):
    assert bool(plat._EXTENSION.match(name)) is stood_in


def test_stand_ins_are_asked_last_and_only_for_vllm_extensions(monkeypatch):
    finder = plat.ExtensionStandIns()
    assert finder.find_spec("vllm._moe_C") is not None
    assert finder.find_spec("json") is None and finder.find_spec("vllm.config") is None
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    monkeypatch.delitem(sys.modules, "vllm_repro_nope._C", raising=False)
    with pytest.raises(ModuleNotFoundError):  # not vLLM's: never stood in
        importlib.import_module("vllm_repro_nope._C")


def test_before_vllm_platforms_the_extensions_names_are_gpu_only_callables(tmp_path, monkeypatch):
    """0.4.0 / 0.4.1 run ``from vllm._C import ops`` at import: for a tree without
    vllm/platforms the finder goes in before ``import vllm`` with names; a tree with it is left
    alone, and without names a stood-in extension stays an empty module."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv(plat.ENV_VAR, raising=False)
    (tmp_path / "new" / "platforms").mkdir(parents=True)
    (tmp_path / "old").mkdir()
    assert plat.before_import_without_platforms([str(tmp_path / "new")]) is False
    assert not any(isinstance(f, plat.ExtensionStandIns) for f in sys.meta_path)
    monkeypatch.setenv(plat.ENV_VAR, json.dumps({"name": "cpu"}))
    assert plat.before_import_without_platforms([str(tmp_path / "old")]) is False
    monkeypatch.delenv(plat.ENV_VAR)
    assert plat.before_import_without_platforms([str(tmp_path / "old")]) is True
    (finder,) = [f for f in sys.meta_path if isinstance(f, plat.ExtensionStandIns)]
    mod = importlib.util.module_from_spec(finder.find_spec("vllm._C"))
    with pytest.raises(RuntimeError, match="vllm._C.ops.silu_and_mul is a GPU kernel"):
        mod.ops.silu_and_mul(None, None)
    with pytest.raises(AttributeError):
        mod.__wrapped__  # noqa: B018 - dunder names are not GPU names
    plain = importlib.util.module_from_spec(plat.ExtensionStandIns().find_spec("vllm._C"))
    with pytest.raises(AttributeError):
        plain.ops  # noqa: B018 - without names: an empty module, as on releases with platforms


def test_an_empty_build_product_folder_becomes_a_package_of_gpu_only_names(tmp_path):
    (tmp_path / "vllm_flash_attn").mkdir()
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "__init__.py").write_text("")
    finder = plat.BuildProductStandIns()
    assert finder.find_spec("vllm.real", [str(tmp_path)]) is None
    spec = finder.find_spec("vllm.vllm_flash_attn", [str(tmp_path)])
    mod = importlib.util.module_from_spec(spec)
    fn = mod.flash_attn_varlen_func
    with pytest.raises(RuntimeError, match="GPU kernel"):
        fn()
    with pytest.raises(AttributeError):
        mod.__wrapped__  # noqa: B018 - dunder names are not GPU callables


def test_the_requested_platform_comes_from_the_workers_environment(monkeypatch):
    monkeypatch.delenv(plat.ENV_VAR, raising=False)
    assert plat.requested()["name"] == "cuda"
    monkeypatch.setenv(plat.ENV_VAR, json.dumps({"name": "cpu"}))
    assert plat.requested() == {"name": "cpu"}
    monkeypatch.setenv(plat.ENV_VAR, "[1]")
    with pytest.raises(plat.PlatformError):
        plat.requested()


EXT_SOURCE = """
#include <Python.h>
int cuInit(unsigned int flags);
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "%(name)s", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_%(name)s(void) {
    PyObject *m = PyModule_Create(&def);
    if (m) PyModule_AddIntConstant(m, "driver_answer", cuInit(0));
    return m;
}
"""


def _cc(*args: str) -> None:
    import subprocess

    proc = subprocess.run(["cc", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_real_extension_without_the_gpu_driver_is_a_stand_in_and_with_it_loads(tmp_path):
    """The CUDA image run without --gpus: full vLLM's compiled extensions need the driver's
    libcuda.so.1, absent there; they become the stand-ins an sdist's absent extensions are. A
    real extension (built here, linked against a stand-in driver library) loads when its driver
    is found, and a load error for any other reason stands."""
    import shutil
    import sysconfig

    if not shutil.which("cc") or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("needs a C compiler and Python's headers to build a real extension")
    drv, pkg, other = tmp_path / "drv", tmp_path / "pkg", tmp_path / "other"
    for d in (drv, pkg, other):
        d.mkdir()
    (tmp_path / "cuda.c").write_text("int cuInit(unsigned int flags) { return 42; }\n")
    _cc("-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(drv / "libcuda.so.1"), str(tmp_path / "cuda.c"))
    _cc("-shared", "-fPIC", "-Wl,-soname,libfoo.so.1", "-o", str(other / "libfoo.so.1"), str(tmp_path / "cuda.c"))
    inc = sysconfig.get_paths()["include"]
    for name, lib, rpath in (("_C", "cuda", None), ("_D_C", "cuda", drv), ("_moe_C", "foo", None)):
        (tmp_path / f"{name}.c").write_text(EXT_SOURCE % {"name": name})
        libdir = drv if lib == "cuda" else other
        _cc("-shared", "-fPIC", f"-I{inc}", "-o", str(pkg / f"{name}.so"), str(tmp_path / f"{name}.c"),
            "-Wl,--no-as-needed", f"-L{libdir}", f"-l:lib{lib}.so.1", *([f"-Wl,-rpath,{rpath}"] if rpath else []))
    finder = plat.BuildProductStandIns()

    spec = finder.find_spec("vllm._C", [str(pkg)])  # the driver is nowhere the loader looks
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.__file__.startswith("<vllm-repro stand-in") and "vllm._C (no GPU driver here)" in plat.STOOD_IN

    spec = finder.find_spec("vllm._D_C", [str(pkg)])  # this one finds its driver (rpath)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.driver_answer == 42 and mod.__file__ == str(pkg / "_D_C.so")

    spec = finder.find_spec("vllm._moe_C", [str(pkg)])  # missing something else: the error stands
    with pytest.raises(ImportError, match="libfoo.so.1"):
        importlib.util.module_from_spec(spec)
    assert finder.find_spec("vllm._nope_C", [str(pkg)]) is None  # absent: left to the last finder


def _eager_vllm(monkeypatch, tmp_path, current: str = "CpuPlatform"):
    """A stand-in for a release whose vllm/platforms/__init__.py binds ``current_platform`` at
    import (0.6.x), with its CUDA platform class and NVML absent (the lab's pynvml stand-in)."""
    import collections
    import types

    cuda = types.ModuleType("vllm.platforms.cuda")

    class CudaPlatform:
        @classmethod
        def get_device_capability(cls, device_id=0):
            raise RuntimeError("no GPU here")

        @classmethod
        def get_device_name(cls, device_id=0):
            raise RuntimeError("no GPU here")

    class CpuPlatform:
        pass

    cuda.CudaPlatform = CudaPlatform
    iface = types.ModuleType("vllm.platforms.interface")
    iface.DeviceCapability = collections.namedtuple("DeviceCapability", "major minor")
    platforms = types.ModuleType("vllm.platforms")
    platforms.__file__ = str(tmp_path / "vllm" / "platforms" / "__init__.py")
    platforms.current_platform = {"CpuPlatform": CpuPlatform, "CudaPlatform": CudaPlatform}[current]()
    pynvml = types.ModuleType("pynvml")
    pynvml.__file__ = "<vllm-repro stand-in for pynvml>"
    for name, mod in {"vllm": types.ModuleType("vllm"), "vllm.platforms": platforms,
                      "vllm.platforms.cuda": cuda, "vllm.platforms.interface": iface,
                      "pynvml": pynvml}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "vllm.utils", raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    answered = []
    monkeypatch.setattr(plat, "answer_kernel_queries", lambda d: answered.append(d) or [])
    monkeypatch.delenv(plat.ENV_VAR, raising=False)
    return platforms, pynvml, answered


def test_an_eagerly_bound_platform_gets_the_emulated_cuda_class_for_a_v0_run_or_for_good(
        monkeypatch, tmp_path):
    """0.6.x binds current_platform at import: a V0 run of 0.6.5-0.6.6.post1 swaps its class for
    the run (eager_cuda_swap), a V0-only release for good (install_eager: the same swap, kept).
    Either way the instance answers as the emulated GPU and NVML answers for one device."""
    platforms, pynvml, answered = _eager_vllm(monkeypatch, tmp_path)
    cpu = platforms.current_platform
    notes: list[str] = []
    instance, cls = plat.eager_cuda_swap(notes)
    assert instance is cpu and type(cpu).__name__ == "CpuPlatform", "a swap is the caller's to make"
    assert cls.__name__ == "EmulatedCudaPlatform" and cls.get_device_capability() == (9, 0)
    assert notes == ["vllm.platforms resolved CpuPlatform at import; the lab gives that instance "
                     "the class EmulatedCudaPlatform while a V0 run lasts"]
    assert pynvml.nvmlDeviceGetCount() == 1 and answered, "NVML and the kernel queries answered"

    notes = []
    label = plat.install_eager(notes)
    assert label == "cuda 9.0 (emulated CudaPlatform)"
    assert type(cpu).__name__ == "EmulatedCudaPlatform"  # for good: every module holds cpu
    assert cpu.get_device_name() == "NVIDIA H100 80GB HBM3"
    assert notes == ["vllm.platforms resolved CpuPlatform at import; the lab gives that instance "
                     "the class EmulatedCudaPlatform"]
    # once emulated, nothing more to swap and nothing more to say
    assert plat.eager_cuda_swap(notes) is None
    assert plat.install_eager(notes) == label and len(notes) == 1


def test_a_cuda_instance_is_emulated_for_good_but_left_alone_for_a_v0_run(monkeypatch, tmp_path):
    """An installed full vLLM (the CUDA image) resolved its own CudaPlatform: a V0 run of a
    release with a V1 engine keeps it (eager_cuda_swap: nothing to swap); install_eager still
    gives it the emulated class (the scenario's capability, not the machine's)."""
    platforms, _, _ = _eager_vllm(monkeypatch, tmp_path, current="CudaPlatform")
    monkeypatch.setenv(plat.ENV_VAR, json.dumps({"name": "cuda", "capability": "8.0"}))
    assert plat.eager_cuda_swap([]) is None
    assert plat.install_eager([]) == "cuda 8.0 (emulated CudaPlatform)"
    assert platforms.current_platform.get_device_capability() == (8, 0)
