"""The package's modules import each other without cycles, and only at the top of a module (a
function-level import is how a cycle hides). Read off the sources with ``ast``."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules():
    """{module name: path} of flash_inductor and of its passes (installed as flash_inductor.passes)."""
    mods = {}
    for folder, prefix in ((ROOT / "flash_inductor", "flash_inductor"), (ROOT / "passes", "flash_inductor.passes")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((prefix, *parts)).removesuffix(".__init__")
            mods[name] = path
    return mods


def _imports(name, path, mods):
    """(imported module, whether the import is inside a function or class) for each import of ours."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            candidates = [f"{base}.{a.name}" for a in node.names]
            targets = [c for c in candidates if c in mods] or [base]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.col_offset > 0


def test_no_import_cycles_and_no_function_level_imports():
    mods = _modules()
    graph = {name: set() for name in mods}
    nested = []
    for name, path in mods.items():
        for target, inside in _imports(name, path, mods):
            graph[name].add(target)
            if inside:
                nested.append(f"{name} -> {target}")
    assert not nested, nested
    # Depth-first search for a back edge.
    state, cycle = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle.extend(trail[trail.index(nxt):] + [node, nxt] if nxt in trail else [node, nxt])
                return True
            if nxt not in state and visit(nxt, trail + [node]):
                return True
        state[node] = "done"
        return False

    assert not any(visit(name, []) for name in sorted(mods) if name not in state), cycle
    assert len(mods) > 30  # the walk really found the package
