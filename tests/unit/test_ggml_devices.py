"""Which ggml device a node computes on, and what `exo-node build-backend` checks and asks cmake for, read off the
pure parts of shards/engines/ggml/devices.py and build.py: nothing is built, loaded or started."""

import logging
from pathlib import Path

import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from node.settings import parse_args  # noqa: E402
from node.settings.model import engine_from_args  # noqa: E402
from shards.engines.ggml import build, devices  # noqa: E402
from shards.engines.ggml.devices import Built, Device, choose, describe, fastest  # noqa: E402
from shards.engines.registry import engine_factory  # noqa: E402

GiB = 2**30
CPU = Device("CPU", "AMD EPYC", "cpu", "CPU", 60 * GiB, 64 * GiB)
IGPU = Device("Vulkan0", "Intel Iris Xe", "igpu", "Vulkan", 8 * GiB, 16 * GiB)
GPU = Device("CUDA0", "NVIDIA RTX 4090", "gpu", "CUDA", 22 * GiB, 24 * GiB)
BLAS = Device("BLAS", "OpenBLAS", "accel", "BLAS", 0, 0)


def test_the_default_device_is_a_discrete_gpu_then_an_integrated_one_then_the_cpu():
    assert fastest((CPU, BLAS, IGPU, GPU)) == GPU
    assert fastest((CPU, IGPU)) == IGPU
    assert fastest((CPU, BLAS)) == CPU  # an accelerator only speeds up some CPU ops: never a node's device
    assert choose(None, (CPU, GPU)) == choose("auto", (CPU, GPU)) == choose("AUTO", (CPU, GPU)) == GPU


def test_a_device_is_chosen_by_its_name_or_its_backends_name_whatever_the_case():
    present = (CPU, IGPU, GPU)
    assert choose("vulkan0", present) == choose("Vulkan", present) == IGPU
    assert choose("cuda", present) == choose("CUDA0", present) == GPU
    assert choose("cpu", present) == CPU


def test_a_device_the_build_lacks_is_refused_naming_those_present_and_the_command_that_builds_it():
    with pytest.raises(ValueError, match=r"--device cuda1: .*no such device \(it has: CPU, Vulkan0\)") as e:
        choose("cuda1", (CPU, BLAS, IGPU))
    assert "exo-node build-backend cuda" in str(e.value) and "--list-devices" in str(e.value)
    with pytest.raises(ValueError, match="GGML_VK_VISIBLE_DEVICES=0"):  # how lavapipe, a CPU-type device, shows
        choose("vulkan", (CPU,))
    with pytest.raises(ValueError, match="no such device"):
        choose("BLAS", (CPU, BLAS))  # listed, but not a device to compute a node's layers on


def test_a_device_reports_sane_memory_and_kind():
    with pytest.raises(ValueError):
        Device("X", "", "tpu", "X", 0, 0)
    with pytest.raises(ValueError):
        Device("X", "", "gpu", "X", -1, 0)


def test_two_listings_of_a_device_are_the_same_device_whatever_memory_was_free_at_each():
    later = Device("Vulkan0", "Intel Iris Xe", "igpu", "Vulkan", 7 * GiB, 16 * GiB)  # lavapipe reports the host's
    assert later == IGPU and later in (CPU, IGPU) and hash(later) == hash(IGPU)
    assert Device("Vulkan1", "Intel Iris Xe", "igpu", "Vulkan", 8 * GiB, 16 * GiB) != IGPU


def test_list_devices_prints_each_device_with_its_memory_and_marks_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("EXO_NODE_BACKENDS", str(tmp_path))
    text = describe((CPU, GPU))
    lines = text.splitlines()
    assert "CUDA0" in lines[2] and "22.0 / 24.0 GiB" in lines[2] and lines[2].endswith("(default)")
    assert "60.0 / 64.0 GiB" in lines[1] and "(default)" not in lines[1]
    assert f"built backends in {tmp_path}: none" in text


def test_a_backend_built_for_another_ggml_python_is_never_loaded(tmp_path, caplog):
    folder = tmp_path / "vulkan"
    folder.mkdir()
    (folder / "libggml-vulkan.so").write_bytes(b"not loaded")  # loading this would fail loudly
    Built("vulkan", "0.0.1", folder / "libggml-vulkan.so").write()
    with caplog.at_level(logging.WARNING):
        assert devices.load_backends(tmp_path) == []
    assert "built for ggml-python 0.0.1" in caplog.text and "exo-node build-backend vulkan" in caplog.text


def test_a_build_folder_is_a_build_only_with_its_manifest_and_its_module(tmp_path):
    folder = tmp_path / "cuda"
    folder.mkdir()
    assert Built.read(folder) is None
    Built("cuda", "0.0.45", folder / "libggml-cuda.so").write()
    assert Built.read(folder) is None  # the module is missing
    (folder / "libggml-cuda.so").write_bytes(b"")
    assert Built.read(folder) == Built("cuda", "0.0.45", folder / "libggml-cuda.so")
    assert devices.built_backends(tmp_path) == [Built.read(folder)]
    (folder / "manifest.json").write_text("{not json")
    assert Built.read(folder) is None
    with pytest.raises(ValueError, match="unknown ggml backend"):
        Built("opencl", "0.0.45", folder / "x.so")


def test_build_backend_names_every_package_the_system_lacks_before_building(monkeypatch, capsys):
    monkeypatch.setattr(build.shutil, "which", lambda _: None)
    monkeypatch.setattr(build.glob, "glob", lambda _: [])
    monkeypatch.setattr(build, "vulkan_headers", lambda _: None)
    lacking = "\n".join(str(m) for m in build.missing("vulkan"))
    for package in ("cmake", "g++", "glslc", "spirv-headers", "libvulkan-dev", "--vulkan-headers"):
        assert package in lacking
    assert "nvidia-cuda-toolkit" in "\n".join(str(m) for m in build.missing("cuda"))
    assert build.main(["vulkan"]) == 2
    assert "the system lacks" in capsys.readouterr().err


def test_the_build_asks_ggml_pythons_cmake_project_for_the_backend_alone_as_a_loadable_module(tmp_path):
    args = build.configure_args("vulkan", tmp_path / "src", tmp_path / "b", "0.0.45", Path("/h/usr/include"))
    assert args[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "b")]
    for flag in ("-DGGML_BACKEND_DL=ON", "-DGGML_CPU=OFF", "-DGGML_VULKAN=ON", "-DSKBUILD_PROJECT_VERSION=0.0.45"):
        assert flag in args
    assert "-DVulkan_INCLUDE_DIR=/h/usr/include" in args
    assert "-DGGML_CUDA=ON" in build.configure_args("cuda", tmp_path, tmp_path, "0.0.45", None)
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in build.configure_args("cuda", tmp_path, tmp_path, "0.0.45", None, "90")


def test_a_cuda_toolkit_without_cublas_is_named_before_building(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setattr(build.shutil, "which", lambda c: str(tmp_path / "bin" / c) if c == "nvcc" else "/usr/bin/x")
    monkeypatch.setattr(build.glob, "glob", lambda _: [])
    assert [m.what for m in build.missing("cuda")] == ["cuBLAS (cublas_v2.h and libcublas, which ggml-cuda links)"]
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cublas_v2.h").write_text("")
    monkeypatch.setattr(build.glob, "glob", lambda p: [p] if "libcublas" in p and str(tmp_path / "lib64") in p else [])
    assert build.missing("cuda") == []


def test_cuda_builds_for_the_gpus_present_unless_told_and_for_ggmls_portable_list_without_one(monkeypatch):
    listed = build.subprocess.CompletedProcess([], 0, "GPU 0: NVIDIA H200 (UUID: GPU-1)\n", "")
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: listed)
    assert build.cuda_architectures(None) == "native"
    assert build.cuda_architectures("86;89") == "86;89"

    def no_driver(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(build.subprocess, "run", no_driver)
    assert build.cuda_architectures(None) is None


def test_the_node_computes_on_the_fastest_device_unless_told_and_only_the_ggml_engine_takes_one():
    assert engine_from_args(parse_args(["--engine", "ggml"])).options["device"] == "auto"
    assert engine_from_args(parse_args(["--engine", "ggml", "--device", "cpu"])).options["device"] == "cpu"
    assert "device" not in engine_from_args(parse_args(["--engine", "numpy"])).options
    options = engine_from_args(parse_args(["--engine", "numpy", "--device", "cpu"])).options
    with pytest.raises(ValueError, match="--device is an option of the ggml engine"):
        engine_factory("numpy", **options)
    with pytest.raises(ValueError, match="--device must name a device"):
        engine_from_args(parse_args(["--engine", "ggml", "--device", " "]))


def test_a_node_on_the_cpu_of_a_machine_with_an_unserved_gpu_says_once_how_to_build_its_backend(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("EXO_NODE_BACKENDS", str(tmp_path / "backends"))  # nothing built
    monkeypatch.setattr(devices.sys, "platform", "linux")
    monkeypatch.setattr(devices, "_hinted", set())
    assert devices.unused_gpu(tmp_path) is None  # no GPU: no hint
    (tmp_path / "proc/driver/nvidia/gpus").mkdir(parents=True)
    assert devices.unused_gpu(tmp_path) == ("an NVIDIA GPU", "cuda")
    with caplog.at_level(logging.WARNING, logger="shards.engines.ggml.devices"):
        assert devices.select("auto", tmp_path).is_cpu
        assert devices.select(None, tmp_path).is_cpu
        assert devices.select("cpu", tmp_path).is_cpu  # asked for: no hint
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "exo-node build-backend cuda" in said[0] and "--device cpu" in said[0]
    folder = tmp_path / "backends" / "cuda"
    folder.mkdir(parents=True)
    (folder / "libggml-cuda.so").write_bytes(b"")
    Built("cuda", "0.0.45", folder / "libggml-cuda.so").write()
    assert devices.unused_gpu(tmp_path) is None  # built (whether it loads is load_backends' to say)


def test_attention_other_than_auto_is_refused_on_a_device_naming_the_fix(monkeypatch):
    """A device attends by ggml's flash kernel throughout: `--attention gemm` there is refused before any weight
    loads (engine_factory checks options at start-up), and on the CPU it is taken."""
    from shards.engines.ggml.engine import GgmlEngine

    monkeypatch.setattr("shards.engines.ggml.engine.select", lambda asked: GPU if asked == "CUDA0" else CPU)
    with pytest.raises(ValueError, match="applies to the CPU; on CUDA0 .* --device cpu"):
        GgmlEngine.check_options("m", device="CUDA0", attention="gemm")
    GgmlEngine.check_options("m", device="CUDA0", attention="auto")
    GgmlEngine.check_options("m", device="cpu", attention="gemm")
