"""ggml-python 0.0.45 (ctypes bindings of llama.cpp's ggml 0.15.3), made safe to call from the ggml engine.

Everything the engine asks of ggml goes through this module or `g`, the binding it re-exports (the host memory it
hands ggml: host_memory.py). Three facts shape it:

- Any failed GGML_ASSERT inside ggml calls abort(): the whole node dies, no exception. So nothing here hands ggml
  a value it has not checked (tensor counts against the context's room, byte counts against ggml_nbytes, weight
  types against the supported list, rows against block sizes); GGML_NO_BACKTRACE stops ggml from attaching gdb
  when it aborts anyway.
- The binding declares four functions with a typing.NewType as restype; ctypes then returns the pointer truncated
  to a C int and its next use segfaults. `_fix_restypes` repairs them at import.
- Weights and KV caches only ever live in the plain CPU buffer type (or in memory we map ourselves and hand over as
  a CPU buffer), never in the AMX or CPU_REPACK "extra" buffer types: those crash for types they have no kernel
  for (SIGSEGV in ggml_backend_amx_mul_mat on AMX hosts, in tensor_set for Q4_1/Q8_0/Q6_K with CPU_REPACK), and
  ggml only dispatches to them for tensors placed in them.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # read by ggml when it aborts: print the assertion, no gdb

try:
    import ggml.ggml as g
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("the ggml engine needs ggml-python: pip install 'exo-node[ggml]'") from e

from gguf import GGMLQuantizationType

from shards.formats.quant import SUPPORTED_TYPES

Tensor = "ctypes._Pointer[g.ggml_tensor]"


def _fix_restypes() -> None:
    for name in (
        "ggml_backend_cpu_buffer_type",
        "ggml_backend_alloc_buffer",
        "ggml_backend_cpu_buffer_from_ptr",
        "ggml_backend_sched_get_tensor_backend",
    ):
        getattr(g.lib, name).restype = ctypes.c_void_p


_fix_restypes()

_log = logging.getLogger("ggml")
_LEVELS = {
    g.GGML_LOG_LEVEL_ERROR: logging.ERROR,
    g.GGML_LOG_LEVEL_WARN: logging.WARNING,
    g.GGML_LOG_LEVEL_INFO: logging.DEBUG,
    g.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
}


@g.ggml_log_callback
def _forward_log(level: int, text: bytes, user_data) -> None:
    """ggml's messages (it prints each repacked tensor, for one) into Python logging instead of raw stderr."""
    if level in _LEVELS and _log.isEnabledFor(_LEVELS[level]):
        _log.log(_LEVELS[level], "%s", text.decode(errors="replace").rstrip())


g.ggml_log_set(_forward_log, None)  # the module keeps the callback object alive

# GGUF's type ids are ggml's (GGMLQuantizationType.Q4_K == GGML_TYPE_Q4_K == 12): one enum for both.
F32, F16, I32 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16), g.GGML_TYPE_I32
WEIGHT_TYPES = frozenset(int(t) for t in SUPPORTED_TYPES)  # the types the engine's tests run through ggml
QUANTIZE_TYPES = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_k": GGMLQuantizationType.Q4_K,
    "f16": GGMLQuantizationType.F16,
}
MAX_DIMS = 4


class GgmlError(RuntimeError):
    """ggml refused something (an allocation, a graph) in a way it reports instead of aborting."""


def default_threads() -> int:
    """All cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def row_bytes(ggml_type: int, n: int) -> int:
    """Bytes of one row of n values; n must be whole blocks (checked by the caller)."""
    return int(g.ggml_row_size(ggml_type, n))


def block_size(ggml_type: int) -> int:
    return int(g.ggml_blck_size(ggml_type))


class Context:
    """A metadata-only ggml context (no_alloc) for at most `capacity` tensors and optionally one graph of that many
    nodes. Creating more tensors than it has room for would abort inside ggml, so `room` is checked first."""

    def __init__(self, capacity: int, graph: bool = False):
        self.capacity, self.count = capacity, 0
        size = capacity * g.ggml_tensor_overhead() + (g.ggml_graph_overhead_custom(capacity, False) if graph else 0)
        self.ctx = g.ggml_init(g.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise MemoryError(f"ggml_init could not reserve {size} bytes")

    def room(self, n: int = 1) -> None:
        """Claim room for n more tensors (every op creates exactly one)."""
        if self.count + n > self.capacity:
            raise GgmlError(f"ggml context full ({self.capacity} tensors); the graph is larger than estimated")
        self.count += n

    def new(self, ggml_type: int, ne: tuple[int, ...]) -> Tensor:
        if not 1 <= len(ne) <= MAX_DIMS or any(n <= 0 for n in ne):
            raise ValueError(f"bad tensor shape {ne}")
        self.room()
        return g.ggml_new_tensor(self.ctx, ggml_type, len(ne), (ctypes.c_int64 * len(ne))(*ne))

    def graph(self) -> ctypes._Pointer[g.ggml_cgraph]:
        return g.ggml_new_graph_custom(self.ctx, self.capacity, False)

    def free(self) -> None:
        if self.ctx:
            g.ggml_free(self.ctx)
            self.ctx = None


def cpu_buffer_type() -> int:
    """The plain host buffer type: generic ggml-cpu kernels for every type, never AMX or repacked layouts."""
    return g.ggml_backend_cpu_buffer_type()


def compute_once(
    ctx: Context, outputs: list[tuple[Tensor, tuple[int, ...]]], inputs: list[tuple[Tensor, np.ndarray]], what: str
) -> list[np.ndarray]:
    """A probe's one-off graph: `outputs` (F32 tensors of `ctx`, each read back as an array of its shape) computed on
    two CPU threads in plain host memory, after `inputs` are copied in. `ctx` needs room for the graph."""
    for t, _ in inputs:
        g.ggml_set_input(t)
    gf = ctx.graph()
    for y, _ in outputs:
        g.ggml_set_output(y)
        g.ggml_build_forward_expand(gf, y)
    galloc, backend = g.ggml_gallocr_new(cpu_buffer_type()), None
    try:
        if not galloc or not g.ggml_gallocr_alloc_graph(galloc, gf):
            raise MemoryError(f"ggml could not allocate {what}'s graph")
        for t, a in inputs:
            g.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)
        backend = g.ggml_backend_cpu_init()
        g.ggml_backend_cpu_set_n_threads(backend, 2)
        if g.ggml_backend_graph_compute(backend, gf) != 0:
            raise GgmlError(f"{what}'s graph failed to compute")
        out = [np.empty(shape, np.float32) for _, shape in outputs]
        for (y, _), a in zip(outputs, out):
            g.ggml_backend_tensor_get(y, a.ctypes.data, 0, a.nbytes)
        return out
    finally:
        if backend:
            g.ggml_backend_free(backend)
        if galloc:
            g.ggml_gallocr_free(galloc)


def _extra_buffer_types() -> list[int]:
    """The CPU device's "extra" buffer types (CPU_REPACK, AMX where compiled in)."""
    dev = g.ggml_backend_dev_by_type(g.GGML_BACKEND_DEVICE_TYPE_CPU)
    proc = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not proc:
        return []
    listed = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)(dev)
    out, i = [], 0
    while listed[i]:
        out.append(listed[i])
        i += 1
    return out


_REPACK: list[int | None] = []


def repack_buffer_type() -> int | None:
    """CPU_REPACK, the one extra buffer type the engine may use (never AMX): weights placed in it are re-laid out
    for interleaved kernels, faster in prefill and batched decode (docs/benchmarks-log.md, figures once in code)."""
    if not _REPACK:
        _REPACK.append(next((b for b in _extra_buffer_types() if g.ggml_backend_buft_name(b) == b"CPU_REPACK"), None))
    return _REPACK[0]


def repack_supported(ggml_type: int, ne: tuple[int, ...]) -> bool:
    """Would CPU_REPACK take a matmul weight of this type and shape (2-D, or 3-D stacked experts for mul_mat_id) on
    this CPU and build? Placing one it has no kernel for segfaults (Q4_1, Q8_0, Q6_K here), and one whose rows don't
    interleave aborts. llama.cpp's probe: a dummy mul_mat (mul_mat_id) whose weight claims a zero-size CPU_REPACK
    buffer, asked through ggml_backend_dev_supports_op."""
    buft = repack_buffer_type()
    if buft is None or len(ne) not in (2, 3):
        return False
    dev = g.ggml_backend_dev_by_type(g.GGML_BACKEND_DEVICE_TYPE_CPU)
    ctx, buf = Context(4), g.ggml_backend_buft_alloc_buffer(buft, 0)
    try:
        w = ctx.new(ggml_type, ne)
        if len(ne) == 3:  # stacked experts: the mul_mat_id a MoE layer runs (2 of them for each of 8 rows)
            op = g.ggml_mul_mat_id(ctx.ctx, w, ctx.new(F32, (ne[0], 2, 8)), ctx.new(I32, (2, 8)))
        else:
            op = g.ggml_mul_mat(ctx.ctx, w, ctx.new(F32, (ne[0], 8)))
        w.contents.buffer = buf  # claims residency, allocates nothing
        return bool(g.ggml_backend_dev_supports_op(dev, op))
    finally:
        if buf:
            g.ggml_backend_buffer_free(buf)
        ctx.free()


def validate_rows(ggml_type: int, data: np.ndarray, what: str) -> None:
    """ggml's own check of raw weight bytes (NaN/inf values or block scales): a damaged file is an error here, not
    garbage logits later."""
    if not g.ggml_validate_row_data(ggml_type, data.ctypes.data, data.nbytes):
        raise ValueError(f"{what}: {type_name(ggml_type)} data holds NaN or infinite values")


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> np.ndarray:
    """Raw blocks [rows, row_bytes] -> float32 `shape` with ggml's own to_float (the values gguf-py's reference code
    gives, bit for bit, in a fraction of its time: what requantizing a GGUF on load spends most of its time on)."""
    rows, n = shape
    if ggml_type not in WEIGHT_TYPES or n % block_size(ggml_type) or data.nbytes != rows * row_bytes(ggml_type, n):
        raise ValueError(f"{data.nbytes} bytes are not {rows} rows of {n} {type_name(ggml_type)} values")
    to_float = g.ggml_get_type_traits(ggml_type).contents.to_float
    if not to_float:
        raise ValueError(f"ggml cannot dequantize {type_name(ggml_type)}")
    src = np.ascontiguousarray(data)
    out = np.empty(shape, dtype=np.float32)
    to_float(src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), rows * n)
    return out


def quantize(w: np.ndarray, ggml_type: int, threads: int = 1, importance: np.ndarray | None = None) -> np.ndarray:
    """float32 [rows, n] -> raw blocks uint8 [rows, row_bytes] with ggml's reference quantizers (llama.cpp's
    bytes, bit for bit). Rows are split over `threads` Python threads: ctypes releases the GIL during each call.
    `importance` (float32 [n], llama-quantize's imatrix for this tensor) is required by the 1-2 bit IQ types."""
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError("quantize needs a 2-D float32 matrix")
    rows, n = w.shape
    if n % block_size(ggml_type):
        raise ValueError(f"cannot quantize rows of {n} values to {type_name(ggml_type)}")
    if importance is None and g.ggml_quantize_requires_imatrix(ggml_type):
        raise ValueError(f"quantizing to {type_name(ggml_type)} needs importance weights (an imatrix)")
    imatrix = None
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=np.float32)
        if importance.shape != (n,) or not np.all(np.isfinite(importance)) or np.any(importance < 0):
            raise ValueError(f"importance must be {n} non-negative finite values")
        imatrix = importance.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    src = np.ascontiguousarray(w)
    out = np.empty((rows, row_bytes(ggml_type, n)), dtype=np.uint8)
    src_ptr = src.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    g.ggml_quantize_init(ggml_type)  # the IQ types' lookup grids, built once (not thread-safe inside the chunks)

    def chunk(r0: int, r1: int) -> None:
        g.ggml_quantize_chunk(ggml_type, src_ptr, out.ctypes.data, r0 * n, r1 - r0, n, imatrix)

    threads = max(1, min(threads, rows // 64 or 1))
    if threads == 1:
        chunk(0, rows)
    else:
        from concurrent.futures import ThreadPoolExecutor

        cuts = np.linspace(0, rows, threads + 1, dtype=np.int64)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(chunk, cuts[:-1], cuts[1:]))
    return out
