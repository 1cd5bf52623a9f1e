"""The package's shape, read from its source with ``ast`` (nothing under ``megatron_dapo`` is imported).

* ``docs/architecture.md``'s package table names every package and top-level module, and nothing else;
* the module-level imports of ``megatron_dapo`` form no cycle (``if TYPE_CHECKING:`` blocks left out);
* an import inside a function says why it is not at the top of its module: ``# heavy: <why>`` (importing it at the
  top would pull megatron-core, vLLM, transformers, torch into processes that do not need them, e.g.
  ``megatron-dapo --help``) or ``# optional: <why>`` (it may be absent: torch_npu, MindSpeed, TransformerEngine,
  Ray, wandb...), as a trailing comment on the statement, or on the comment lines right above it or above the run
  of import statements it belongs to. The reason is written where the import is, not kept in a list here, so there
  is no allowlist of modules. Standard-library imports are exempt (never heavy or optional: put them at the top);
* no function is longer than 80 lines and no class longer than 300 (``end_lineno - lineno + 1``: from ``def`` or
  ``class`` to the last line, docstring included, decorators not);
* outside ``platform/``, no code compares a device's type (``t.device.type``, a platform's ``device_type``) with a
  device name (``== "cpu"``) to choose behaviour: it asks the platform (``docs/architecture.md``, "Seams"). The few
  that ask where a tensor's bytes are (host memory or not), a fact of the data, are listed with their reason.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_dapo"
DOC = ROOT / "docs" / "architecture.md"

MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300
# The comment an in-function import carries: why it is deferred.
REASON = re.compile(r"#\s*(heavy|optional):\s*\S")


# ----- the tree


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__.py``)."""
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


# ----- 1. the package table


def test_architecture_table_lists_the_tree():
    """Every row's first cell names packages (``x/``) or top-level modules (``x.py``) in backticks."""
    text = DOC.read_text(encoding="utf-8")
    header = re.search(r"^\|\s*package\s*\|.*\|\s*$", text, re.M)
    assert header, f"{rel(DOC)}: no table with a 'package' column"
    listed: dict[str, int] = {}
    lines = text[header.start() :].splitlines()
    for offset, line in enumerate(lines[2:], start=2):  # skip the header and its |---| rule
        if not line.startswith("|"):
            break
        lineno = text[: header.start()].count("\n") + offset + 1
        first_cell = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first_cell):
            assert name not in listed, f"{rel(DOC)}:{lineno}: {name} listed twice (also line {listed[name]})"
            listed[name] = lineno

    tree = set()
    for path in PKG.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            tree.add(f"{path.name}/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            tree.add(path.name)
    missing = sorted(tree - set(listed))
    stale = sorted(f"{name} (line {listed[name]})" for name in set(listed) - tree)
    assert not missing and not stale, (
        f"{rel(DOC)}'s package table is out of step with megatron_dapo/: not listed: {missing}; listed but not in"
        f" the tree: {stale}"
    )


# ----- 2. import cycles


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute name a ``from ... import`` reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package(module) else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _top_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: module body, ``if``/``try``/``with`` blocks at module level, not
    ``if TYPE_CHECKING:``, not functions or classes."""

    def walk(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                yield stmt
            elif isinstance(stmt, ast.If):
                test = ast.unparse(stmt.test)
                if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    yield from walk(stmt.body)
                yield from walk(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                    yield from walk(block)
            elif isinstance(stmt, ast.With):
                yield from walk(stmt.body)

    yield from walk(tree.body)


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported megatron_dapo module: line}. Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so they
    are edges too, except the importer's own parent packages (already running when it is imported) — unless a name
    is read from one of them (``from megatron_dapo.config import X`` in ``config/plan.py``)."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        own = _ancestors(name)
        edges: dict[str, int] = {}
        for node in _top_level_imports(parse(path)):
            targets: list[tuple[str, bool]] = []  # (module, whether a name is read from it)
            if isinstance(node, ast.Import):
                targets += [(alias.name, False) for alias in node.names]
            else:
                source = _resolve_from(name, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    # a submodule: the package itself is only passed through on the way
                    targets += [(sub, False), (source, False)] if sub in mods else [(source, True)]
            for target, read_from in targets:
                for prefix in sorted(_ancestors(target) | {target}):
                    if prefix in mods and prefix != name and (prefix not in own or (read_from and prefix == target)):
                        edges.setdefault(prefix, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component (Tarjan), as a closed path ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, {}):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in components:
        members = set(component)
        start = min(component)
        # shortest path back to start inside the component (breadth-first)
        parent: dict[str, str] = {}
        frontier = [start]
        seen = {start}
        end = None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        end = v
                        break
                    if w in members and w not in seen:
                        seen.add(w)
                        parent[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [start]
        v = end
        while v != start:
            path.insert(1, v)
            v = parent[v]
        cycles.append(path + [start])
    return cycles


def test_no_import_cycles():
    graph = import_graph()
    mods = modules()
    reports = []
    for cycle in find_cycles(graph):
        steps = [f"{rel(mods[a])}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
        reports.append(" -> ".join(cycle) + "\n      " + "\n      ".join(steps))
    assert not reports, "import cycles among module-level imports:\n  " + "\n  ".join(reports)


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


# ----- 3. imports inside functions


def _comments(source: str) -> dict[int, str]:
    """line -> the comment on it."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string
    return found


def _is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names


def _deferred_imports(tree: ast.Module) -> dict[int, tuple[ast.Import | ast.ImportFrom, int]]:
    """line -> (import inside a function, first line of the run of import statements it belongs to)."""
    found = {}
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):  # an import in a nested function is seen from each enclosing one: keyed by line
            for field in ("body", "orelse", "finalbody"):
                block_start = None
                body = getattr(node, field, None)
                for stmt in body if isinstance(body, list) else []:  # not a lambda's or an ``x if c else y``'s
                    if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        block_start = None
                        continue
                    block_start = block_start or stmt.lineno
                    found[stmt.lineno] = (stmt, block_start)
    return found


def unexplained_imports(name: str, source: str) -> list[int]:
    """Lines of the imports inside functions of module ``name`` (megatron_dapo or third-party ones) with no
    ``# heavy:``/``# optional:`` reason: neither a trailing comment on the statement nor a comment right above it or
    above the run of imports it is in."""
    comments = _comments(source)
    lines = source.splitlines()
    found = []
    for _, (node, block_start) in sorted(_deferred_imports(ast.parse(source)).items()):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            targets = [_resolve_from(name, node)]
        if all(_is_stdlib(t) for t in targets):
            continue
        said = [comments.get(line, "") for line in range(node.lineno, node.end_lineno + 1)]
        for first in {node.lineno, block_start}:
            line = first - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                said.append(comments.get(line, ""))
                line -= 1
        if not any(REASON.search(c) for c in said):
            found.append(node.lineno)
    return found


def test_deferred_imports_say_why():
    offenders = []
    for name, path in modules().items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        offenders += [f"{rel(path)}:{n}: {lines[n - 1].strip()}" for n in unexplained_imports(name, source)]
    assert not offenders, (
        "imports inside functions belong at the top of the module unless heavy or optional; say which with"
        " '# heavy: <why>' or '# optional: <why>' on the import or the line above it:\n  " + "\n  ".join(offenders)
    )


def test_deferred_import_rule_reads_comments_where_they_are():
    source = """
def f():
    import json
    import torch  # heavy: torch
    # optional: the [logging] extra
    import wandb
    from megatron_dapo import cli

    x = 1
    import vllm
    x += 1
    # heavy: megatron-core
    from megatron.core import parallel_state

    from megatron_dapo.config import load_config
    return x
"""
    # json: stdlib; torch: trailing; wandb: the line above; cli (7): its run starts at json, with nothing above;
    # vllm (10): nothing; megatron.core and config: the comment above their run (blank lines do not end a run)
    assert unexplained_imports("megatron_dapo.example", source) == [7, 10]


# ----- 4. sizes


def oversized() -> list[str]:
    offenders = []
    for path in modules().values():
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind, limit = "function", MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                kind, limit = "class", MAX_CLASS_LINES
            else:
                continue
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                offenders.append(f"{rel(path)}:{node.lineno}: {kind} {node.name} is {length} lines (limit {limit})")
    return offenders


def test_functions_and_classes_are_short():
    offenders = oversized()
    assert not offenders, "too long:\n  " + "\n  ".join(offenders)


# ----- 5. device types outside platform/

# file -> how many ``<x>.device.type``/``device.type`` comparisons with a device name it may hold, and why. Each asks
# where a tensor's bytes are, not which platform runs; a choice of behaviour by device asks the platform instead
# (e.g. ``Platform.prefers_fused_reductions``).
DEVICE_TYPE_TESTS_ALLOWED = {
    "megatron_dapo/weights/safetensors_io.py": 1,  # a tensor not in host memory is copied there to be written
    "megatron_dapo/weights/dist_writer.py": 2,  # host tensors get exact-storage aliases; device ones are staged
    "megatron_dapo/testing/standin_engine.py": 1,  # test tooling: the modelled device's capacity, none for the host
}


def _is_device_type(node: ast.expr) -> bool:
    """``<x>.device.type``, ``device.type`` or a platform's ``<x>.device_type``."""
    if isinstance(node, ast.Attribute) and node.attr == "device_type":
        return True
    if not (isinstance(node, ast.Attribute) and node.attr == "type"):
        return False
    value = node.value
    return (isinstance(value, ast.Attribute) and value.attr == "device") or (
        isinstance(value, ast.Name) and value.id == "device"
    )


def _is_device_name(node: ast.expr) -> bool:
    """A string literal, or a tuple/list/set of them (``in ("cpu", "meta")``)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_device_name(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def device_type_tests(source: str) -> list[int]:
    """Lines of the comparisons of a device's type with a device name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_device_type(o) for o in operands) and any(_is_device_name(o) for o in operands):
                found.append(node.lineno)
    return sorted(found)


def test_device_types_are_asked_of_the_platform():
    over, stale = [], []
    for path in modules().values():
        if path.is_relative_to(PKG / "platform"):
            continue
        lines = device_type_tests(path.read_text(encoding="utf-8"))
        allowed = DEVICE_TYPE_TESTS_ALLOWED.get(rel(path), 0)
        if len(lines) > allowed:
            over.append(f"{rel(path)}: lines {lines} ({allowed} allowed)")
        elif allowed and not lines:
            stale.append(rel(path))
    assert not over, (
        "a device's type compared with a device name outside platform/: ask the platform (a Platform method, see"
        " docs/architecture.md 'Seams'), or, if it asks where a tensor's bytes are, list it in"
        " DEVICE_TYPE_TESTS_ALLOWED with why:\n  " + "\n  ".join(over)
    )
    assert not stale, f"DEVICE_TYPE_TESTS_ALLOWED lists files without such a comparison now: {stale}"


def test_device_type_rule_finds_the_comparisons():
    source = """
def f(t, device, platform):
    if t.device.type == "cpu":
        pass
    on_host = device.type != 'cpu'
    kind = t.device.type in ("cpu", "meta")
    same = t.device.type == platform.device_type
    accelerator = platform.device_type != "cpu"
    return torch.get_device_module(device.type), t.device.type
"""
    # lines 3, 5, 6, 8: against names; line 7 compares with the platform's own type (asking it); line 9 compares
    # nothing
    assert device_type_tests(source) == [3, 5, 6, 8]


# ----- 6. names and folders

MAX_MODULES_PER_FOLDER = 12


def test_no_module_stem_repeats_across_folders():
    """A module's name says which layer it is in: two modules of one stem in different folders (``scoring.py`` in
    ``reward/`` and in ``training/``) make a reader open the wrong one."""
    folders: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        if path.name != "__init__.py":
            folders.setdefault(path.stem, []).append(rel(path.parent))
    repeated = {stem: where for stem, where in folders.items() if len(where) > 1}
    assert not repeated, f"module stems in more than one folder: {repeated}"


def test_no_folder_holds_more_than_a_dozen_modules():
    """A folder is one seam: past a dozen modules it holds several, and is split along them."""
    counts = {rel(d): sum(1 for p in d.glob("*.py") if p.name != "__init__.py") for d in [PKG, *PKG.rglob("*/")]}
    counts = {d: n for d, n in counts.items() if "__pycache__" not in d}
    crowded = {d: n for d, n in counts.items() if n > MAX_MODULES_PER_FOLDER and d != rel(PKG)}
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"


# The functions that assemble a run from the whole config (config/, the trainer and the rollout worker's start); every
# other component is built from its own sections and the RunPlan.
ASSEMBLERS = {
    "config/rules.py": {"config_problems"},
    "config/plan.py": {"plan_problems", "resolve", "build_plan"},
    "config/memory.py": {"memory_model"},
    "training/startup.py": {"start_run"},
    "training/trainer.py": {"run_training", "__init__"},
    "training/rollout_worker.py": {"__init__"},
}


def test_only_the_assemblers_take_the_whole_config():
    """A parameter annotated ``ExperimentConfig`` outside the assemblers above is a component reaching past its own
    config section (torchtitan builds each component from its section)."""
    found = set()
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.annotation is not None and "ExperimentConfig" in ast.unparse(a.annotation) for a in args):
                    found.add((rel(path).removeprefix("megatron_dapo/"), node.name))
    allowed = {(path, name) for path, names in ASSEMBLERS.items() for name in names}
    assert found - allowed == set(), f"components taking the whole ExperimentConfig: {sorted(found - allowed)}"
    assert len(found) < 10, sorted(found)
