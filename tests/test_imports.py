"""The package's import graph: no cycles, and the shared types on the ground floor.

Every ``import``/``from ... import`` of ``infir2_rl`` modules counts, at module level or inside a function (a
lazy import still couples the two modules), except those under ``if TYPE_CHECKING:``. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``). A package's ``__init__``
re-exporting its own submodules is not counted as the submodules depending on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import infir2_rl

PACKAGE_DIR = Path(infir2_rl.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in modules)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    if sub in modules:
                        found.add(sub)
                    elif child.module in modules:
                        found.add(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = _imports(path, modules) - {name}
        if path.name == "__init__.py":  # a package importing its own submodules is not a dependency cycle
            deps = {d for d in deps if not d.startswith(name + ".")}
        else:  # ... and neither is a submodule naming its parent package for a re-export
            deps = {d for d in deps if not name.startswith(d + ".")}
        graph[name] = deps
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := dfs(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycles() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = _graph()
    graph["infir2_rl.types"] = graph["infir2_rl.types"] | {"infir2_rl.stages.rl"}
    assert _find_cycle(graph) is not None


def test_the_shared_types_import_nothing_of_the_package() -> None:
    assert _graph()["infir2_rl.types"] == set()


def test_every_folder_is_a_package_with_a_docstring() -> None:
    for init in PACKAGE_DIR.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), (
            f"{init} has no docstring saying what lives there"
        )


def test_the_config_base_imports_nothing_of_the_package() -> None:
    # algo/ takes its AlgorithmConfig base from strict_model without importing config/.
    assert _graph()["infir2_rl.strict_model"] == set()
