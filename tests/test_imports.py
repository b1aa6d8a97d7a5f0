"""The package's import graph: no cycles (also through function-level imports), and the pure
modules stay pure."""

import ast
import re
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


# [Note: layers]
# f8dist/ is laid out in layers, lowest first; a module imports its own layer and those below,
# never one above (docs/design.md, "Layout"). Tools (debug, testing, optim, models, integrations)
# sit on top and may import anything.
LAYERS = ("f8dist.config", "f8dist.core", "f8dist.policy", "f8dist.nn", "f8dist.parallel")
TOOLS = ("f8dist.debug", "f8dist.testing", "f8dist.optim", "f8dist.models", "f8dist.integrations")


def layer(module: str) -> int:
    """The layer of ``module``: its index in LAYERS, len(LAYERS) for a tool, None for the package
    itself and its private modules."""
    for i, top in enumerate(LAYERS + TOOLS):
        if module == top or module.startswith(top + "."):
            return min(i, len(LAYERS))
    return None


def upward_imports(graph):
    """[(module, what it imports from a layer above its own)]."""
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if layer(m) is not None and layer(d) is not None and layer(d) > layer(m))


def test_every_module_has_a_layer():
    graph = import_graph()
    loose = [m for m in graph if layer(m) is None and m not in ("f8dist", "f8dist._moved")]
    assert not loose, f"modules outside the layers {LAYERS + TOOLS}: {loose}"


def test_no_import_points_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"f8dist.core.cast": {"f8dist.nn.linear", "f8dist.config"}, "f8dist.nn.linear": {"f8dist.core.cast"}}
    assert upward_imports(graph) == [("f8dist.core.cast", "f8dist.nn.linear")]


def test_scale_math_and_the_config_import_no_distributed_code():
    # scale math is pure; the config, the float8 gemm and scale math need no distributed module
    graph = import_graph()
    pure = {m for m in graph if layer(m) == 0} | {"f8dist.core.scaling"}
    for name in (*sorted(pure), "f8dist.core.gemm"):
        assert graph[name] <= pure, (name, graph[name])
    for name in pure:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = PACKAGE.parent / name.replace(".", "/") / "__init__.py"
        assert "torch.distributed" not in path.read_text(), name


def test_old_module_paths_import_the_moved_modules_with_a_warning():
    import importlib
    import sys
    import warnings

    import f8dist.core.tensor
    from f8dist import _moved

    for old in ("f8dist.tensor", "f8dist.fsdp.weight", "f8dist.tp", "f8dist.dispatch"):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(_moved.new_name(old)), old
        assert any(issubclass(w.category, DeprecationWarning) and _moved.new_name(old) in str(w.message)
                   for w in caught), old
    assert sys.modules["f8dist.tensor"].Float8Tensor is f8dist.core.tensor.Float8Tensor


def test_the_rank_agreement_check_imports_only_the_config_and_the_placement_rule():
    # f8dist.core.agreement is imported by the modules, styles and hooks it checks: it imports none of
    # them (the converted module types register themselves in agreement.CONVERTIBLE)
    assert import_graph()["f8dist.core.agreement"] <= {"f8dist.config", "f8dist.core.placement"}
    import f8dist.core.agreement
    from f8dist.nn.grouped import GroupedExperts

    assert GroupedExperts in f8dist.core.agreement.CONVERTIBLE


def test_what_a_torchao_port_imports_is_at_the_top_level():
    # issue 23 item 18: porting from torchao.float8 should need only the imports changed
    import f8dist
    from f8dist.parallel.fsdp import precompute_float8_dynamic_scale_for_fsdp

    assert f8dist.precompute_float8_dynamic_scale_for_fsdp is precompute_float8_dynamic_scale_for_fsdp
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject  # one place: f8dist.__version__
    assert 'version = { attr = "f8dist.__version__" }' in pyproject
    assert f8dist.__version__.count(".") == 2


def _torch_range():
    """pyproject.toml's torch requirement as ((lower), (upper, exclusive)) version tuples."""
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    found = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', pyproject)
    assert found, "pyproject.toml's torch requirement is not 'torch>=X.Y,<X.Z'"
    lo0, lo1, hi0, hi1 = map(int, found.groups())
    return (lo0, lo1), (hi0, hi1)


def _pinned_torch(path: str):
    """The (major, minor) of the ``torch==X.Y.Z`` that a CI file of the repo installs."""
    found = re.search(r"torch==(\d+)\.(\d+)\.\d+", (PACKAGE.parent / path).read_text())
    assert found, f"{path} pins no torch"
    return int(found[1]), int(found[2])


def test_ci_proves_both_ends_of_the_torch_range():
    # the range admits the pinned CPU build CI runs the suite on and the newest release, which CI
    # runs a subset on (.ci/newest-torch); the upper bound is the release after that newest, so
    # pip never plans to replace a supported torch, nor admits one CI has not run
    (lo, hi), pinned, newest = _torch_range(), _pinned_torch(".ci/run"), \
        _pinned_torch(".ci/torch-newest.txt")
    assert lo <= pinned < hi and lo <= newest < hi, (lo, hi, pinned, newest)
    assert hi == (newest[0], newest[1] + 1), (hi, newest)
    run = (PACKAGE.parent / ".ci" / "run").read_text()
    assert "bash .ci/newest-torch" in run.split("python -m pytest -q tests")[-1]  # after the suite
    readme = (PACKAGE.parent / "README.md").read_text()
    assert f"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}" in readme


def test_only_the_tensor_reads_its_inner_fields():
    # [Note: one scale layout] in f8dist/core/tensor.py: the float8 bytes and scale grid of a
    # Float8Tensor are read by its own op table, which hands them to the gemm; everything else
    # goes through float8_layout / float8_values() / the ops
    readers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if re.search(r"\._(data|scale)\b", path.read_text()))
    assert readers == ["core/tensor.py"], readers
