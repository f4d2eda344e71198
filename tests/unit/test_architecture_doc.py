"""docs/architecture.md's layer map is the code's: every import edge between the layers of node/, shards/ and
discovery/ is in the documented map, and every documented edge is still made by some module. A newcomer reads the
map to learn what may import what; a map that drifted teaches the wrong design. Imports are read as
tests/unit/test_import_cycles.py reads them (anywhere in a module, function bodies included)."""

import re

import pytest

from tests.unit.test_import_cycles import ROOT, all_imports

DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("node", "shards", "discovery")
HEADING = "## Layers and one import direction"
LINE = re.compile(r"^    (\S+)\s.*->\s*(\S.*)$")  # `    node/http   what it is   -> node/runtime, shards`


def layer_name(path: str) -> str:
    """`node/http` -> `node.http`, `node/cli.py` -> `node.cli`: a layer as the module prefix it covers."""
    return path.removesuffix(".py").replace("/", ".")


def documented_map(text: str) -> dict[str, set[str]]:
    """The indented block under the layers heading: each line a layer, what it is, and after `->` the layers it
    imports (comma-separated, or `nothing`)."""
    if HEADING not in text:
        raise AssertionError(f"docs/architecture.md has no {HEADING!r} section: the layer map lives there")
    block = text.split(HEADING, 1)[1].split("\n\n", 2)[1]  # the first paragraph after the heading's blank line
    layers = {}
    for line in block.splitlines():
        match = LINE.match(line)
        if match is None:
            raise AssertionError(f"layer map line not understood (want `    LAYER  what  -> A, B`): {line!r}")
        targets = match.group(2).strip()
        layers[layer_name(match.group(1))] = (
            set() if targets == "nothing" else {layer_name(t.strip()) for t in targets.split(",")}
        )
    return layers


def layer_of(module: str, layers: set[str]) -> str | None:
    """The most specific documented layer a module belongs to (`node.core.plan` -> `node.core`)."""
    owners = [layer for layer in layers if module == layer or module.startswith(layer + ".")]
    return max(owners, key=len, default=None)


def real_edges(layers: set[str]) -> tuple[dict[tuple[str, str], list[str]], list[str]]:
    """Layer -> layer import edges, each with the modules that make it; and the modules in no documented layer
    (an empty package `__init__` above the layers, such as node/__init__.py, is in none and imports nothing)."""
    edges: dict[tuple[str, str], list[str]] = {}
    homeless = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            source = layer_of(module, layers)
            if source is None:
                if path.read_text(encoding="utf-8").strip():
                    homeless.append(module)
                continue
            for target in all_imports(path):
                if (dest := layer_of(target, layers)) is not None and dest != source:
                    edges.setdefault((source, dest), []).append(module)
    return edges, homeless


def drift(documented: dict[str, set[str]], real: dict[tuple[str, str], list[str]]) -> list[str]:
    """What differs between the map and the code, in sentences that say which side to fix."""
    wrong = []
    for (source, dest), modules in sorted(real.items()):
        if dest not in documented.get(source, set()):
            wrong.append(f"{source} imports {dest} (in {', '.join(sorted(set(modules)))}), and the map doesn't say so")
    for source, targets in sorted(documented.items()):
        for dest in sorted(targets - set(documented)):
            wrong.append(f"the map names {dest} as a target of {source}, and {dest} is no layer of the map")
        for dest in sorted(targets & set(documented)):
            if (source, dest) not in real:
                wrong.append(f"the map says {source} imports {dest}, and no module of {source} does any more")
    return wrong


def test_the_documented_layer_map_is_read_whole():
    layers = documented_map(DOC.read_text(encoding="utf-8"))
    assert {"node.http", "node.runtime", "node.core", "shards", "discovery", "node.cli"} <= set(layers)
    assert "node.runtime" in layers["node.http"] and layers["shards"] == set()


def test_every_import_edge_between_layers_is_the_documented_one():
    layers = documented_map(DOC.read_text(encoding="utf-8"))
    real, homeless = real_edges(set(layers))
    assert not homeless, f"modules in no layer of docs/architecture.md's map: {homeless}; add their layer to the map"
    wrong = drift(layers, real)
    assert not wrong, (
        "docs/architecture.md's layer map and the imports differ; change the code or the map "
        "(and the prose that explains it):\n" + "\n".join(wrong)
    )


def test_drift_is_seen_in_both_directions():
    documented = {"a": {"b"}, "b": set(), "c": set()}
    assert drift(documented, {("a", "b"): ["a.x"]}) == []
    assert drift(documented, {("a", "b"): ["a.x"], ("b", "c"): ["b.y"]}) == [
        "b imports c (in b.y), and the map doesn't say so"
    ]
    assert drift(documented, {}) == ["the map says a imports b, and no module of a does any more"]


def test_the_map_parser_refuses_a_line_it_cannot_read():
    text = f"{HEADING}\n\n    node/http   the API   -> node/runtime\n    node/core   the core\n\nprose\n"
    with pytest.raises(AssertionError, match="node/core"):
        documented_map(text)
    assert documented_map(f"{HEADING}\n\n    shards   math   -> nothing\n    node/cli.py   x  -> shards\n") == {
        "shards": set(),
        "node.cli": {"shards"},
    }


def test_a_layer_is_the_most_specific_prefix():
    layers = {"node.core", "node.cli", "shards"}
    assert layer_of("node.core.placement.ring", layers) == "node.core"
    assert layer_of("node.cli", layers) == "node.cli"
    assert layer_of("node.client", layers) is None
    assert layer_of("numpy", layers) is None
