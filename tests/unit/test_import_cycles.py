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
                return (path + [node])[(path + [node]).index(nxt):] + [nxt]
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
