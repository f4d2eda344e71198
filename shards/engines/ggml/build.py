"""`exo-node build-backend {vulkan,cuda,metal,hip}`: build the ggml backend a GPU node loads.

The module is built from the installed ggml-python's own sdist (the same ggml source as the CPU library the engine
already runs), through ggml-python's CMake project (so its libraries keep the binding's layout: no SONAME, RUNPATH
$ORIGIN), with GGML_BACKEND_DL (a loadable module: shards/engines/ggml/devices.py registers it at run time) and the
backend's own flag. Only the backend's target is compiled. What the system lacks is checked first, before any
download or compile, and named with the packages that provide it.

Everything stays in `backends_dir()/NAME` (the sdist, the build tree, the module and its manifest), outside the
checkout: a second clone on the machine loads the same build, and a rebuild of an unchanged tree recompiles nothing.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from shards.engines.ggml.devices import BACKENDS, Built, backends_dir, binding_version, module_name

CMAKE_FLAG = {"vulkan": "GGML_VULKAN", "cuda": "GGML_CUDA", "metal": "GGML_METAL", "hip": "GGML_HIP"}
# what ggml-vulkan's source needs of the Vulkan headers (vk::LayerSettingEXT: newer than Debian 12's 1.3.239)
VULKAN_SYMBOL = "VkLayerSettingEXT"
DEBIAN_HEADERS_SUITE = "trixie"  # Debian 13: the first whose libvulkan-dev (1.4.309) has it


@dataclass(frozen=True)
class Missing:
    """Something the build needs that the system lacks, and how to get it."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"- {self.what}: {self.fix}"


def _have(*commands: str) -> bool:
    return any(shutil.which(c) for c in commands)


def vulkan_include_dirs(given: Path | None) -> list[Path]:
    """Where the Vulkan headers may be: --vulkan-headers, $VULKAN_SDK/include, then the system's."""
    dirs = [given] if given else []
    dirs.append(backends_dir() / "vulkan" / "headers" / "usr" / "include")  # --debian-headers puts them there
    if os.environ.get("VULKAN_SDK"):
        dirs.append(Path(os.environ["VULKAN_SDK"]) / "include")
    return dirs + [Path("/usr/include"), Path("/usr/local/include")]


def vulkan_headers(given: Path | None) -> Path | None:
    """The first include folder whose vulkan_core.h declares what ggml-vulkan uses."""
    for d in vulkan_include_dirs(given):
        core = d / "vulkan" / "vulkan_core.h"
        if core.is_file() and VULKAN_SYMBOL in core.read_text(errors="replace") and (d / "vulkan/vulkan.hpp").is_file():
            return d
    return None


def _spirv_headers() -> bool:
    prefixes = [os.environ.get("VULKAN_SDK", ""), "/usr", "/usr/local"]
    return any(
        glob.glob(f"{p}/share/cmake/SPIRV-Headers*") + glob.glob(f"{p}/lib*/cmake/SPIRV-Headers*")
        for p in prefixes
        if p
    )


def _vulkan_loader() -> bool:
    patterns = ["/usr/lib/*/libvulkan.so*", "/usr/lib/libvulkan.so*", "/usr/local/lib/libvulkan.so*"]
    if os.environ.get("VULKAN_SDK"):
        patterns.append(f"{os.environ['VULKAN_SDK']}/lib/libvulkan.so*")
    return any(glob.glob(p) for p in patterns)


def missing(backend: str, vulkan_include: Path | None = None) -> list[Missing]:
    """What the system lacks to build `backend` (empty: ready). Package names are Debian's and Ubuntu's."""
    out = []
    if not _have("cmake"):
        out.append(Missing("cmake", "apt-get install cmake (or pip install cmake)"))
    if not _have("c++", "g++", "clang++"):
        out.append(Missing("a C++ compiler", "apt-get install g++"))
    if backend == "vulkan":
        if not _have("glslc"):
            out.append(Missing("glslc (the GLSL to SPIR-V compiler)", "apt-get install glslc"))
        if not _spirv_headers():
            out.append(Missing("SPIR-V headers (SPIRV-HeadersConfig.cmake)", "apt-get install spirv-headers"))
        if not _vulkan_loader():
            out.append(Missing("the Vulkan loader library (libvulkan.so)", "apt-get install libvulkan-dev"))
        if vulkan_headers(vulkan_include) is None:
            out.append(
                Missing(
                    f"Vulkan headers that declare {VULKAN_SYMBOL} (1.3.261 or newer; Debian 12 has 1.3.239)",
                    "apt-get install libvulkan-dev on a newer distribution, or unpack a newer libvulkan-dev's "
                    "headers and pass their include folder as --vulkan-headers (on Debian 12: --debian-headers)",
                )
            )
    elif backend == "cuda":
        if not _have("nvcc"):
            out.append(
                Missing("nvcc (the CUDA toolkit)", "apt-get install nvidia-cuda-toolkit, or NVIDIA's CUDA toolkit")
            )
        elif not cuda_has_cublas():
            out.append(
                Missing(
                    "cuBLAS (cublas_v2.h and libcublas, which ggml-cuda links)",
                    "apt-get install nvidia-cuda-toolkit (or libcublas-dev-13-0 from NVIDIA's repository)",
                )
            )
    elif backend == "hip":
        if not _have("hipcc", "hipconfig"):
            out.append(
                Missing("hipcc (ROCm's HIP SDK)", "install ROCm (apt-get install rocm-hip-sdk from AMD's repository)")
            )
    elif backend == "metal":
        if platform.system() != "Darwin":
            out.append(Missing("macOS", "Metal builds only on macOS"))
        elif not _have("xcrun"):
            out.append(Missing("Xcode's command line tools", "xcode-select --install"))
    return out


def cuda_has_cublas() -> bool:
    """Whether the toolkit that holds nvcc also holds cuBLAS (some trimmed CUDA installs ship the compiler alone)."""
    root = Path(os.path.realpath(shutil.which("nvcc") or "/")).parent.parent
    headers = [root / "include", *root.glob("targets/*/include"), Path("/usr/include")]
    libs = [root / "lib64", root / "lib", *root.glob("targets/*/lib"), *map(Path, glob.glob("/usr/lib/*-linux-gnu"))]
    return any((d / "cublas_v2.h").is_file() for d in headers) and any(glob.glob(f"{d}/libcublas.so*") for d in libs)


def cuda_architectures(given: str | None) -> str | None:
    """What CMAKE_CUDA_ARCHITECTURES to build: --cuda-architectures, else `native` (the GPUs present, one
    architecture each: minutes of compiling, not the tens that ggml's portable list of seven takes) when nvidia-smi
    lists a GPU, else None (ggml's portable list, for building on a machine without the GPU)."""
    if given:
        return given
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "native" if listed.returncode == 0 and "GPU" in listed.stdout else None


def debian_vulkan_headers(into: Path, suite: str = DEBIAN_HEADERS_SUITE) -> Path:
    """Newer Vulkan headers on an older Debian: `suite`'s libvulkan-dev downloaded with apt from the mirror this
    system already uses (a throwaway source list and package lists; nothing is installed) and unpacked under
    `into`. Its include folder (what --vulkan-headers takes)."""
    include = into / "usr" / "include"
    if vulkan_headers(include) == include:
        return include
    uri = next(
        (
            line.split(":", 1)[1].split()[0]
            for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
            for line in f.read_text().splitlines()
            if line.startswith("URIs:") and "security" not in line
        ),
        None,
    )
    if uri is None or not _have("apt-get", "dpkg-deb"):
        raise RuntimeError("no Debian apt sources found: install newer Vulkan headers and pass --vulkan-headers")
    work = into / "apt"
    for d in ("lists/partial", "cache/archives/partial", "parts"):
        (work / d).mkdir(parents=True, exist_ok=True)
    (work / "sources.list").write_text(
        f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {uri} {suite} main\n"
    )
    apt = [
        "apt-get",
        "-q",
        f"-oDir::Etc::SourceList={work / 'sources.list'}",
        f"-oDir::Etc::SourceParts={work / 'parts'}",
        f"-oDir::State::Lists={work / 'lists'}",
        f"-oDir::Cache={work / 'cache'}",
    ]
    subprocess.run([*apt, "update"], check=True)
    subprocess.run([*apt, "download", "libvulkan-dev"], check=True, cwd=work)
    debs = sorted(work.glob("libvulkan-dev_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download left no libvulkan-dev package in {work}")
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(into)], check=True)
    if vulkan_headers(include) != include:
        raise RuntimeError(f"{debs[-1].name}'s headers do not declare {VULKAN_SYMBOL}")
    return include


def fetch_source(version: str, into: Path) -> Path:
    """ggml-python's sdist of `version`, unpacked under `into` (downloaded once): its source folder."""
    src = into / f"ggml_python-{version}"
    if (src / "CMakeLists.txt").is_file():
        return src
    into.mkdir(parents=True, exist_ok=True)
    args = ["download", "--no-binary", ":all:", "--no-deps", f"ggml-python=={version}", "-d", str(into)]
    tried = []
    for pip in ([sys.executable, "-m", "pip"], ["pip3"], ["pip"], ["uvx", "pip"]):
        if pip[0] != sys.executable and not shutil.which(pip[0]):
            continue
        tried.append(" ".join(pip))
        if subprocess.run([*pip, *args], check=False).returncode == 0:
            break
    archives = sorted(into.glob(f"ggml_python-{version}.tar.gz"))
    if not archives:
        raise RuntimeError(
            f"could not download ggml-python {version}'s source (tried: {', '.join(tried) or 'no pip found'}); "
            "install pip, or pass --source with an unpacked sdist"
        )
    with tarfile.open(archives[0]) as tar:
        tar.extractall(into, filter="data")
    return src


def configure_args(
    backend: str, src: Path, build: Path, version: str, vulkan_include: Path | None, cuda_archs: str | None = None
) -> list[str]:
    """cmake's configure step: ggml-python's project, the backend as a loadable module, nothing else of ggml's."""
    args = [
        "cmake",
        "-S",
        str(src),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DSKBUILD_PROJECT_NAME=ggml_python",
        f"-DSKBUILD_PROJECT_VERSION={version}",
        f"-DSKBUILD_PLATLIB_DIR={build / 'platlib'}",
        "-DGGML_BACKEND_DL=ON",
        "-DGGML_CPU=OFF",
        "-DGGML_NATIVE=OFF",
        f"-D{CMAKE_FLAG[backend]}=ON",
    ]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if backend == "vulkan" and vulkan_include is not None:
        args.append(f"-DVulkan_INCLUDE_DIR={vulkan_include}")
    if backend == "cuda" and cuda_archs:
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={cuda_archs}")
    return args


def build(
    backend: str, source: Path | None, vulkan_include: Path | None, jobs: int, cuda_archs: str | None = None
) -> Built:
    version = binding_version()
    home = backends_dir() / backend
    src = source or fetch_source(version, home / "source")
    tree = home / "build"
    started = time.monotonic()
    if not (tree / "CMakeCache.txt").is_file():
        subprocess.run(configure_args(backend, src, tree, version, vulkan_include, cuda_archs), check=True)
    subprocess.run(["cmake", "--build", str(tree), "--target", f"ggml-{backend}", "-j", str(jobs)], check=True)
    name = module_name(backend)
    found = sorted(p for p in tree.rglob(f"{name}*") if p.is_file() and not p.is_symlink())
    if not found:
        raise RuntimeError(f"the build finished but left no {name} under {tree}")
    tmp = home / f".{name}.{os.getpid()}"
    shutil.copy2(found[0], tmp)
    os.replace(tmp, home / name)  # a node loading the old module keeps its mapping
    built = Built(backend, version, home / name)
    built.write()
    print(f"built {built.library} for ggml-python {version} in {time.monotonic() - started:.0f} s")
    return built


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="exo-node build-backend",
        description="Build a ggml GPU backend for the ggml engine, from the installed ggml-python's source. "
        f"It is kept in {backends_dir()} (or $EXO_NODE_BACKENDS) and loaded by every node started after.",
    )
    ap.add_argument("backend", choices=BACKENDS)
    ap.add_argument(
        "--source", type=Path, help="an unpacked ggml-python sdist of the installed version (default: download it)"
    )
    ap.add_argument("--vulkan-headers", type=Path, help="an include folder with Vulkan headers newer than the system's")
    ap.add_argument(
        "--debian-headers",
        action="store_true",
        help=f"vulkan on an older Debian: fetch {DEBIAN_HEADERS_SUITE}'s libvulkan-dev with apt and build with its headers "
        "(unpacked beside the build; nothing is installed)",
    )
    ap.add_argument(
        "--cuda-architectures",
        help="cuda: CMAKE_CUDA_ARCHITECTURES, e.g. 86 for an RTX 3090, 89 for a 4090, 90 for an H100 (default: the "
        "GPUs present, else ggml's portable list)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (default: all cores)")
    ap.add_argument("--check", action="store_true", help="only check what the system lacks")
    args = ap.parse_args(argv)
    if args.debian_headers and args.backend == "vulkan" and vulkan_headers(args.vulkan_headers) is None:
        try:
            args.vulkan_headers = debian_vulkan_headers(backends_dir() / "vulkan" / "headers")
        except (subprocess.CalledProcessError, RuntimeError, OSError) as e:
            print(f"exo-node build-backend vulkan: could not fetch Vulkan headers: {e}", file=sys.stderr)
            return 2
    lacking = missing(args.backend, args.vulkan_headers)
    if lacking:
        print(f"exo-node build-backend {args.backend}: the system lacks:", file=sys.stderr)
        print("\n".join(str(m) for m in lacking), file=sys.stderr)
        return 2
    if args.check:
        print(f"ready to build the {args.backend} backend")
        return 0
    include = vulkan_headers(args.vulkan_headers) if args.backend == "vulkan" else None
    try:
        archs = cuda_architectures(args.cuda_architectures) if args.backend == "cuda" else None
        built = build(args.backend, args.source, include, max(1, args.jobs), archs)
    except (subprocess.CalledProcessError, RuntimeError, OSError) as e:
        print(f"exo-node build-backend {args.backend}: {e}", file=sys.stderr)
        return 1
    probe = "from shards.engines.ggml.devices import describe, devices, load_backends; load_backends(); print(describe(devices()))"
    subprocess.run([sys.executable, "-c", probe], check=False)
    print(f"start a node on it with --device {args.backend} (exo-node --list-devices lists the devices)")
    return 0 if built.library.is_file() else 1
