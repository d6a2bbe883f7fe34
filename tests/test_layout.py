"""The suite's layout: the product never imports the tests, tests/unit mirrors the
product's packages, every directory of tests is a package (so two test files of one
name in different directories are two modules, never a collision), and what tests share
is in tests/support/: no test file or conftest imports a test file or a conftest."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support.repo import REPO

# Code that ships or runs outside the suite: none of it may import `tests`.
PRODUCT = ("cacheserver", "replica_agent", "policy", "kvcommon", "kvshare")
OUTSIDE_TESTS = (*PRODUCT, "scripts", "benchmarks")
# What tests/unit may mirror: the product's packages and the benchmark scripts.
MIRRORED = (*PRODUCT, "benchmarks")
UNIT = REPO / "tests" / "unit"


def python_files(top: Path) -> Iterator[Path]:
    yield from (path for path in sorted(top.rglob("*.py")) if "__pycache__" not in path.parts)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for each import in `path`, and each import_module/__import__ of a
    literal name."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif (
            isinstance(node, ast.Call)
            and called_name(node) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else None


def test_nothing_outside_tests_imports_tests() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for top in OUTSIDE_TESTS
        for path in python_files(REPO / top)
        for line, module in imported_modules(path)
        if module == "tests" or module.startswith("tests.")
    ]
    assert not found, "product code and scripts must not depend on the test suite:\n" + "\n".join(
        found
    )


def test_the_import_check_sees_every_form_of_import(tmp_path: Path) -> None:
    """Positive control: each way of importing `tests` is reported."""
    source = tmp_path / "uses_tests.py"
    source.write_text(
        "import tests.support.certs\n"
        "from tests.support import repo\n"
        "import importlib\n"
        "importlib.import_module('tests.support.simcuda')\n"
        "__import__('tests')\n"
        "from . import sibling\n"
    )
    modules = [module for _, module in imported_modules(source)]
    assert [m for m in modules if m.split(".")[0] == "tests"] == [
        "tests.support.certs",
        "tests.support",
        "tests.support.simcuda",
        "tests",
    ]


def mirror_strays(repo: Path) -> list[str]:
    """Directories of tests/unit with no product package of that path, and unit tests
    outside any such directory."""
    unit = repo / "tests" / "unit"
    strays = [
        f"{path.relative_to(repo)}/: the product has no {path.relative_to(unit)}/"
        for path in sorted(unit.rglob("*"))
        if path.is_dir()
        and "__pycache__" not in path.parts
        and (
            path.relative_to(unit).parts[0] not in MIRRORED
            or not (repo / path.relative_to(unit)).is_dir()
        )
    ]
    return strays + [
        f"{path.relative_to(repo)}: belongs in tests/unit/<package>/..."
        for path in sorted(unit.glob("test_*.py"))
    ]


def missing_packages(tests: Path) -> list[str]:
    """Directories under `tests` holding tests or a conftest.py without an __init__.py."""
    directories = {
        path.parent
        for path in python_files(tests)
        if path.name.startswith("test_") or path.name == "conftest.py"
    }
    return sorted(
        str(directory.relative_to(tests.parent))
        for directory in directories
        if not (directory / "__init__.py").is_file()
    )


def test_unit_tests_mirror_the_product_packages() -> None:
    strays = mirror_strays(REPO)
    assert not strays, "tests/unit mirrors the product's packages:\n" + "\n".join(strays)


def test_every_directory_of_tests_is_a_package() -> None:
    """pytest then names each test module by its path from the repository root."""
    missing = missing_packages(REPO / "tests")
    assert not missing, "add an empty __init__.py to: " + ", ".join(missing)


def test_the_layout_checks_see_a_stray_directory_and_a_missing_init(tmp_path: Path) -> None:
    """Positive control, on a made-up repository."""
    (tmp_path / "policy").mkdir()
    for directory in ("tests/unit/policy", "tests/unit/polcy", "tests/unit/docs", "tests/e2e"):
        (tmp_path / directory).mkdir(parents=True)
        (tmp_path / directory / "test_x.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests/unit/test_loose.py").write_text("")
    for package in ("tests", "tests/unit", "tests/unit/policy", "tests/unit/polcy"):
        (tmp_path / package / "__init__.py").write_text("")
    assert mirror_strays(tmp_path) == [
        "tests/unit/docs/: the product has no docs/",
        "tests/unit/polcy/: the product has no polcy/",
        "tests/unit/test_loose.py: belongs in tests/unit/<package>/...",
    ]
    assert missing_packages(tmp_path / "tests") == ["tests/e2e", "tests/unit/docs"]


def imports_of_tests(tests: Path) -> list[str]:
    """Imports, in any file under `tests`, of a test module (`test_*`) or a conftest:
    what files share belongs in tests/support/ (a conftest keeps only fixtures)."""
    found = []
    for path in python_files(tests):
        package = path.relative_to(tests.parent).parent.parts
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                parent = f"{base}.{node.module}" if node.module else base
                modules = [parent] + [f"{parent}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found += [
                f"{path.relative_to(tests.parent)}:{node.lineno}: imports {module}"
                for module in modules
                if module.split(".")[0] == "tests"
                and (
                    module.rsplit(".", 1)[-1].startswith("test_")
                    or module.rsplit(".", 1)[-1] == "conftest"
                )
            ]
    return found


def test_no_test_file_imports_another_test_file_or_a_conftest() -> None:
    found = imports_of_tests(REPO / "tests")
    assert not found, "move what is shared into tests/support/:\n" + "\n".join(found)


def test_the_shared_import_check_sees_each_form(tmp_path: Path) -> None:
    """Positive control, on a made-up tree: absolute, relative and `from package import
    module` imports of a test file or a conftest are reported; tests.support is not."""
    (tmp_path / "tests/e2e").mkdir(parents=True)
    (tmp_path / "tests/e2e/test_user.py").write_text(
        "from tests.conftest import launch\n"
        "from tests.e2e.test_bulk import open_bulk\n"
        "from tests.e2e import test_vllm_store as vllm\n"
        "import tests.isolation.conftest\n"
        "from .conftest import MODEL\n"
        "from . import test_other\n"
        "from ..support.servers import launch\n"
        "from tests.support.servers import Running\n"
        "from tests.support import bulk\n"
    )
    assert imports_of_tests(tmp_path / "tests") == [
        "tests/e2e/test_user.py:1: imports tests.conftest",
        "tests/e2e/test_user.py:2: imports tests.e2e.test_bulk",
        "tests/e2e/test_user.py:3: imports tests.e2e.test_vllm_store",
        "tests/e2e/test_user.py:4: imports tests.isolation.conftest",
        "tests/e2e/test_user.py:5: imports tests.e2e.conftest",
        "tests/e2e/test_user.py:6: imports tests.e2e.test_other",
    ]
