"""The tree keeps the layers docs/architecture.md draws: no import cycle (function-level imports
included), nothing imports a layer above its own, the schedule layer imports no torch, no module
over 600 lines, and the architecture page names every module."""

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


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: str) -> set[str]:
    """The pipecore modules `name` imports anywhere in its body (inside functions too; not under
    `if TYPE_CHECKING:`)."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
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
        else:
            continue
        for t in targets:
            if t.startswith("pipecore._C"):
                continue  # the extension: below every Python module, it imports none of them
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("pipecore"):
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


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


# --- the extension's sources (csrc/): the same rules for C++

CSRC = os.path.join(ROOT, "csrc")
CSRC_FILES = sorted(os.path.relpath(os.path.join(d, f), CSRC) for d, _, files in os.walk(CSRC) for f in files
                    if f.endswith((".h", ".cpp", ".cu")))
_INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)


def _csrc_includes(rel: str) -> set[str]:
    """The csrc files `rel` includes (by path relative to csrc/)."""
    here = os.path.dirname(rel)
    found = set()
    for name in _INCLUDE.findall(open(os.path.join(CSRC, rel)).read()):
        target = os.path.normpath(os.path.join(here, name))
        if target in CSRC_FILES:
            found.add(target)
    return found


@pytest.mark.parametrize("rel", CSRC_FILES)
def test_csrc_file_size(rel):
    lines = sum(1 for _ in open(os.path.join(CSRC, rel)))
    assert lines <= MAX_LINES, f"csrc/{rel} has {lines} lines (at most {MAX_LINES}: split it by concern)"


def test_no_csrc_include_cycle():
    graph = {rel: _csrc_includes(rel) for rel in CSRC_FILES}
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                pytest.fail("include cycle: " + " -> ".join(stack[stack.index(m):] + [n, m]))
            if m not in state:
                visit(m, stack + [n])
        state[n] = 2

    for n in CSRC_FILES:
        if n not in state:
            visit(n, [])


def test_only_the_executor_and_its_bindings_include_executor_h():
    """The error types live in errors.h: a file that includes executor.h defines the executor's members or
    binds it (an include for CommError made the framing layer depend on the executor that depends on it)."""
    offenders = [rel for rel in CSRC_FILES if "executor.h" in _csrc_includes(rel) and
                 "Executor::" not in open(os.path.join(CSRC, rel)).read() and rel != "bindings.cpp"]
    assert not offenders, f"{offenders} include executor.h without using the executor (errors.h has the error types)"


def test_the_architecture_page_names_every_csrc_file():
    page = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    def named(rel: str) -> bool:  # as `comm.cpp`, or with its header as `comm.{h,cpp}`
        stem, ext = os.path.splitext(os.path.basename(rel))
        return bool(re.search(rf"(?<![\w.]){re.escape(stem + ext)}", page) or
                    re.search(rf"(?<![\w.]){re.escape(stem)}\.\{{[^}}]*\b{ext[1:]}\b[^}}]*\}}", page))

    missing = [rel for rel in CSRC_FILES if not named(rel)]
    assert not missing, f"docs/architecture.md does not name csrc/{missing}"
