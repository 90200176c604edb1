"""docs/architecture.md says what the code is: its layer diagram holds for the imports,
and every source path it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "src" / "switchyard"
MARKER = "<!-- layers: checked by tests/test_architecture_doc.py -->"


def layers(doc: str) -> list[list[str]]:
    """The diagram's rows, top first: the package names of each row."""
    block = doc[doc.index(MARKER) :].split("```", 2)[1]
    rows = [re.findall(r"[a-z_]+", line) for line in block.splitlines()]
    return [row for row in rows if row]


def imported_subpackages(path: Path) -> set[str]:
    """The ``switchyard.X`` packages one module imports (at any depth, typed or not)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "switchyard":
                names = [f"switchyard.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("switchyard.")}
    return found


def dependencies(root: Path) -> dict[str, set[str]]:
    """Each subpackage of ``root`` and the other subpackages its modules import."""
    deps: dict[str, set[str]] = {}
    for package in sorted(p for p in root.iterdir() if (p / "__init__.py").exists()):
        used: set[str] = set()
        for module in package.rglob("*.py"):
            used |= imported_subpackages(module)
        deps[package.name] = used - {package.name}
    return deps


def violations(rows: list[list[str]], deps: dict[str, set[str]]) -> list[str]:
    """Imports the diagram forbids: of a package in the same row or a row above."""
    level = {name: i for i, row in enumerate(rows) for name in row}
    return [
        f"{package} imports {used}"
        for package, imports in deps.items()
        for used in sorted(imports)
        if used in level and package in level and level[used] <= level[package]
    ]


def test_every_package_is_in_the_diagram() -> None:
    named = {name for row in layers(DOC.read_text()) for name in row}
    assert named == set(dependencies(PACKAGE))


def test_the_imports_keep_to_the_layers() -> None:
    assert violations(layers(DOC.read_text()), dependencies(PACKAGE)) == []


def reach(package: str, deps: dict[str, set[str]]) -> set[str]:
    """Every package ``package`` imports, directly or through another."""
    seen: set[str] = set()
    todo = [package]
    while todo:
        for used in deps[todo.pop()] - seen:
            seen.add(used)
            todo.append(used)
    return seen


def test_only_the_top_layer_reaches_every_package() -> None:
    rows = layers(DOC.read_text())
    deps = dependencies(PACKAGE)
    assert len(rows[0]) == 1
    (top,) = rows[0]
    assert reach(top, deps) == set(deps) - {top}
    assert [p for p in deps if p != top and reach(p, deps) == set(deps) - {p}] == []


def test_a_package_importing_its_neighbour_or_a_layer_above_is_caught(tmp_path: Path) -> None:
    for name, source in {
        "kvstore": "from switchyard.balancer.view import FleetView\n",
        "balancer": "import switchyard.core.errors\n",
        "core": "def f():\n    from switchyard import router\n",
        "router": "",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(source)
    rows = [["router"], ["balancer", "kvstore"], ["core"]]
    assert violations(rows, dependencies(tmp_path)) == [
        "core imports router",
        "kvstore imports balancer",
    ]


def test_every_source_path_the_doc_names_exists() -> None:
    paths = set(re.findall(r"`((?:src|tests|tools|bench|deploy)/[\w./-]*)`", DOC.read_text()))
    assert paths
    assert sorted(p for p in paths if not (REPO / p).exists()) == []


def test_every_link_resolves() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", DOC.read_text())
    assert links
    assert sorted(link for link in links if not (DOC.parent / link).exists()) == []
