"""Every change to an event contract additive, unless its ContractVersion changed (contract
section 4: unknown extra fields are ignored by readers, "additive-only minor changes").

    python -m tests.support.contract_changes      (bin/test runs it with the lint)

Each schema in pin_pipelines/contracts is compared, version by version, with the one before it
in the repository's history (and the working tree's with the last commit's). Additive: a new
property, or a new description. Breaking: a property removed or its validation changed (a
narrower type refuses what readers were sent, a wider one sends what they cannot read), a field
no longer required, unknown fields no longer allowed, a contract file removed. A breaking change
passes only with a new ContractVersion (its `const`), which is a new topic by the contract's
naming (`.v2`)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from typing import Any

from pin_pipelines.contracts import SCHEMA_DIR, SUFFIX
from tests.support.recalc import REPO_ROOT

#: Keywords that only document: changing them breaks no reader.
ANNOTATIONS = frozenset({"title", "description", "examples", "$comment"})


def _validation(property_schema: Any) -> Any:
    """A property's schema without its annotations, at every depth."""
    if isinstance(property_schema, dict):
        return {k: _validation(v) for k, v in property_schema.items() if k not in ANNOTATIONS}
    if isinstance(property_schema, list):
        return [_validation(v) for v in property_schema]
    return property_schema


def contract_version(document: dict[str, Any]) -> Any:
    return document.get("properties", {}).get("ContractVersion", {}).get("const")


def breaking_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What `new` breaks of `old` for a reader of `old` (none when ContractVersion changed)."""
    if contract_version(old) != contract_version(new):
        return []
    found = []
    before, after = old.get("properties", {}), new.get("properties", {})
    for name, rule in before.items():
        if name not in after:
            found.append(f"{name}: removed")
        elif _validation(rule) != _validation(after[name]):
            found.append(
                f"{name}: {json.dumps(_validation(rule))} → {json.dumps(_validation(after[name]))}"
            )
    for name in sorted(set(old.get("required", [])) - set(new.get("required", []))):
        found.append(f"{name}: no longer required")
    if (
        old.get("additionalProperties", True) is not False
        and new.get("additionalProperties", True) is False
    ):
        found.append("unknown fields no longer allowed (additionalProperties: false)")
    for keyword in ("type", "$schema"):
        if old.get(keyword) != new.get(keyword):
            found.append(f"{keyword}: {old.get(keyword)!r} → {new.get(keyword)!r}")
    return found


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"[contracts] git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def versions(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, schema) of every committed version of `path`, oldest first, then the working
    tree's when it differs from the last."""
    found = [
        (commit[:12], json.loads(_git("show", f"{commit}:{path}")))
        for commit in reversed(_git("log", "--format=%H", "--", path).split())
    ]
    current = REPO_ROOT / path
    if current.exists():
        document = json.loads(current.read_text())
        if not found or found[-1][1] != document:
            found.append(("working tree", document))
    return found


def check() -> list[str]:
    """Every breaking change in the contracts' history, one line each."""
    folder = SCHEMA_DIR.relative_to(REPO_ROOT).as_posix()
    ever = set(_git("log", "--format=", "--name-only", "--", folder).split())
    ever |= {p.relative_to(REPO_ROOT).as_posix() for p in SCHEMA_DIR.glob(f"*{SUFFIX}")}
    problems = []
    for path in sorted(p for p in ever if p.endswith(SUFFIX)):
        if not (REPO_ROOT / path).exists():
            problems.append(f"{path}: removed (a contract's topic is retired with a new version)")
            continue
        history = versions(path)
        for (was, old), (now, new) in itertools.pairwise(history):
            problems += [f"{path} {was} → {now}: {p}" for p in breaking_changes(old, new)]
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(f"[contracts] breaking: {problem}", file=sys.stderr)
    if problems:
        print(
            "[contracts] a breaking change to an event contract needs a new ContractVersion"
            " (and topic .vN): pin_pipelines/contracts/__init__.py",
            file=sys.stderr,
        )
        return 1
    print(
        f"[contracts] every change to {len(list(SCHEMA_DIR.glob(f'*{SUFFIX}')))} contracts additive"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
