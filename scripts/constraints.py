"""The project's dependency pins: from pyproject.toml's ranges, and from an installed
environment.

    python scripts/constraints.py lock > constraints.txt   # what this environment runs
    python scripts/constraints.py lowest > lowest.txt      # every range's lower bound
    python scripts/constraints.py check                    # constraints.txt fits the ranges
    python scripts/constraints.py installed                # what this environment has

Every dependency in pyproject.toml is a range from a tested lower bound to the next
major version (torch, grpcio-tools and mypy-protobuf are pinned exactly). `lock` writes
the version of every package that `kvshare[dev]` needs, directly or through others, as
installed in the environment that runs this script (the one the suite passed in): a
constraints file for reproducible installs (`pip install -e ".[dev]" -c constraints.txt`;
a server image: `pip install . -c constraints.txt`). Local version labels are dropped
(torch 2.13.0+cpu is `torch==2.13.0`, which a CUDA build of 2.13.0 also meets). `lowest`
pins every range at its lower bound, for .ci/run's install at the lowest versions.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "kvshare"
HEADER = """\
# The versions the test suite ran against, for every package kvshare[dev] needs
# (directly or through others). Reproducible installs:
#   pip install -e ".[dev]" -c constraints.txt      (a server alone: pip install . -c ...)
# Regenerate after a change of dependencies, in the environment the suite passed in:
#   python scripts/constraints.py lock > constraints.txt
# (pyproject.toml holds the ranges; `python scripts/constraints.py check` checks this file
# against them.)
"""


def declared() -> list[Requirement]:
    """Every requirement pyproject.toml declares, the extras' included (the project's
    own extras, `kvshare[...]`, left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        texts += extra
    requirements = [Requirement(text) for text in texts]
    return [r for r in requirements if canonicalize_name(r.name) != PROJECT]


def lower_bound(requirement: Requirement) -> str:
    """The version a range starts at (`>=X` or `==X`); ValueError when it has none."""
    for spec in requirement.specifier:
        if spec.operator in (">=", "==", "==="):
            return spec.version
    raise ValueError(f"{requirement}: give it a lower bound (>=) in pyproject.toml")


def lowest() -> Iterator[str]:
    seen: dict[str, str] = {}
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        bound = lower_bound(requirement)
        if seen.setdefault(name, bound) != bound:
            raise ValueError(f"{name}: two lower bounds ({seen[name]}, {bound}); make them one")
    for pinned in sorted(seen):
        yield f"{pinned}=={seen[pinned]}"


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """Installed versions of everything `root[extras]` requires, at any depth."""
    found: dict[str, str] = {}
    wanted: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    done: set[tuple[str, frozenset[str]]] = set()
    while wanted:
        name, with_extras = wanted.pop()
        if (name, with_extras) in done:
            continue
        done.add((name, with_extras))
        dist = metadata.distribution(name)
        for text in dist.requires or []:
            requirement = Requirement(text)
            environments = [{"extra": e} for e in with_extras] or [{"extra": ""}]
            if requirement.marker is not None and not any(
                requirement.marker.evaluate(env) for env in environments
            ):
                continue
            dependency = canonicalize_name(requirement.name)
            wanted.append((dependency, frozenset(requirement.extras)))
        if canonicalize_name(name) != PROJECT:
            found[canonicalize_name(name)] = str(dist.version)
    return found


def lock() -> Iterator[str]:
    yield HEADER.rstrip("\n")
    for name, version in sorted(closure(PROJECT, {"dev"}).items()):
        yield f"{name}=={Version(version).public}"


def check(path: Path) -> list[str]:
    """What in `path` (a lock) falls outside pyproject.toml's ranges, or is missing."""
    pinned: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, at = line.partition("==")
            pinned[canonicalize_name(name)] = at
    problems = []
    for requirement in declared():
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{requirement.name}: not in {path.name}")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name}=={version} is outside {requirement}")
    return problems


def installed() -> str:
    """The installed version of every declared dependency this environment has, on one
    line (for CI's log)."""
    found = []
    for name in sorted({canonicalize_name(r.name) for r in declared()}):
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return " ".join(found)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "lock":
        print("\n".join(lock()))
    elif command == "lowest":
        print("\n".join(lowest()))
    elif command == "installed":
        print(installed())
    elif command == "check":
        problems = check(ROOT / "constraints.txt")
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
