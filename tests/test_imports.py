"""The package's shape, measured from the source: no import cycle between its modules, `bench/` and `experiments/`
importing each other nowhere, library code importing no command-line code, and no parameter list above 10 outside
the Triton kernels (whose launch signatures are the kernels' arguments). Run as a script it prints the import
graph's cycles and the longest parameter lists: `python tests/test_imports.py`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "titans"
MAX_PARAMETERS = 10
KERNEL_FILES = {"memory/triton_chunk.py"}  # Triton kernels take their arguments one by one
CLI = ("titans.cli", "titans.commands")
# What is left, named so that nothing new joins it and nothing here grows (issue 46 asks for none):
KNOWN_LONG: dict[str, int] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `path` imports, anywhere in it (a function-level import counts: it is a
    dependency all the same). `from . import x` names the module x where there is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted: the import cycles.
    A package's __init__ importing its own submodules is not a cycle of design, so edges from a package to its
    children, and from a module to its own package, are left out."""
    def related(a: str, b: str) -> bool:
        return b.startswith(a + ".") or a.startswith(b + ".")

    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if related(v, w):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def parameter_lists() -> list[tuple[int, str]]:
    """(number of parameters, 'module:function') for every function and method, self and cls not counted; not the
    Triton kernels, nor the command line's commands (a Typer command's parameters are its options)."""
    found = []
    for name, path in modules().items():
        if path.relative_to(PACKAGE).as_posix() in KERNEL_FILES or name.startswith(CLI):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                params += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
                found.append((len(params), f"{name}:{node.name}"))
    return sorted(found, reverse=True)


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_bench_and_experiments_import_each_other_nowhere():
    edges = graph()
    crossing = [(a, b) for a, targets in edges.items() for b in targets
                if {a.split(".")[1], b.split(".")[1]} == {"bench", "experiments"}]
    assert crossing == []


def test_library_code_imports_no_command_line_code():
    edges = graph()
    into_cli = [(a, b) for a, targets in edges.items() for b in targets
                if b.startswith(CLI) and not a.startswith(CLI)]
    assert into_cli == []


def test_no_parameter_list_above_ten_but_the_known_ones():
    long = [(n, where) for n, where in parameter_lists() if n > KNOWN_LONG.get(where, MAX_PARAMETERS)]
    assert long == [], f"parameter lists above {MAX_PARAMETERS} (or longer than they were): {long}"


if __name__ == "__main__":
    print("import cycles:", cycles(graph()) or "none")
    print("longest parameter lists (outside the Triton kernels and the CLI's commands):")
    for n, where in parameter_lists()[:15]:
        print(f"  {n:3d}  {where}")
