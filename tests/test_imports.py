"""The package's import graph: no cycles (also through function-level imports), and the pure
modules stay pure."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "f8dist"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """{module: {f8dist modules it imports anywhere in its source}}."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                # the module itself, or the package that holds it
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t.startswith("f8dist") and t != name and t != "f8dist":
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 20  # the walk found the package
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_modules_import_no_distributed_code():
    # scale math is pure; the float8 tensor and its gemm need no f8dist distributed module
    graph = import_graph()
    for name in ("f8dist.scaling", "f8dist.config", "f8dist.gemm"):
        assert graph[name] <= {"f8dist.config", "f8dist.scaling"}, (name, graph[name])
    source = (PACKAGE / "scaling.py").read_text()
    assert "torch.distributed" not in source


def test_what_a_torchao_port_imports_is_at_the_top_level():
    # issue 23 item 18: porting from torchao.float8 should need only the imports changed
    import f8dist
    from f8dist.fsdp import precompute_float8_dynamic_scale_for_fsdp

    assert f8dist.precompute_float8_dynamic_scale_for_fsdp is precompute_float8_dynamic_scale_for_fsdp
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject  # one place: f8dist.__version__
    assert 'version = { attr = "f8dist.__version__" }' in pyproject
    assert f8dist.__version__.count(".") == 2
