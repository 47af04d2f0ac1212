"""The tree keeps the layers docs/architecture.md draws: no import cycle (function-level imports
included), nothing imports a layer above its own, the schedule layer imports no torch, no module
over 600 lines, and the architecture page names every module.

What a module depends on, as Python runs its imports:
- every module an import names (`import pipecore.a.b`, `from pipecore.a.b import x`, and the
  submodule in `from pipecore.a import b`);
- the `__init__` of every package above that module that the importer is not inside: importing
  `pipecore.stage.hf` from pipecore/training/ first runs pipecore/stage/__init__.py (and all it
  imports). From inside a package its `__init__` has already begun (it is what imports the module,
  or it ran first), so `import pipecore.stage.hf` in pipecore/stage/partitioning.py adds no edge;
- the package's `__init__` for `from <package> import name`, from inside that package too: the name
  is looked up in the namespace the `__init__` builds (a name it defines wins over a submodule of
  that name), so `from pipecore.stage import hf` in pipecore/stage/ depends on pipecore/stage's
  `__init__`. A module reaches a sibling by its full name instead.
A lazy import (inside a function) is an import: a cycle it closes is a cycle."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "pipecore")
# bottom to top: a module may import its own layer and those below it
LAYERS = ["errors", "version", "schedule", "stage", "executor", "training", "runtime", "compat", "tools"]
MAX_LINES = 600


def _modules() -> dict[str, str]:
    """dotted name -> path, for every module of pipecore/."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


MODULES = _modules()
PACKAGES = {n for n, path in MODULES.items() if path.endswith("__init__.py")}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, source: str, is_package: bool = False) -> set[str]:
    """The pipecore modules `name` (whose text is `source`) depends on through imports anywhere in
    its body (inside functions too; not under `if TYPE_CHECKING:`), by the rule above."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node):
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # a name that is a module imports that module; any other name, the module it comes from
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES or a.name == "_C" else base
                       for a in node.names]
            if base in PACKAGES:
                targets.append(base)  # the names are looked up in what the package's __init__ built
        else:
            continue
        for t in targets:
            if t.startswith("pipecore._C"):
                continue  # the extension: below every Python module, it imports none of them
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if not t.startswith("pipecore"):
                continue
            out.add(t)
            out.update(p for p in _packages_above(t) if not _inside(name, p))  # their __init__ runs first
    out.discard(name)
    return out


def _packages_above(name: str) -> list[str]:
    """The packages whose `__init__` runs before `name` is imported (the front door aside: every
    module is inside it)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


GRAPH = {name: _imports(name, open(path).read(), name in PACKAGES) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    """The package itself (its front door re-exports every layer) and `python -m pipecore` sit on
    top: no module may import them."""
    parts = name.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return len(LAYERS)
    return LAYERS.index(parts[1])


def test_every_module_belongs_to_a_layer():
    unknown = [n for n in MODULES if len(n.split(".")) > 1 and n.split(".")[1] not in LAYERS + ["__main__"]]
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown} (add the layer here and to docs/architecture.md)"


@pytest.mark.parametrize("importer, source, expected", [
    # another package's module: that package's __init__ runs first
    ("pipecore.training.ties", "from pipecore.stage.boundary import as_call",
     {"pipecore.stage.boundary", "pipecore.stage"}),
    ("pipecore.training.ties", "import pipecore.schedule.builders.auto",
     {"pipecore.schedule.builders.auto", "pipecore.schedule.builders", "pipecore.schedule"}),
    # a sibling by its full name: the package's __init__ is already running
    ("pipecore.stage.partitioning", "import pipecore.stage.hf", {"pipecore.stage.hf"}),
    ("pipecore.stage.partitioning", "from pipecore.stage.boundary import as_call", {"pipecore.stage.boundary"}),
    # a name asked of a package, its own included, is looked up in what its __init__ built
    ("pipecore.stage.partitioning", "def f():\n    from pipecore.stage import hf",
     {"pipecore.stage.hf", "pipecore.stage"}),
    ("pipecore.stage.partitioning", "from . import hf", {"pipecore.stage.hf", "pipecore.stage"}),
    ("pipecore.schedule.builders.auto", "from pipecore.schedule import Kind", {"pipecore.schedule"}),
    # a package's __init__ importing its own modules is no edge to itself
    ("pipecore.stage", "from pipecore.stage.pipeline_stage import PipelineStage", {"pipecore.stage.pipeline_stage"}),
])
def test_what_an_import_depends_on(importer, source, expected):
    assert _imports(importer, source, importer in PACKAGES) == expected


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(GRAPH):
        if n not in state:
            visit(n)


def test_nothing_imports_a_layer_above_its_own():
    upward = []
    for name, targets in GRAPH.items():
        mine = _layer(name)
        upward += [f"{name} -> {t}" for t in sorted(targets) if _layer(t) > mine]
    assert not upward, "imports of a higher layer:\n  " + "\n  ".join(upward)


def test_the_schedule_layer_imports_no_torch():
    offenders = []
    for name, path in MODULES.items():
        if name.startswith("pipecore.schedule"):
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    offenders += [f"{name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, offenders


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = sum(1 for _ in open(MODULES[name]))
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_LINES}: split it by concern)"


def test_the_architecture_page_names_every_module():
    page = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    missing = []
    for name, path in MODULES.items():
        rel = os.path.relpath(path, PACKAGE)
        if os.path.basename(rel) == "__init__.py" or rel == "__main__.py":
            continue
        if not re.search(rf"(?<![\w./]){re.escape(os.path.basename(rel))}", page) and rel not in page:
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not name {missing}"
