"""The wheel installs one import root, ``switchyard``, with the mock engine's tokenizer."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(60)
def test_the_wheel_holds_only_the_switchyard_package(tmp_path: Path) -> None:
    # Built from a copy, so no build/ directory lands in the working tree.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*cmd, "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("switchyard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"switchyard"}
    assert "switchyard/mock/assets/tokenizer/tokenizer.json" in names
