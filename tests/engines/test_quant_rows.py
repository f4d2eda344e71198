"""A step of a few rows on a weight of the Q8_0 family goes by ggml's vec_dot kernels, not tinyBLAS's, where this CPU
runs it faster that way and every row keeps its bits (shards/engines/ggml/quant_rows.py): the route gives each row
what tinyBLAS and the lone row give it (or the probe refuses the type), the probe's verdict stops at the first row
count that is not both faster and the same, and an engine's steps are bit for bit the same whichever route runs."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput  # noqa: E402
from shards.engines.ggml import quant_rows  # noqa: E402
from shards.engines.ggml.engine import GgmlEngine  # noqa: E402
from shards.formats.loader import load_config  # noqa: E402
from shards.model.shard import Shard  # noqa: E402
from tests.engines.test_ggml_engine import as_type, run_ops  # noqa: E402
from tests.support.gguf_util import smollm2_path  # noqa: E402

FAMILY = [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.IQ4_NL]  # the types whose rows ggml converts to Q8_0 for their dot products


@pytest.fixture
def verdicts(monkeypatch):
    """Set a kind of weight's verdict (as if probed) for the test: {(type, row length): rows}; the real verdicts
    come back after it."""
    forced: dict[tuple[int, int], int] = {}
    monkeypatch.setattr(quant_rows, "_verdicts", forced)
    return forced


def counted_routes(monkeypatch) -> list[int]:
    """The row counts of the steps built by the vec_dot route, as they are built."""
    built, route = [], quant_rows.strided_rows
    monkeypatch.setattr(quant_rows, "strided_rows", lambda node, x, k, n: built.append(n) or route(node, x, k, n))
    return built


@pytest.mark.parametrize("ggml_type", FAMILY, ids=lambda t: t.name)
def test_in_plain_memory_every_row_of_a_step_gets_the_bits_it_gets_alone(ggml_type, monkeypatch):
    """Whatever this CPU's verdict: for IQ4_NL (on an AVX-512 EPYC) only the vec_dot route does it, so every step
    of 2+ rows takes it."""
    rng = np.random.default_rng(int(ggml_type))
    qt = as_type(rng.standard_normal((96, 1024), dtype=np.float32), ggml_type)
    x, ids = rng.standard_normal((7, 1024), dtype=np.float32), np.zeros(1, np.int32)
    alone = np.concatenate([run_ops(qt, x[i : i + 1], ids, repack=False)[0] for i in range(len(x))])
    verdict = quant_rows.vec_dot_rows(int(ggml_type), 1024)
    built = counted_routes(monkeypatch)
    stepped, _, _ = run_ops(qt, x, ids, repack=False)
    assert np.array_equal(stepped, alone)
    assert built == ([7] if verdict >= 7 else [])


@pytest.mark.parametrize("ggml_type", FAMILY, ids=lambda t: t.name)
def test_the_vec_dot_route_is_taken_for_speed_only_where_it_gives_tinyblas_bits(ggml_type, monkeypatch):
    rng = np.random.default_rng(int(ggml_type))
    qt = as_type(rng.standard_normal((96, 1024), dtype=np.float32), ggml_type)
    x, ids = rng.standard_normal((7, 1024), dtype=np.float32), np.zeros(1, np.int32)
    built = counted_routes(monkeypatch)
    monkeypatch.setattr(quant_rows, "_verdicts", {(int(ggml_type), 1024): 0})
    tiny, _, _ = run_ops(qt, x, ids, repack=False)
    assert built == []
    monkeypatch.setattr(quant_rows, "_verdicts", {(int(ggml_type), 1024): 16})
    vec, _, _ = run_ops(qt, x, ids, repack=False)
    assert built == [7]  # the step went by vec_dot
    monkeypatch.setattr(quant_rows, "_verdicts", {})
    assert np.array_equal(vec, tiny) or quant_rows.vec_dot_rows(int(ggml_type), 1024) in (0, quant_rows.EVERY)


@pytest.mark.parametrize("ggml_type", [Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.F16, Q.F32], ids=lambda t: t.name)
def test_types_whose_rows_are_not_q8_0_are_never_probed_nor_routed(ggml_type, verdicts, monkeypatch):
    monkeypatch.setattr(quant_rows, "_probe", lambda t, k: pytest.fail(f"{Q(t).name} was probed"))
    assert not quant_rows.candidate(int(ggml_type))
    assert quant_rows.vec_dot_rows(int(ggml_type), 1024) == 0


def probe_with(
    monkeypatch,
    timings: dict[int, tuple[float, float]],
    vec_bits_from: int | None = None,
    tiny_bits_from: int | None = None,
) -> int:
    """The probe's verdict where `timings[n]` = (tinyBLAS's, vec_dot's) seconds for n rows, and from
    `vec_bits_from` (`tiny_bits_from`) rows on that route gives a step's last row other bits than it gets alone."""
    monkeypatch.setattr(quant_rows, "_blocks", lambda rng, t, out, k: np.zeros((1, 1), np.uint8))

    def product(ggml_type, weight, x, strided, repeats=quant_rows.REPEATS):
        n, off = len(x), vec_bits_from if strided else tiny_bits_from
        out = np.zeros((n, 4), np.float32)
        if off is not None and n >= off:
            out[-1, -1] = np.float32(1e-30)
        return out, timings[n][1 if strided else 0] if n > 1 else 0.0

    monkeypatch.setattr(quant_rows, "_product", product)
    return quant_rows._probe(int(Q.Q8_0), 576)


def test_the_verdict_is_the_last_row_count_before_vec_dot_stops_being_faster_or_the_same(monkeypatch):
    faster = {n: (2.0, 1.0) for n in (*quant_rows.ROWS, *quant_rows.EXACT_ROWS)}
    assert probe_with(monkeypatch, faster) == max(quant_rows.ROWS)
    slower_from_8 = {n: (2.0, 1.0) if n < 8 else (1.0, 2.0) for n in faster}
    assert probe_with(monkeypatch, slower_from_8) == 6
    barely = {n: (1.0, quant_rows.MARGIN) if n == 3 else (2.0, 1.0) for n in faster}
    assert probe_with(monkeypatch, barely) == 2  # within the margin is no gain
    assert probe_with(monkeypatch, faster, vec_bits_from=7) == 0  # never for speed at the cost of a row's bits
    assert probe_with(monkeypatch, faster, vec_bits_from=2) == 0


def test_where_only_vec_dot_keeps_a_rows_bits_every_step_of_two_rows_or_more_takes_it(monkeypatch):
    slower = {n: (1.0, 2.0) for n in (*quant_rows.ROWS, *quant_rows.EXACT_ROWS)}
    assert probe_with(monkeypatch, slower, tiny_bits_from=7) == quant_rows.EVERY  # however slow
    assert probe_with(monkeypatch, slower, tiny_bits_from=2, vec_bits_from=2) == 0  # nothing keeps them


def test_the_probe_times_a_weight_past_the_caches_of_the_row_length_asked(monkeypatch):
    """The real probe's weight is past a CPU's caches, as a model's is (in cache tinyBLAS wins at every count), of
    the row length of the weights it decides for (tinyBLAS's tiles fare otherwise by row length), and both routes
    multiply by it (the route's own bits: the first test)."""
    seen = []
    monkeypatch.setattr(quant_rows, "timed", lambda t, w, x: seen.append((w, x)) or (True, 2.0, 1.0))
    assert quant_rows._probe(int(Q.Q8_0), 576) == max(quant_rows.ROWS)
    weight, x = seen[0]
    assert weight.nbytes >= quant_rows.PROBE_BYTES - weight.shape[1] and x.shape[1] == 576
    assert weight.shape[1] == 576 // 32 * 34  # Q8_0 blocks of 32 values in 34 bytes
    rng = np.random.default_rng(0)
    small = quant_rows._blocks(rng, int(Q.Q8_0), 4096, 576)
    x = rng.standard_normal((3, 576), dtype=np.float32)
    (tiny, t_tiny), (vec, t_vec) = (quant_rows._product(int(Q.Q8_0), small, x, s) for s in (False, True))
    assert tiny.shape == vec.shape == (3, 4096) and np.isfinite(tiny).all()
    assert np.array_equal(tiny, vec) and t_tiny > 0 and t_vec > 0


def last_layers_steps(rows: int) -> np.ndarray:
    """The packaged file's last two layers and its Q8_0 output head, one thread: logits of `rows` requests' decode
    step, batched, after a 3-position prefill each."""
    path = smollm2_path()
    cfg = load_config(path)
    engine = GgmlEngine(path, Shard("m", cfg.n_layers - 2, cfg.n_layers, cfg.n_layers), cfg, threads=1, quantize="none")
    try:
        hidden = np.random.default_rng(5).standard_normal((rows, 4, cfg.hidden_size), dtype=np.float32)
        for i in range(rows):
            engine.forward([StepInput(f"r{i}", hidden=hidden[i, :3], max_positions=8)])
        steps = [StepInput(f"r{i}", hidden=hidden[i, 3:], max_positions=8) for i in range(rows)]
        return np.stack(engine.forward(steps))
    finally:
        engine.close()


def test_an_engines_batched_step_is_the_same_by_either_route_and_row_for_row_the_lone_rows(verdicts, monkeypatch):
    built = counted_routes(monkeypatch)
    head = (int(Q.Q8_0), load_config(smollm2_path()).hidden_size)
    verdicts[head] = max(quant_rows.ROWS)
    by_vec_dot = last_layers_steps(5)
    assert 5 in built  # the head's step went by vec_dot
    verdicts[head] = 0
    by_tinyblas = last_layers_steps(5)
    assert np.array_equal(by_vec_dot, by_tinyblas)
    assert np.array_equal(last_layers_steps(1)[0], by_tinyblas[0])
