"""Git worktrees for benchmarks that run another revision's router beside this checkout's."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worktree(stack: ExitStack, rev: str) -> Path:
    """``rev`` checked out in a temporary directory, removed when ``stack`` closes."""
    parent = Path(tempfile.mkdtemp(prefix="sy-against-"))
    stack.callback(shutil.rmtree, parent, ignore_errors=True)
    path = parent / "tree"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), rev], check=True
    )
    stack.callback(
        subprocess.run,
        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
        check=False,
    )
    return path
