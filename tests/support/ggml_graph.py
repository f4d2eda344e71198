"""One ggml graph computed on the CPU backend, for engine tests that check a single operation against a reference."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from shards.engines.ggml.lib import Context, Tensor, cpu_buffer_type, g


@contextmanager
def computed(
    ctx: Context, backend, outputs: Sequence[Tensor], inputs: Sequence[tuple[Tensor, np.ndarray]]
) -> Iterator[None]:
    """The graph of `outputs` built in `ctx`, allocated, fed `inputs` (tensor, array) and computed on `backend`;
    the outputs' memory lives until the block ends (read them inside it)."""
    gf = ctx.graph()
    for t in outputs:
        g.ggml_set_output(t.t)
        g.ggml_build_forward_expand(gf, t.t)
    galloc = g.ggml_gallocr_new(cpu_buffer_type())
    try:
        assert g.ggml_gallocr_alloc_graph(galloc, gf)
        for t, a in inputs:
            g.ggml_backend_tensor_set(t.t, a.ctypes.data, 0, a.nbytes)
        assert g.ggml_backend_graph_compute(backend, gf) == 0
        yield
    finally:
        g.ggml_gallocr_free(galloc)


def graph_ops(gf, n_nodes: int, op: int) -> list:
    """The nodes of a built graph (a ggml_cgraph pointer and its node count) that compute `op` (a GGML_OP_*), in
    order, as ggml tensor structs."""
    nodes = (g.ggml_graph_node(gf, i).contents for i in range(n_nodes))
    return [n for n in nodes if n.op == op]
