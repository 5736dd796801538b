"""The import direction of docs/architecture.md, checked on the source: every import of the package
(module-level and inside functions; type-only imports under ``if TYPE_CHECKING:`` never run and are
left out) resolved to a module of ``tracegym``; no import cycle between modules, no import that
climbs to a higher layer, no module that no layer claims, and no use of the old paths kept for one
release."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tracegym"

# Low to high; a module may import its own layer and those below it. The first matching prefix wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contract", ("tracegym", "tracegym.types", "tracegym.files", "tracegym.cache", "tracegym.memory",
                  "tracegym.closing", "tracegym.plugins")),
    ("foundations", ("tracegym.config", "tracegym.models", "tracegym.algos", "tracegym.data", "tracegym.render")),
    ("training", ("tracegym.batch", "tracegym.train")),
    ("acting", ("tracegym.engines", "tracegym.envs", "tracegym.environments")),
    ("rollouts", ("tracegym.rollout", "tracegym.eval", "tracegym.trajectory_view")),
    ("rl", ("tracegym.rl",)),
    ("recipes", ("tracegym.recipes", "tracegym.serve")),
    ("interface", ("tracegym.commands", "tracegym.cli", "tracegym.__main__")),
]

# old import paths kept for one release: thin re-exports that warn; nothing inside the package uses them
DEPRECATED = ("tracegym.synthesis", "tracegym.rollout_tree", "tracegym.rollout_team", "tracegym.rollout_branches",
              "tracegym.executors")


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names[name] = path
    return names


def is_deprecated(name: str) -> bool:
    return any(name == d or name.startswith(d + ".") for d in DEPRECATED)


def layer_of(name: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # "tracegym" alone is the package's __init__, not a prefix of every module
            below = prefix != "tracegym" and name.startswith(prefix + ".")
            if (name == prefix or below) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


class _Imports(ast.NodeVisitor):
    """Every import statement of a module but those under ``if TYPE_CHECKING:``."""

    def __init__(self) -> None:
        self.found: list[ast.Import | ast.ImportFrom] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tracegym modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in visitor.found:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_import_graph_has_no_cycle(graph):
    assert cycles(graph) == []


def test_no_import_climbs_a_layer(graph):
    climbs = [f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for name, targets in sorted(graph.items()) if not is_deprecated(name)
              for target in sorted(targets)
              if layer_of(name) is not None and layer_of(target) is not None and layer_of(target) > layer_of(name)]
    assert climbs == []


def test_every_module_has_a_layer(graph):
    assert [name for name in sorted(graph) if not is_deprecated(name) and layer_of(name) is None] == []


def test_nothing_inside_the_package_uses_an_old_path(graph):
    users = [f"{name} imports {target}" for name, targets in sorted(graph.items()) if not is_deprecated(name)
             for target in sorted(targets) if is_deprecated(target)]
    assert users == []


def test_the_checker_sees_cycles_climbs_and_type_only_imports(tmp_path):
    """The checks above fail where they should (a test that cannot fail is a defect)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("tracegym.recipes.rl") > layer_of("tracegym.rl.collect") > layer_of("tracegym.rollout.runner")
    assert layer_of("tracegym.types") == 0 and layer_of("tracegym.nowhere") is None  # a new module needs a layer
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tracegym.cli import main\n"
                      "def f():\n    from tracegym.recipes import rl\n", encoding="utf-8")
    known = {"tracegym.cli": source, "tracegym.recipes": source, "tracegym.recipes.rl": source, "m": source}
    assert imports_of("m", source, known) == {"tracegym.recipes.rl"}


def test_the_documented_layers_are_the_checked_ones():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for layer, prefixes in LAYERS:
        assert f"**{layer}**" in text, layer
        for prefix in prefixes:
            if prefix != "tracegym":
                assert f"`{prefix.removeprefix('tracegym.')}" in text, prefix


# Inside ``tracegym.config`` (docs/architecture.md): ``_base`` <- ``shared`` <- one module per recipe
# (never importing each other) <- the package's ``__init__``, which re-exports every name.
CONFIG_RANK = {"tracegym.config._base": 0, "tracegym.config.shared": 1, "tracegym.config": 3}  # recipe modules: 2


def config_climbs(graph: dict[str, set[str]]) -> list[str]:
    """Imports between modules of ``tracegym.config`` that do not go down that order."""
    def inside(name: str) -> bool:
        return name == "tracegym.config" or name.startswith("tracegym.config.")

    def rank(name: str) -> int:
        return CONFIG_RANK.get(name, 2)

    return [f"{name} imports {target}" for name, targets in sorted(graph.items()) if inside(name)
            for target in sorted(targets) if inside(target) and rank(target) >= rank(name)]


def test_config_modules_import_only_those_below_them(graph):
    assert config_climbs(graph) == []
    assert layer_of("tracegym.config.rl") == layer_of("tracegym.config._base") == layer_of("tracegym.config") == 1
    fake = {"tracegym.config.shared": {"tracegym.config.rl"}, "tracegym.config.rl": {"tracegym.config.distill"},
            "tracegym.config.distill": {"tracegym.config.shared"}, "tracegym.config": {"tracegym.config.rl"}}
    assert config_climbs(fake) == ["tracegym.config.rl imports tracegym.config.distill",
                                   "tracegym.config.shared imports tracegym.config.rl"]


MAX_FUNCTION_LINES = 100


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions of the package longer than ``limit`` lines (def line to last line, decorators left out)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_over_100_lines(tmp_path):
    """Loops read like their docstrings (docs/architecture.md); a long function is split into named steps."""
    assert long_functions() == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n" + "    x = 1\n" * 100, encoding="utf-8")
    assert long_functions(tmp_path / "pkg") == ["pkg/m.py:1 f (101 lines)"]
