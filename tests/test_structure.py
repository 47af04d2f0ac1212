"""The tree keeps the layers docs/architecture.md draws: no import cycle (function-level imports
included), nothing imports a layer above its own, the schedule layer imports no torch, no module
over 600 lines nor using another module's underscore names (a module cut by size rather than by
concern: see PRIVATE_NAMES_SHARED), and the architecture page names every module.

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


# -- a module cut by size rather than by concern -------------------------------------------------
# A module split only to fit MAX_LINES leaves halves that still share their internals, so one reaches
# into the other's underscore names. No pipecore module does: it uses no underscore name of another
# module (imported from it, or read off an imported module or class), and imports an underscore
# module (`builders/_codes.py`, `compat/_fallback.py`) only from inside that module's package.
# Names of the form __name__ (`__version__`) are not private. The one exception, and why:
PRIVATE_NAMES_SHARED = {
    # the C++ extension's underscore names are its hooks for the build check and the tests
    # (`C._self_check`), held by the extension module itself: there is no Python module to hold them
    "pipecore._C": "the extension's hooks for the build check and the tests",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _extension(module: str) -> bool:
    return module == "pipecore._C" or module.startswith("pipecore._C.")


def _private_module_outside(module: str, importer: str) -> bool:
    """Is `module` an underscore module (or inside one) whose package `importer` is not inside?"""
    parts = module.split(".")
    return any(_private(part) and not _inside(importer, ".".join(parts[:i])) for i, part in enumerate(parts))


def _reaches_into(name: str, source: str, is_package: bool = False) -> list[str]:
    """Where module `name` uses another pipecore module's private names, as 'line N: what'."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    bound: dict[str, tuple[str, str | None]] = {}  # local name -> (module, None) or (module, a name in it)
    found = []

    def private_use(line: int, module: str, attr: str | None, shown: str | None = None) -> None:
        """`attr` (None: the module itself) of `module`, used at `line`."""
        if module == name or any(module == m or module.startswith(m + ".") for m in PRIVATE_NAMES_SHARED):
            return
        if _private_module_outside(module, name):
            found.append(f"line {line}: {module} (a private module of another package)")
        elif attr is not None and _private(attr):
            found.append(f"line {line}: {shown or attr} of {module}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pipecore"):
                    private_use(node.lineno, a.name, None)
                    bound[a.asname or "pipecore"] = (a.name if a.asname else "pipecore", None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if not base.startswith("pipecore"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES or _extension(full):
                    private_use(node.lineno, full, None)
                    bound[a.asname or a.name] = (full, None)
                else:
                    private_use(node.lineno, base, a.name)
                    bound[a.asname or a.name] = (base, a.name)

    def resolve(node: ast.AST) -> tuple[str, str | None] | None:
        """What an expression names: (module, None), (module, a name in it), or None (not known)."""
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = resolve(node.value)
            if owner is not None and owner[1] is None:  # an attribute of a module: a submodule or a name
                full = f"{owner[0]}.{node.attr}"
                return (full, None) if full in MODULES or _extension(full) else (owner[0], node.attr)
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = resolve(node.value)
            if owner is None:  # self._x, or an object's: not a module's name
                continue
            module, held = owner
            if held is None:  # a name (or submodule) of a module
                private_use(node.lineno, *resolve(node))
            else:  # an attribute of a class (or function) imported from a module
                private_use(node.lineno, module, node.attr, f"{held}.{node.attr}")
    return found


@pytest.mark.parametrize("importer, source, expected", [
    ("pipecore.schedule.builders.auto", "from pipecore.schedule.builders.v_rounds import _Stuck", 1),
    ("pipecore.schedule.builders.auto", "from pipecore.schedule.builders.v_rounds import Stuck", 0),
    ("pipecore.schedule.builders.gpipe", "from pipecore.schedule.builders._codes import code", 0),
    ("pipecore.runtime.step", "from pipecore.schedule.builders._codes import code", 1),
    ("pipecore.runtime.step", "import pipecore.schedule.builders._codes as codes", 1),
    ("pipecore.runtime.step", "from pipecore.schedule import Schedule\nSchedule._from_codes([], None)", 1),
    ("pipecore.runtime.step", "from pipecore.stage import boundary as wire\nwire._viewless(x)", 1),
    ("pipecore.runtime.step", "import pipecore.stage.boundary\npipecore.stage.boundary._viewless(x)", 1),
    ("pipecore.runtime.step", "from pipecore.version import __version__", 0),
    ("pipecore.runtime.step", "def f(self):\n    return self._rows, other._x", 0),
    ("pipecore.tools.build_check", "import pipecore._C as C\nC._self_check(7)", 0),
])
def test_what_reaches_into_privates(importer, source, expected):
    assert len(_reaches_into(importer, source, importer in PACKAGES)) == expected


def test_no_module_reaches_into_another_modules_privates():
    found = {name: _reaches_into(name, open(path).read(), name in PACKAGES) for name, path in MODULES.items()}
    found = {name: uses for name, uses in found.items() if uses}
    assert not found, ("modules that use another module's private names (make the name public where it is that "
                       "module's API, or move the code to the module whose concern it is):\n  " +
                       "\n  ".join(f"{name}: {'; '.join(uses)}" for name, uses in sorted(found.items())))


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


MAX_CSRC_LINES = 500  # C++ is denser than Python: a file past this holds more than one concern


@pytest.mark.parametrize("rel", CSRC_FILES)
def test_csrc_file_size(rel):
    lines = sum(1 for _ in open(os.path.join(CSRC, rel)))
    assert lines <= MAX_CSRC_LINES, f"csrc/{rel} has {lines} lines (at most {MAX_CSRC_LINES}: split it by concern)"


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
    defines = re.compile(r"^[^/\n]*\bExecutor::~?\w+\(", re.M)  # a member's definition, not a comment
    offenders = [rel for rel in CSRC_FILES if "executor.h" in _csrc_includes(rel) and
                 not defines.search(open(os.path.join(CSRC, rel)).read()) and rel != "bindings.cpp"]
    assert not offenders, f"{offenders} include executor.h without using the executor (errors.h has the error types)"


# The executor's files that interpret the program: they ask their MessagePath (message_path.h) and never
# which path it is, nor reach the state a path owns. executor.cpp (settings) makes the path: the factory's
# caller.
INTERPRETER = ["executor.h", "run.cpp", "dispatch.cpp", "compute.cpp", "discovery.cpp", "executor_overlap.cpp",
               "tracing.cpp"]
PATH_KIND = re.compile(r"\b(DeviceComm|device_comm_|make_device_comm|make_host_device_comm|make_host_path|"
                       r"make_device_path|HostPath|DevicePath|on_device|host_reads|exact)\b")
PATH_STATE = re.compile(r"\b(window_|sends_|worker_|posted_through_|unread_from_?|follow_ups_\w+|group_backend_|"
                        r"recv_scratch_|send_scratch_|shaped_|counts_|settle_mu_|last_send_posted_)\b")
PATH_HEADERS = {"device_comm.h", "comm_worker.h", "send_tracker.h", "recv_window.h", "comm_task.h", "device_ops.h"}


def _code(rel: str) -> str:
    """The file without its comments (a comment may name what the code must not)."""
    text = open(os.path.join(CSRC, rel)).read()
    return re.sub(r"//[^\n]*", "", text)


@pytest.mark.parametrize("rel", INTERPRETER)
def test_the_interpreter_never_asks_which_message_path(rel):
    code = _code(rel)
    assert not PATH_KIND.findall(code), f"csrc/{rel} branches on the message path's kind: {PATH_KIND.findall(code)}"
    assert not PATH_STATE.findall(code), f"csrc/{rel} reaches a message path's state: {PATH_STATE.findall(code)}"
    assert not _csrc_includes(rel) & PATH_HEADERS, f"csrc/{rel} includes {_csrc_includes(rel) & PATH_HEADERS}"


def test_only_the_factory_chooses_a_message_path():
    """make_message_path decides; besides it only executor.cpp's test-build emulation of the device path on
    the CPU model makes a path (the files that declare or define the makers aside)."""
    chooses = re.compile(r"\b(make_device_comm|make_host_path|make_device_path)\(")
    makers = {"message_path.h", "device_comm.h", "host_path.cpp", "device_path.cpp", "device_comm.cpp"}
    callers = sorted(rel for rel in CSRC_FILES if rel not in makers and chooses.search(_code(rel)))
    assert callers == ["executor.cpp", "message_path.cpp"], callers
    settings = _code("executor.cpp")
    testing = re.findall(r"#ifdef PIPECORE_TESTING(.*?)#endif", settings, re.S)
    outside = re.sub(r"#ifdef PIPECORE_TESTING.*?#endif", "", settings, flags=re.S)
    assert not chooses.search(outside) and any(chooses.search(block) for block in testing)


def test_the_architecture_page_names_every_csrc_file():
    page = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    def named(rel: str) -> bool:  # as `comm.cpp`, or with its header as `comm.{h,cpp}`
        stem, ext = os.path.splitext(os.path.basename(rel))
        return bool(re.search(rf"(?<![\w.]){re.escape(stem + ext)}", page) or
                    re.search(rf"(?<![\w.]){re.escape(stem)}\.\{{[^}}]*\b{ext[1:]}\b[^}}]*\}}", page))

    missing = [rel for rel in CSRC_FILES if not named(rel)]
    assert not missing, f"docs/architecture.md does not name csrc/{missing}"
