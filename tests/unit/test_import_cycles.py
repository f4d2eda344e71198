"""No import cycles among the modules of `shards/`: imports go one way (e.g. formats.loader -> formats.hf /
formats.gguf_model -> formats.config / formats.weights). Imports inside functions count too: a lazy import hides
a cycle from Python, not from a reader."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports anywhere in its source (`from a.b import c` counts a.b, and a.b.c
    when that is a module)."""
    paths = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in paths and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colouring nodes on the current path)."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once fully explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return (path + [node])[(path + [node]).index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_shards_has_no_import_cycles():
    graph = module_graph("shards")
    assert "shards.formats.loader" in graph and graph["shards.formats.loader"] >= {"shards.formats.hf"}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; move the shared part into a module both can import"


# -- node/: no cycles, and one direction between its layers ----------------------------------------------------------
# http -> runtime -> core; grpc -> runtime.transport (the port it implements) and core; the core is pure.
FORBIDDEN = {
    "node.core": (
        "node.runtime",
        "node.grpc",
        "node.http",
        "node.fetch",
        "node.cli",
        "node.settings",
        "grpc",
        "google.protobuf",
        "aiohttp",
        "asyncio",
    ),
    "node.runtime": ("node.http", "node.grpc", "node.cli", "node.settings", "grpc", "google.protobuf", "aiohttp"),
    "node.grpc": ("node.http", "node.cli", "node.settings", "aiohttp"),
    "node.http": ("node.grpc", "node.cli", "node.settings", "grpc", "google.protobuf"),
    "node.fetch": ("node.http", "node.cli", "node.settings"),
}
PORTS = {"node.grpc": {"node.runtime.transport"}, "node.fetch": {"node.runtime.transport"}}  # the one runtime module


def all_imports(path: Path) -> set[str]:
    """Every module name `path` imports, anywhere in it (function bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_node_has_no_import_cycles():
    graph = module_graph("node")
    assert graph["node.runtime.node"] >= {"node.runtime.pipeline", "node.runtime.peers", "node.runtime.metrics"}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}; move the shared part into a module both can import"


def test_node_layers_import_in_one_direction():
    wrong = []
    for path in sorted((ROOT / "node").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        layer = next((p for p in FORBIDDEN if _within(name, p)), None)
        if layer is None:
            continue
        for target in all_imports(path):
            if any(_within(target, banned) for banned in FORBIDDEN[layer]):
                wrong.append(f"{name} imports {target}")
            elif (
                layer in PORTS
                and _within(target, "node.runtime")
                and not any(_within(target, port) for port in PORTS[layer])
            ):
                wrong.append(f"{name} imports {target} (of the runtime it may use only {sorted(PORTS[layer])})")
    assert not wrong, (
        "imports against the layers (http -> runtime -> core; grpc -> runtime.transport, core):\n" + "\n".join(wrong)
    )


def test_the_layer_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from node.http.schema import ApiError\n    import grpc\n")
    assert all_imports(module) >= {"node.http.schema", "node.http.schema.ApiError", "grpc"}
