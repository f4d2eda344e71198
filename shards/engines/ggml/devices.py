"""ggml's devices (the CPU, and Vulkan, CUDA, Metal, HIP devices where a backend for them is built), and the one an
engine computes on.

ggml-python's own build is CPU only. A GPU backend is built apart (`exo-node build-backend NAME`,
shards/engines/ggml/build.py) as a loadable ggml module, `libggml-NAME.so` in `backends_dir()/NAME`, from the same
ggml source as the installed binding, and registered into the binding's device registry at run time
(ggml_backend_load). The module links the binding's own libggml-base: its RUNPATH is $ORIGIN, where a link to the
binding's library is kept (`_link_base`), so the process holds one ggml with one set of globals whatever modules it
loads. A module built for another ggml-python version is never loaded: ggml's structs may differ between versions,
and a mismatch would corrupt memory, not raise.

The node's default device is the fastest present: a discrete GPU, else an integrated one, else the CPU (ggml lists a
backend's devices in its own order; the first of the best kind is taken). An engine made without a device stays on
the CPU, whatever is built. Choosing the default loads the built backends only where one of their devices would be
chosen, which a child process finds out first (device_probe.py): a backend's drivers stay resident once loaded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from shards.engines.ggml.device_probe import probe
from shards.engines.ggml.lib import g

log = logging.getLogger(__name__)
BACKENDS = ("vulkan", "cuda", "metal", "hip")  # what `exo-node build-backend` builds
MANIFEST = "manifest.json"  # beside a built module: {"backend", "ggml_python", "library"}
KINDS = {
    g.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu",
    g.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
    g.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu",
    g.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
}
SPEED_ORDER = ("gpu", "igpu", "cpu")  # kinds a node may compute on, fastest first (an accel device: BLAS, AMX,
# only speeds up some CPU ops and is never a node's device)
_loaded: dict[str, str] = {}  # module path -> backend name, registered in this process


def backends_dir() -> Path:
    """Where built backends live: $EXO_NODE_BACKENDS, else ~/.cache/exo-node/backends (outside any checkout, so one
    build serves every clone on the machine)."""
    env = os.environ.get("EXO_NODE_BACKENDS")
    return Path(env) if env else Path.home() / ".cache" / "exo-node" / "backends"


def binding_version() -> str:
    return metadata.version("ggml-python")


def binding_lib_dir() -> Path:
    """The installed binding's own ggml libraries (libggml-base is the one every module must share)."""
    return Path(g.__file__).resolve().parent / "lib"


def module_name(backend: str) -> str:
    return f"ggml-{backend}.dll" if sys.platform == "win32" else f"libggml-{backend}.so"


@dataclass(frozen=True)
class Built:
    """A backend module built by `exo-node build-backend`: which backend, for which binding version, where."""

    backend: str
    ggml_python: str
    library: Path

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown ggml backend {self.backend!r}: one of {', '.join(BACKENDS)}")

    @classmethod
    def read(cls, folder: Path) -> Built | None:
        """The build in `folder`, or None when there is none (no manifest, or no module beside it)."""
        try:
            spec = json.loads((folder / MANIFEST).read_text())
            built = cls(spec["backend"], spec["ggml_python"], folder / spec["library"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return built if built.library.is_file() else None

    def write(self) -> None:
        spec = {"backend": self.backend, "ggml_python": self.ggml_python, "library": self.library.name}
        (self.library.parent / MANIFEST).write_text(json.dumps(spec, indent=1) + "\n")


def built_backends(root: Path | None = None) -> list[Built]:
    root = backends_dir() if root is None else root
    return [b for name in BACKENDS if (b := Built.read(root / name)) is not None]


def _link_base(folder: Path) -> None:
    """`folder/libggml-base.so` -> the binding's own, replaced atomically when it points elsewhere (another venv)."""
    if sys.platform == "win32":
        return
    link, target = folder / "libggml-base.so", binding_lib_dir() / "libggml-base.so"
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    tmp = folder / f".libggml-base.so.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def load_backends(root: Path | None = None) -> list[str]:
    """Register every backend built for this binding's version into ggml (once per process); the names of those
    registered now or before. A build for another version is skipped with a warning that says how to rebuild."""
    version, names = binding_version(), []
    for built in built_backends(root):
        path = str(built.library)
        if path in _loaded:
            names.append(_loaded[path])
            continue
        if built.ggml_python != version:
            log.warning(
                "ggml: the %s backend in %s was built for ggml-python %s, this is %s: not loaded "
                "(rebuild it: exo-node build-backend %s)",
                built.backend,
                built.library.parent,
                built.ggml_python,
                version,
                built.backend,
            )
            continue
        _link_base(built.library.parent)
        if not g.ggml_backend_load(path.encode()):
            log.warning("ggml: could not load the %s backend from %s (see ggml's message above)", built.backend, path)
            continue
        _loaded[path] = built.backend
        names.append(built.backend)
    return names


@dataclass(frozen=True)
class Device:
    """One ggml device as ggml reports it: `name` is what --device takes (CPU, Vulkan0, CUDA0, ...). Two listings
    of one device are equal whatever memory was free at each (a reading, not part of which device it is)."""

    name: str
    description: str
    kind: str  # cpu, gpu, igpu, accel
    backend: str  # the backend registry's name: CPU, Vulkan, CUDA, Metal, ...
    memory_free: int = dataclasses.field(compare=False)
    memory_total: int

    def __post_init__(self):
        if self.kind not in KINDS.values() or not self.name or self.memory_free < 0 or self.memory_total < 0:
            raise ValueError(f"bad ggml device {self}")

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


def _handle(name: str) -> int:
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        if g.ggml_backend_dev_name(dev).decode() == name:
            return dev
    raise LookupError(f"ggml has no device {name!r}")


def devices() -> tuple[Device, ...]:
    """Every device registered in ggml now (load_backends first for the built ones), in ggml's order."""
    out = []
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(
            Device(
                g.ggml_backend_dev_name(dev).decode(errors="replace"),
                (g.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                KINDS.get(int(g.ggml_backend_dev_type(dev)), "accel"),
                g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(dev)).decode(errors="replace"),
                int(free.value),
                int(total.value),
            )
        )
    return tuple(out)


def fastest(present: tuple[Device, ...]) -> Device:
    """The first device of the fastest kind present (the CPU is always there)."""
    for kind in SPEED_ORDER:
        for d in present:
            if d.kind == kind:
                return d
    raise LookupError("ggml lists no CPU device: the binding is broken (reinstall ggml-python)")


def choose(asked: str | None, present: tuple[Device, ...]) -> Device:
    """The device `asked` names (case-insensitive; a backend's name alone, `vulkan`, means its first device), the
    fastest when it is None or "auto"; else a ValueError that says what is present and how to get more."""
    if asked is None or asked.lower() == "auto":
        return fastest(present)
    usable = [d for d in present if d.kind in SPEED_ORDER]
    key = asked.lower()
    for d in usable:
        if d.name.lower() == key:
            return d
    for d in usable:
        if d.backend.lower() == key:
            return d
    wanted = next((b for b in BACKENDS if key.startswith(b) or key.startswith(b[:3])), None)
    hint = f" Build its backend with `exo-node build-backend {wanted}`." if wanted else ""
    if wanted == "vulkan":
        hint += " A CPU-type Vulkan device (lavapipe) is listed only with GGML_VK_VISIBLE_DEVICES=0."
    raise ValueError(
        f"--device {asked}: this node's ggml has no such device (it has: {', '.join(d.name for d in usable)})."
        f"{hint} `exo-node --list-devices` lists them."
    )


# Signs of a GPU that the OS already drives, and the backend that would compute on it: what a node on the CPU
# looks for when nothing better was built (the hint is all it does: the node still starts, on the CPU).
GPU_SIGNS = (
    ("proc/driver/nvidia/gpus", "an NVIDIA GPU", "cuda"),
    ("dev/kfd", "an AMD GPU with ROCm's driver", "hip"),
    ("dev/dri/renderD128", "a GPU with a render node", "vulkan"),
)
_hinted: set[str] = set()


def unused_gpu(root: Path = Path("/")) -> tuple[str, str] | None:
    """(what, backend) for a GPU this machine has that no built backend serves, else None."""
    built = {b.backend for b in built_backends()}
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return None if "metal" in built else ("an Apple Silicon GPU", "metal")
    for path, what, backend in GPU_SIGNS:
        if (root / path).exists() and backend not in built:
            return what, backend
    return None


def select(asked: str | None, root: Path = Path("/")) -> Device:
    """Load the built backends (unless the CPU is asked for, or `auto` would not choose a device of theirs: asked of a
    child process first, shards/engines/ggml/device_probe.py) and choose among every device then present. When the
    fastest present is the CPU but the machine has a GPU no built backend serves, say once how to build one."""
    auto = asked is None or asked.lower() == "auto"
    if auto and _cpu_anyway():
        pass  # the backends stay unloaded: they would list nothing auto takes
    elif asked is None or asked.lower() != "cpu":
        load_backends()
    chosen = choose(asked, devices())
    if chosen.is_cpu and (asked is None or asked.lower() == "auto") and (gpu := unused_gpu(root)) is not None:
        what, backend = gpu
        if backend not in _hinted:
            _hinted.add(backend)
            log.warning(
                "this machine has %s, but the ggml engine computes on the CPU: no %s backend is built. "
                "`exo-node build-backend %s` builds one (README: GPU nodes); --device cpu silences this",
                what,
                backend,
                backend,
            )
    return chosen


def _cpu_anyway() -> bool:
    """Whether the built backends not loaded yet would add no device faster than the CPU (a child process says;
    False when none is waiting to be loaded, or the child could not say)."""
    version = binding_version()
    waiting = tuple(
        str(b.library) for b in built_backends() if b.ggml_python == version and str(b.library) not in _loaded
    )
    if not waiting:
        return False
    listed = probe(waiting)
    if listed is None:
        return False
    try:
        return fastest(tuple(Device(**d) for d in listed)).is_cpu
    except (TypeError, ValueError, LookupError) as e:
        log.warning("ggml: the child's list of devices is malformed (%s): loading the backends here", e)
        return False


def describe(present: tuple[Device, ...]) -> str:
    """What `exo-node --list-devices` prints: one line per device, the default marked."""
    best = fastest(present)
    lines = [f"{'device':<12} {'kind':<6} {'free / total memory':<22} description"]
    for d in present:
        memory = f"{d.memory_free / 2**30:.1f} / {d.memory_total / 2**30:.1f} GiB"
        mark = "  (default)" if d == best else ""
        lines.append(f"{d.name:<12} {d.kind:<6} {memory:<22} {d.description}{mark}")
    built = built_backends()
    lines.append(
        f"built backends in {backends_dir()}: {', '.join(b.backend for b in built) or 'none'}"
        f" (exo-node build-backend {{{','.join(BACKENDS)}}})"
    )
    return "\n".join(lines)


def main() -> None:
    """The child of device_probe.py: load the built backends, print the devices then listed."""
    load_backends()
    print(json.dumps({"devices": [dataclasses.asdict(d) for d in devices()]}))


if __name__ == "__main__":
    main()
