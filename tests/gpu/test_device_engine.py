"""The ggml engine on a GPU backend's device computes the CPU engine's logits within the two backends' rounding.

The same graphs run on both (shards/engines/ggml/on_device.py): weights and KV cells in the device's buffers, every
step through ggml's scheduler. The kernels differ (a device's kernels quantize activations and sum in their own
order, as llama.cpp's GPU builds do), so the logits are compared as llama.cpp's backends are compared, by their
relative RMS difference and by the top-1 token along a teacher-forced sequence: a fixture model in float32 (F16
cache), a Gemma 3 fixture and the packaged SmolLM2 on F16 weights, a prompt, decode rows beside each other, and a range
that moves as its request outgrows it.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput  # noqa: E402
from shards.engines.ggml.devices import choose, devices  # noqa: E402
from shards.engines.ggml.engine import GgmlEngine  # noqa: E402
from shards.formats.loader import load_config  # noqa: E402
from shards.model.shard import Shard  # noqa: E402
from tests.gpu.conftest import BACKEND  # noqa: E402
from tests.support.gguf_util import smollm2_path  # noqa: E402
from tests.support.models import FIXTURES  # noqa: E402

# Relative RMS (the difference's RMS over the CPU logits' standard deviation) and top-1 agreement the device must
# reach: float32 weights differ by F16 rounding alone; quantized ones also by how each backend quantizes activations.
FLOAT_RMS, FLOAT_TOP1 = 0.01, 0.99
# SmolLM2 through 30 layers on F16 weights parts further: on lavapipe, relative RMS 4.7e-2 and top-1 0.89 over
# random tokens (flat distributions, many near-ties); on its own Q4_1 blocks 8.7e-2 and 0.84. llama.cpp's own
# Vulkan build parts from its CPU backend as far on that device (bench/device_agreement.py, docs/benchmarks.md).
DEEP_RMS, DEEP_TOP1 = 0.06, 0.85
# Routed experts amplify the backends' rounding: a router at a near-tie picks other experts (lavapipe: Qwen3-MoE
# 3.5e-3 and top-1 1.000, Mixtral 1.0e-2 and 0.979 over 48 positions), as between llama.cpp's own backends.
ROUTED_RMS, ROUTED_TOP1 = 0.03, 0.95


def engine(path, layers: int | None = None, **options) -> GgmlEngine:
    cfg = load_config(path)
    cfg = cfg if layers is None else dataclasses.replace(cfg, n_layers=layers)
    return GgmlEngine(path, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg, threads=2, adapt_threads=False, **options)


def steps(e: GgmlEngine, prompt: np.ndarray) -> np.ndarray:
    """Every position of a prompt (teacher-forced), then decode rows of two requests side by side, the first past
    its first range (256 cells: it moves), as one [positions, vocab] array."""
    out = [e.forward([StepInput("a", tokens=prompt, max_positions=len(prompt) + 20)], all_logits=True)[0]]
    out.append(e.forward([StepInput("b", tokens=prompt[:9], max_positions=40)])[0])
    for k in range(8):
        out += e.forward([StepInput("a", tokens=prompt[k : k + 1]), StepInput("b", tokens=prompt[k + 2 : k + 3])])
    e.close()
    return np.concatenate(out)


def agreement(cpu: np.ndarray, dev: np.ndarray) -> tuple[float, float]:
    """(relative RMS difference, share of positions with the same top-1 token)."""
    rms = float(np.sqrt(np.mean((dev - cpu) ** 2)) / np.std(cpu))
    return rms, float(np.mean(np.argmax(dev, axis=-1) == np.argmax(cpu, axis=-1)))


def flips_only_at_near_ties(want: np.ndarray, got: np.ndarray) -> bool:
    """Every position whose top-1 token differs had its two best tokens within the rounding of each other: their
    gap in `want` is at most twice the largest difference of that position's logits."""
    for w, g in zip(want, got):
        if np.argmax(w) != np.argmax(g):
            first, second = np.sort(w)[-2:][::-1]
            if first - second > 2 * np.abs(w - g).max():
                return False
    return True


def test_the_device_is_listed_with_its_memory_and_chosen_by_name_or_backend(gpu):
    present = devices()
    assert gpu in present and gpu.kind in ("gpu", "igpu") and gpu.memory_total > 0
    assert choose(BACKEND, present) == choose(gpu.name.lower(), present) == gpu
    assert choose("auto", present) == gpu  # the fastest present
    assert choose("cpu", present).is_cpu


def test_a_fixture_models_logits_on_the_device_are_the_cpu_engines_within_f16_rounding(gpu, capsys):
    path = FIXTURES / "llama"
    prompt = np.random.default_rng(1).integers(3, load_config(path).vocab_size, 200)  # within its 256 positions
    cpu = steps(engine(path, quantize="none"), prompt)
    dev = steps(engine(path, quantize="none", device=gpu.name), prompt)
    rms, top1 = agreement(cpu, dev)
    with capsys.disabled():
        print(
            f"\n{gpu.name}: llama fixture, F32 weights, {len(cpu)} positions: relative RMS {rms:.2e}, top-1 {top1:.3f}"
        )
    assert rms < FLOAT_RMS and top1 >= FLOAT_TOP1


def test_smollm2_on_the_device_agrees_with_the_cpu_engine_over_256_teacher_forced_positions(gpu, capsys, caplog):
    path = smollm2_path()
    prompt = np.random.default_rng(2).integers(100, 40000, 256)
    cpu = steps(engine(path, quantize="f16"), prompt)
    with caplog.at_level(logging.INFO, logger="shards.engines.ggml.on_device"):
        e = engine(path, quantize="f16", device=gpu.name)
        dev = steps(e, prompt)
    rms, top1 = agreement(cpu[:256], dev[:256])
    with capsys.disabled():
        print(
            f"\n{gpu.name}: SmolLM2, F16 weights (a node's default), 256 teacher-forced positions: relative RMS {rms:.2e}, top-1 {top1:.3f}"
        )
        print(f"ops on the CPU instead of {gpu.name}: {dict(e.on.fallbacks) or 'none'}")
    assert rms < DEEP_RMS and top1 >= DEEP_TOP1
    rms, top1 = agreement(cpu[256:], dev[256:])  # the decode rows, beside each other and past a range's move
    with capsys.disabled():
        print(f"decode rows: relative RMS {rms:.2e}, top-1 {top1:.3f}")
    assert rms < DEEP_RMS
    said = [r.getMessage() for r in caplog.records if gpu.name in r.getMessage()]
    assert len(said) == 1, said  # the ops on the CPU (or that there are none), said once for the engine


def test_gemma3s_windows_and_soft_caps_on_the_device_give_the_cpu_engines_logits(gpu, capsys):
    """The Gemma 3 fixture (F16 GGUF): sliding-window masks as a second input, GeGLU, soft-caps, local rope."""
    from tests.engines.test_gemma import GEMMA, logits

    path = GEMMA / "gemma3.gguf"
    cpu, dev = (logits([engine(path, device=d)]) for d in (None, gpu.name))
    rms, top1 = agreement(cpu, dev)
    with capsys.disabled():
        print(
            f"\n{gpu.name}: Gemma 3 fixture, F16 weights, {len(cpu)} positions: relative RMS {rms:.2e}, top-1 {top1:.3f}"
        )
    assert rms < FLOAT_RMS and top1 >= FLOAT_TOP1


def test_a_device_the_build_lacks_is_refused_with_the_devices_present_and_the_fix(gpu):
    other = "hip" if BACKEND == "cuda" else "cuda"
    with pytest.raises(ValueError, match=rf"--device {other}0: .*no such device.*build-backend {other}"):
        engine(FIXTURES / "llama", layers=1, device=f"{other}0")


def test_a_node_on_the_device_reports_its_memory_for_placement(gpu):
    from node.settings import Machine

    machine = Machine.here("ggml", BACKEND)
    assert machine.gpu is not None and machine.gpu.name == gpu.name
    assert machine.memory_for_layers == machine.gpu.free <= gpu.memory_total
    assert Machine.here("ggml", "cpu").gpu is None


def test_on_the_device_a_row_alone_and_among_others_agree_within_rounding_not_bit_for_bit(gpu, capsys):
    """The CPU engine is batch invariant (a row's logits are the same bits whatever else its step holds:
    tests/engines); a device's kernels pick their tiling by the batch's size, so on a device the stated mode is
    agreement within the two backends' rounding. What the device gives is printed (0 would be bitwise)."""
    path = FIXTURES / "llama"
    ids = np.random.default_rng(3).integers(3, load_config(path).vocab_size, 60)
    e = engine(path, quantize="none", device=gpu.name)
    for name in ("alone", "beside"):
        e.forward([StepInput(name, tokens=ids[:40], max_positions=48)])
    alone = e.forward([StepInput("alone", tokens=ids[40:41])])[0]
    others = [StepInput(f"o{i}", tokens=ids[i + 1 : i + 41], max_positions=48) for i in range(15)]
    e.forward(others)
    beside = e.forward(
        [StepInput("beside", tokens=ids[40:41]), *(StepInput(o.request_id, tokens=ids[:1]) for o in others)]
    )
    e.close()
    worst = float(np.abs(alone - beside[0]).max() / np.std(alone))
    with capsys.disabled():
        print(f"\n{gpu.name}: a decode row alone vs among 16, largest difference {worst:.2e} of the logits' spread")
    assert worst < FLOAT_RMS and np.argmax(alone) == np.argmax(beside[0])


@pytest.mark.parametrize("file", ["qwen3moe.gguf", "mixtral.gguf"])
def test_mixture_of_experts_on_the_device_gives_the_cpu_engines_logits(gpu, file, capsys):
    """Routed experts (ggml_mul_mat_id) on the device, against the CPU engine over a prompt's every position."""
    path = FIXTURES / "moe" / file
    prompt = np.random.default_rng(4).integers(3, load_config(path).vocab_size, 48)
    cpu, dev = (
        e.forward([StepInput("m", tokens=prompt, max_positions=64)], all_logits=True)[0]
        for e in (engine(path), engine(path, device=gpu.name))
    )
    rms, top1 = agreement(cpu, dev)
    with capsys.disabled():
        print(f"\n{gpu.name}: {file}, {len(cpu)} positions: relative RMS {rms:.2e}, top-1 {top1:.3f}")
    assert rms < ROUTED_RMS and top1 >= ROUTED_TOP1


def test_a_weight_larger_than_the_devices_kernels_address_stays_in_host_memory_and_computes(gpu, tmp_path, capsys):
    """Vulkan kernels address at most maxStorageBufferRange bytes of a buffer (128 MiB on lavapipe): Gemma 3's
    262k-token embedding table is larger. Such a weight stays in host memory and its ops run on the CPU, as in
    llama.cpp; in a device buffer ggml's scheduler would abort the process. A random Llama with a 300k-token
    vocabulary (each table 147 MiB in F16) on the device gives the CPU engine's logits."""
    from bench.large_model import write_f16

    shape = dict(
        hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
    )
    path = write_f16(tmp_path / "wide.gguf", shape | {"vocab_size": 300_000})
    ids = np.random.default_rng(4).integers(3, 300_000, 24)
    logits = []
    for device in (None, gpu.name):
        e = engine(path, quantize="none", device=device)
        logits.append(e.forward([StepInput("a", tokens=ids, max_positions=32)], all_logits=True)[0])
        held = e.on.host_weights if device else 0
        e.close()
    rms, _ = agreement(*logits)
    with capsys.disabled():
        print(f"\n{gpu.name}: {held / 2**20:.0f} MiB of weights kept in host memory; relative RMS {rms:.2e}")
    assert rms < FLOAT_RMS and flips_only_at_near_ties(*logits)  # random weights, 300k tokens: near-ties abound
    if BACKEND == "vulkan" and "llvmpipe" in gpu.description:
        assert held == 2 * 300_000 * 256 * 2  # the embedding table and the output head
