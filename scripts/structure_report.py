"""The shape of the code: import cycles of a package and a complexity table.

    python scripts/structure_report.py                 # pdproc/, complexity of the whole repo
    python scripts/structure_report.py --package pdproc --over 10 --json
    python scripts/structure_report.py --max-complexity 12   # the gate: exit 1 if any is over

Import graph: every `import` / `from ... import` of a module of the package, read with `ast`
(nothing is imported or run). Imports inside `if TYPE_CHECKING:` are edges of their own kind:
they are not cycles at run time, but they are cycles of the design, so the report gives the
strongly connected components twice, without them and with them. Imports inside functions
(deferred imports) count as run-time edges and are marked as deferred.

Complexity: McCabe's cyclomatic complexity per function, counted as ruff's C901 does (the
gate of `make lint`) and by radon itself (its library, as `radon cc` counts), every
function over `--over` by either count, and the largest per package (folder).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from radon.complexity import cc_visit_ast

REPO = Path(__file__).resolve().parents[1]
# Folders of the repository the complexity table covers (generated code left out).
CODE_DIRS = ("pdproc", "sim", "bench", "scripts", "deploy", "tests")
EXCLUDED = ("pdproc/_proto",)


@dataclass(frozen=True, slots=True)
class Edge:
    source: str
    target: str
    type_checking: bool
    deferred: bool


@dataclass
class Graph:
    modules: set[str] = field(default_factory=set)
    edges: list[Edge] = field(default_factory=list)

    def successors(self, *, with_type_checking: bool) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for edge in self.edges:
            if edge.type_checking and not with_type_checking:
                continue
            if edge.source != edge.target:
                out[edge.source].add(edge.target)
        return out


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(
    node: ast.AST, *, type_checking: bool = False, deferred: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement under `node`, with whether it sits under TYPE_CHECKING and
    whether it runs only when a function is called."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, type_checking, deferred
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _imports(
                    ast.Module(body=[stmt], type_ignores=[]), type_checking=True, deferred=deferred
                )
            for stmt in child.orelse:
                yield from _imports(
                    ast.Module(body=[stmt], type_ignores=[]),
                    type_checking=type_checking,
                    deferred=deferred,
                )
        else:
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            yield from _imports(child, type_checking=type_checking, deferred=inner)


def _resolve(
    stmt: ast.Import | ast.ImportFrom, current: str, is_package: bool, modules: set[str]
) -> Iterator[str]:
    """The package's modules an import statement loads (the most specific one known)."""
    if isinstance(stmt, ast.Import):
        candidates = [alias.name for alias in stmt.names]
    else:
        if stmt.level:
            base = current.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - (stmt.level - 1)]
            prefix = ".".join([*base, stmt.module] if stmt.module else base)
        else:
            prefix = stmt.module or ""
        # `from pdproc import stream` loads pdproc.stream; `from pdproc.x import name`, pdproc.x.
        candidates = [f"{prefix}.{alias.name}" for alias in stmt.names] + [prefix]
    for name in candidates:
        probe = name
        while probe and probe not in modules:
            probe = probe.rpartition(".")[0]
        if probe:
            yield probe


def import_graph(root: Path, package: str) -> Graph:
    files = [
        p
        for p in sorted((root / package).rglob("*.py"))
        if not any(p.is_relative_to(root / e) for e in EXCLUDED)
    ]
    graph = Graph(modules={module_name(p, root) for p in files})
    for path in files:
        current = module_name(path, root)
        tree = ast.parse(path.read_text("utf-8"), str(path))
        for stmt, type_checking, deferred in _imports(tree):
            is_package = path.name == "__init__.py"
            for target in set(_resolve(stmt, current, is_package, graph.modules)):
                graph.edges.append(Edge(current, target, type_checking, deferred))
    return graph


def strongly_connected(successors: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); only the components of more than one module."""
    return _Tarjan(successors).components()


class _Tarjan:
    """One run of Tarjan's algorithm, with an explicit stack of (node, children left) so a
    deep import chain cannot hit Python's recursion limit."""

    def __init__(self, successors: dict[str, set[str]]) -> None:
        self.successors = successors
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.on_stack: set[str] = set()
        self.work: list[tuple[str, Iterator[str]]] = []
        self.found: list[list[str]] = []

    def components(self) -> list[list[str]]:
        for start in sorted(self.successors):
            if start not in self.index:
                self._enter(start)
                self._walk()
        return sorted(self.found)

    def _enter(self, node: str) -> None:
        self.index[node] = self.low[node] = len(self.index)
        self.stack.append(node)
        self.on_stack.add(node)
        self.work.append((node, iter(sorted(self.successors[node]))))

    def _walk(self) -> None:
        while self.work:
            node, children = self.work[-1]
            child = next(children, None)
            if child is None:
                self._leave(node)
            elif child not in self.index:
                self._enter(child)
            elif child in self.on_stack:
                self.low[node] = min(self.low[node], self.index[child])

    def _leave(self, node: str) -> None:
        self.work.pop()
        if self.work:
            parent = self.work[-1][0]
            self.low[parent] = min(self.low[parent], self.low[node])
        if self.low[node] == self.index[node]:
            component = self._pop_component(node)
            if len(component) > 1:
                self.found.append(sorted(component))

    def _pop_component(self, root: str) -> list[str]:
        component = []
        while True:
            member = self.stack.pop()
            self.on_stack.discard(member)
            component.append(member)
            if member == root:
                return component


class _C901(ast.NodeVisitor):
    """What ruff's C901 (the mccabe rule `make lint` enforces) counts for one function body:
    1 + each if/elif, loop, except, else of a try and match case; a nested function adds 1
    and its own. ruff is a binary with no Python API, hence this count of its rule."""

    def __init__(self) -> None:
        self.count = 1

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        pass

    def _branch(self, node: ast.AST) -> None:
        self.count += 1
        self.generic_visit(node)

    visit_If = visit_For = visit_AsyncFor = visit_While = _branch
    visit_FunctionDef = visit_AsyncFunctionDef = _branch

    def visit_Try(self, node: ast.Try) -> None:
        self.count += len(node.handlers) + bool(node.orelse)
        self.generic_visit(node)

    visit_TryStar = visit_Try  # type: ignore[assignment]

    def visit_Match(self, node: ast.Match) -> None:
        self.count += len(node.cases) - 1
        self.generic_visit(node)


def _c901(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    visitor = _C901()
    for stmt in node.body:
        visitor.visit(stmt)
    return visitor.count


def _radon(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """radon's own count (`radon cc`): boolean operators, conditional expressions,
    comprehensions, asserts and loop `else`s too; a nested function is a block of its own."""
    (block,) = cc_visit_ast(node)
    return int(block.complexity)


@dataclass(frozen=True, slots=True)
class FunctionComplexity:
    path: str
    line: int
    name: str
    complexity: int  # ruff's C901
    radon: int

    @property
    def package(self) -> str:
        return str(Path(self.path).parent)


def _functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def complexity(root: Path, paths: Iterable[Path]) -> list[FunctionComplexity]:
    table = []
    for path in paths:
        tree = ast.parse(path.read_text("utf-8"), str(path))
        for name, node in _functions(tree):
            relative = str(path.relative_to(root))
            table.append(FunctionComplexity(relative, node.lineno, name, _c901(node), _radon(node)))
    return table


def _generated(part: str) -> bool:
    """A folder of copies, not sources: virtualenvs and `python -m build`'s output."""
    return part.startswith(".venv") or part in ("build", "dist", "__pycache__")


def python_files(root: Path, dirs: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for folder in dirs:
        base = root / folder
        if base.is_dir():
            files.extend(
                p
                for p in sorted(base.rglob("*.py"))
                if not any(p.is_relative_to(root / e) for e in EXCLUDED)
                and not any(_generated(part) for part in p.relative_to(root).parts)
            )
    return files


def report(root: Path, package: str, dirs: Iterable[str], over: int) -> dict[str, object]:
    graph = import_graph(root, package)
    runtime = strongly_connected(graph.successors(with_type_checking=False))
    design = strongly_connected(graph.successors(with_type_checking=True))
    type_checking_edges = sorted(
        {(e.source, e.target) for e in graph.edges if e.type_checking and e.source != e.target}
    )
    table = complexity(root, python_files(root, dirs))
    return {
        "package": package,
        "modules": len(graph.modules),
        "import_edges": len({(e.source, e.target) for e in graph.edges}),
        "cycles_runtime": runtime,
        "cycles_with_type_checking": design,
        "type_checking_imports": [f"{a} -> {b}" for a, b in type_checking_edges],
        "functions": len(table),
        "over": over,
        "functions_over": [_row(r) for r in over_limit(table, over)],
        "max_per_package": largest_per_package(table),
    }


def over_limit(table: list[FunctionComplexity], limit: int) -> list[FunctionComplexity]:
    """The functions over `limit` by either count, the most complex (C901, then radon) first."""
    ordered = sorted(table, key=lambda r: (-r.complexity, -r.radon, r.path, r.line))
    return [r for r in ordered if r.complexity > limit or r.radon > limit]


def _row(r: FunctionComplexity) -> dict[str, object]:
    return {
        "where": f"{r.path}:{r.line}",
        "function": r.name,
        "complexity": r.complexity,
        "radon": r.radon,
    }


def largest_per_package(table: list[FunctionComplexity]) -> dict[str, dict[str, object]]:
    """Per folder: the function with the largest C901 count, and the largest radon count."""
    largest: dict[str, FunctionComplexity] = {}
    for row in table:
        best = largest.get(row.package)
        if best is None or row.complexity > best.complexity:
            largest[row.package] = row
    return {
        folder: {
            "function": f"{r.path}:{r.line} {r.name}",
            "complexity": r.complexity,
            "radon": max(row.radon for row in table if row.package == folder),
        }
        for folder, r in sorted(largest.items())
    }


def _format_row(row: dict[str, object]) -> str:
    return f"  {row['complexity']:4d} {row['radon']:5d}  {row['where']}  {row['function']}"


def check_max_complexity(root: Path, dirs: Iterable[str], limit: int) -> int:
    """The gate (`make complexity`): 1, listing them, if any function is over `limit` by
    ruff's C901 count or by radon's; else 0."""
    table = complexity(root, python_files(root, dirs))
    over = over_limit(table, limit)
    if not over:
        print(f"complexity: none of {len(table)} functions is over {limit} (C901 and radon)")
        return 0
    print(
        f"complexity: {len(over)} of {len(table)} functions over {limit} by C901 or radon "
        "(split them into named steps)\n  C901 radon"
    )
    for r in over:
        print(_format_row(_row(r)))
    return 1


def _print_text(data: dict[str, object]) -> None:
    cycles_runtime = data["cycles_runtime"]
    cycles_design = data["cycles_with_type_checking"]
    assert isinstance(cycles_runtime, list)
    assert isinstance(cycles_design, list)
    print(f"import graph of {data['package']}/: {data['modules']} modules, ", end="")
    print(f"{data['import_edges']} edges")
    print(f"cycles at run time (strongly connected components): {len(cycles_runtime)}")
    for component in cycles_runtime:
        print("  " + " <-> ".join(component))
    print(f"cycles counting TYPE_CHECKING imports: {len(cycles_design)}")
    for component in cycles_design:
        print("  " + " <-> ".join(component))
    print("imports under TYPE_CHECKING:")
    imports = data["type_checking_imports"]
    assert isinstance(imports, list)
    for line in imports:
        print(f"  {line}")
    over = data["functions_over"]
    assert isinstance(over, list)
    print(
        f"\nfunctions over complexity {data['over']} (either count): {len(over)} "
        f"of {data['functions']}\n  C901 radon"
    )
    for row in over:
        print(_format_row(row))
    print("\nlargest complexity per package (C901, with its function; radon's largest):")
    largest = data["max_per_package"]
    assert isinstance(largest, dict)
    for folder, row in largest.items():
        print(f"  {row['complexity']:4d} {row['radon']:5d}  {folder:30s} {row['function']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="pdproc", help="package of the import graph")
    parser.add_argument(
        "--dirs", nargs="*", default=list(CODE_DIRS), help="folders of the complexity table"
    )
    parser.add_argument("--over", type=int, default=10, help="list functions above this")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument(
        "--max-complexity",
        type=int,
        metavar="N",
        help="gate: list only the functions over N (C901 or radon) and exit 1 if there are any",
    )
    parser.add_argument(
        "--root", type=Path, default=REPO, help="checkout to measure (default: this one)"
    )
    args = parser.parse_args(argv)
    if args.max_complexity is not None:
        return check_max_complexity(args.root.resolve(), args.dirs, args.max_complexity)
    data = report(args.root.resolve(), args.package, args.dirs, args.over)
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        _print_text(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
