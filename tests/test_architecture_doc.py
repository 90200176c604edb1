"""docs/architecture.md's package dependency table is the one the imports give."""

from __future__ import annotations

from pathlib import Path

from tools.deps_table import DOC, block, dependencies, documented, imported_packages


def test_the_doc_table_matches_the_imports() -> None:
    fresh = block(dependencies())
    assert documented(DOC.read_text()) == fresh, (
        "docs/architecture.md's dependency table is stale: run `python -m tools.deps_table --write`"
    )


def test_imports_under_type_checking_and_in_functions_count(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "import kvstore.keys\n"
        "if TYPE_CHECKING:\n"
        "    from balancer.view import FleetView\n"
        "def f():\n"
        "    from router import app\n"
        "from . import sibling\n"
    )
    assert imported_packages(module) == {"typing", "kvstore", "balancer", "router"}


def test_a_package_does_not_list_itself(tmp_path: Path) -> None:
    package = tmp_path / "router"
    package.mkdir()
    (package / "a.py").write_text("from router.b import x\nfrom balancer import y\n")
    deps = dependencies(tmp_path)
    assert deps["router"] == {"balancer"}
    assert deps["kvstore"] == set()
