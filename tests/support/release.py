"""A previous release of pin-pipelines, installed beside this one for the upgrade tests.

The previous release is the newest commit whose migrations are a proper prefix of this tree's
(`previous_release`), found in the clone's own history (a CI clone has all of it). Its tree is
exported with `git archive` (the repository's worktrees and branches are left alone) and
installed into a venv of its own in
the pip-free way `pip install --no-deps -e .` ends up with, in well under a second and with no
network: a .pth file puts its tree first on the path and this venv's site-packages (the
dependencies, one set for both releases) after it, and each console script of this venv is
written again with the new venv's interpreter. This venv's site-packages is added as a plain
folder, so its own .pth files, among them the editable hook of THIS release's package, are
not run: `import pin_pipelines` there can only find the previous release's.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.recalc import REPO_ROOT

MIGRATIONS = Path("sql/postgres/migrations")


@dataclass(frozen=True)
class Release:
    """An installed release: its source tree and its venv's bin folder."""

    commit: str
    root: Path
    bin: Path

    @property
    def pin(self) -> str:
        return str(self.bin / "pin")

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with this release's bin folder first on PATH (a `dagster` looked up there)."""
        return {**env, "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}"}


def _git(*args: str) -> str:
    """git's answer; its error as the failure (a shallow clone has no previous release)."""
    done = subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr.strip()} (a full clone?)"
    return done.stdout.strip()


def newest_migration() -> Path:
    """The newest PostgreSQL migration of this tree (its path inside the repository)."""
    return max((REPO_ROOT / MIGRATIONS).glob("*.sql")).relative_to(REPO_ROOT)


def _migrations(commit: str | None = None) -> list[str]:
    """The PostgreSQL migrations (names without .sql) of `commit`, or of this tree, in order."""
    if commit is None:
        return sorted(p.stem for p in (REPO_ROOT / MIGRATIONS).glob("*.sql"))
    listed = _git("ls-tree", "--name-only", commit, f"{MIGRATIONS}/").splitlines()
    return sorted(Path(name).stem for name in listed if name.endswith(".sql"))


@functools.cache
def previous_release() -> str:
    """The newest commit of the first-parent history whose migrations are a proper prefix of
    this tree's: the release before this one, as far as its schema goes. Not simply the commit
    before the newest migration: between two releases migrations may be merged from several
    branches, renumbered and chained again, leaving commits with a schema no release had (one
    with 0024 and without 0023, say). Cached: the walk runs git once per commit it tries, and
    the upgrade test asks both for the release and for the migrations it lacks."""
    current = _migrations()
    for commit in _git("rev-list", "--first-parent", "HEAD").splitlines():
        found = _migrations(commit)
        if len(found) < len(current) and found == current[: len(found)]:
            return commit
    raise AssertionError("no commit of this clone's history has a schema before this tree's")


def unreleased_migrations() -> list[str]:
    """The migrations this tree adds to the previous release's, in order."""
    return _migrations()[len(_migrations(previous_release())) :]


def install_release(commit: str, folder: Path) -> Release:
    """`commit`'s tree in `folder/src`, its venv in `folder/venv`; checked to import its own
    package."""
    root, venv = folder / "src", folder / "venv"
    root.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(REPO_ROOT), "archive", "--format=tar", commit], stdout=subprocess.PIPE
    )
    assert archive.stdout is not None
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        tar.extractall(root, filter="data")
    assert archive.wait() == 0, f"git archive {commit} failed"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(purelib, "pin_release.pth").write_text("".join(f"{p}\n" for p in (root, *ours)))
    here = Path(sys.executable).parent
    for script in here.iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        with script.open("rb") as head:
            first = head.readline()
        if first.startswith(b"#!") and str(here).encode() in first:
            target = venv / "bin" / script.name
            body = script.read_bytes().split(b"\n", 1)[1]
            target.write_bytes(b"#!" + str(python).encode() + b"\n" + body)
            target.chmod(0o755)
    imported = subprocess.run(
        [str(python), "-c", "import pin_pipelines; print(pin_pipelines.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,  # `python -c` looks in its working folder first
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).stdout.strip()
    assert Path(imported).is_relative_to(root), f"the release imports {imported}, not its own"
    return Release(commit, root, venv / "bin")
