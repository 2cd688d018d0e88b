"""The package's shape: no import cycle between modules, the library (dflash/) never imports the
stages, the command line (stages/cli.py) is what the `dflash` script and `python -m stages.cli` run,
and both packages are installed. Imports are read from the source (every `import`, at the top or
inside a function)."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module of dflash/ and stages/ -> the modules of both that it imports."""
    paths = {module_name(path): path for folder in ("dflash", "stages") for path in (ROOT / folder).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from dflash import data`
        graph[name] = {other for other in imported if other in paths and other != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_library_never_imports_the_stages():
    graph = import_graph()
    upward = {(name, other) for name, imported in graph.items() if name.startswith("dflash")
              for other in imported if other.split(".")[0] == "stages"}
    assert upward == set()
    # The same read as plain text, so an import the graph misses (a string, a comment turned code) shows too.
    found = subprocess.run(["grep", "-rnE", r"import stages|from stages", "dflash"], capture_output=True,
                           text=True, cwd=ROOT)
    assert found.stdout == ""


def test_the_dflash_command_is_the_stages_command_line():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"dflash": "stages.cli:main"}
    packages = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = {module_name(path.parent) for folder in ("dflash", "stages") for path in (ROOT / folder).rglob("__init__.py")}
    assert on_disk <= packages, f"packages on disk that pyproject.toml does not install: {sorted(on_disk - packages)}"
    assert {"stages", "dflash"} <= packages
    result = subprocess.run([sys.executable, "-m", "stages.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "stage2-train" in result.stdout


def test_test_files_share_helpers_through_support_or_conftest_only():
    tests = ROOT / "tests"
    test_modules = {path.stem for path in tests.glob("test_*.py")}
    imported = {(path.name, alias) for path in tests.glob("*.py")
                for node in ast.walk(ast.parse(path.read_text(), str(path)))
                for alias in ([a.name for a in node.names] if isinstance(node, ast.Import)
                              else [node.module] if isinstance(node, ast.ImportFrom) else [])
                if alias in test_modules}
    assert imported == set()
