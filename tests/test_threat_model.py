"""threat_model/controls.toml stays true as the code changes.

The map is checked against the source by parsing it with `ast`: nothing is imported,
so these tests are fast and have no side effects. They fail when an OWASP Agentic Top 10
(2026) item ASI01-ASI10 or a CSA MAESTRO layer L1-L7 is neither covered by a control nor
reasoned not applicable; when an `enforced_in` file or symbol no longer exists; when a
named test no longer exists or would not run in the default `python -m pytest`; and when
owasp-asi.md, maestro.md or README.md stop citing a control the map gives them. The named
tests live under tests/, so the same CI run executes them.

`test_the_checks_catch_a_broken_map` is the positive control: each check must report a
deliberately broken entry, so a pass cannot come from a check that looks at nothing.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "threat_model"
ASI_IDS = [f"ASI{n:02d}" for n in range(1, 11)]
MAESTRO_IDS = [f"L{n}" for n in range(1, 8)]
CONTROL_KEYS = {"id", "title", "threat", "enforced_in", "tests", "owasp_asi", "maestro"}
NOT_APPLICABLE_KEYS = {"owasp_asi", "maestro", "reason"}
CONTROL_ID = re.compile(r"C\d{2}")
MIN_CONTROLS = 12
MIN_REASON_CHARS = 80  # a reason is an argument, not a word
Map = dict[str, Any]


def load_map() -> Map:
    with (MODEL_DIR / "controls.toml").open("rb") as f:
        return tomllib.load(f)


# -- source lookups by ast ----------------------------------------------------------------


@functools.cache
def _module(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError):
        return None


def _names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Classes, functions and assigned names a block defines (into if/try/with blocks,
    never into function bodies)."""
    found: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found[name.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif type(node).__name__ == "TypeAlias":  # `type X = ...` (Python 3.12+)
            found[node.name.id] = node  # type: ignore[attr-defined]
        elif isinstance(node, ast.If | ast.Try | ast.With):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            found.update(_names(nested))
    return found


def resolve(repo: Path, path: str, dotted: str) -> ast.stmt | str:
    """The definition of `dotted` (e.g. `AccessPolicy.admit`) in `path`, or a problem."""
    file = repo / path
    if ".." in Path(path).parts or not path.endswith(".py") or not file.is_file():
        return f"{path}: no such Python file in the repository"
    module = _module(file)
    if module is None:
        return f"{path}: does not parse"
    body: list[ast.stmt] = module.body
    node: ast.stmt | None = None
    for part in dotted.split("."):
        node = _names(body).get(part)
        if node is None:
            return f"{path}: defines no {dotted!r} (missing {part!r})"
        body = node.body if isinstance(node, ast.ClassDef) else []
    assert node is not None
    return node


def _split(entry: str) -> tuple[str, list[str]]:
    path, *rest = entry.split("::")
    return path, rest


# -- the checks: each returns the problems it found ------------------------------------------


def shape_problems(data: Map) -> list[str]:
    problems = [
        f"unknown top-level key {k!r}" for k in data if k not in {"control", "not_applicable"}
    ]
    controls = data.get("control", [])
    if len(controls) < MIN_CONTROLS:
        problems.append(
            f"{len(controls)} controls; the threat model promises at least {MIN_CONTROLS}"
        )
    seen: set[str] = set()
    for i, control in enumerate(controls):
        where = f"control[{i}] {control.get('id', '?')}"
        if set(control) != CONTROL_KEYS:
            problems.append(f"{where}: keys must be exactly {sorted(CONTROL_KEYS)}")
            continue
        if not CONTROL_ID.fullmatch(str(control["id"])) or control["id"] in seen:
            problems.append(f"{where}: id must be unique and look like C01")
        seen.add(control["id"])
        for key in ("title", "threat"):
            if not isinstance(control[key], str) or not control[key].strip():
                problems.append(f"{where}: {key} must be non-empty text")
        for key in ("enforced_in", "tests", "owasp_asi", "maestro"):
            values = control[key]
            if not isinstance(values, list) or not values or len(set(values)) != len(values):
                problems.append(f"{where}: {key} must be a non-empty list without repeats")
        problems += _id_problems(where, control)
    for i, entry in enumerate(data.get("not_applicable", [])):
        where = f"not_applicable[{i}]"
        if set(entry) != NOT_APPLICABLE_KEYS:
            problems.append(f"{where}: keys must be exactly {sorted(NOT_APPLICABLE_KEYS)}")
            continue
        if not entry["owasp_asi"] and not entry["maestro"]:
            problems.append(f"{where}: names no ASI item or MAESTRO layer")
        if len(str(entry["reason"]).strip()) < MIN_REASON_CHARS:
            problems.append(f"{where}: reason must say why the item does not apply")
        problems += _id_problems(where, entry)
    return problems


def _id_problems(where: str, entry: Map) -> list[str]:
    bad = [a for a in entry.get("owasp_asi", []) if a not in ASI_IDS]
    bad += [m for m in entry.get("maestro", []) if m not in MAESTRO_IDS]
    return [f"{where}: unknown id {b!r}; use ASI01..ASI10 and L1..L7" for b in bad]


def coverage_problems(data: Map) -> list[str]:
    covered = {i for c in data.get("control", []) for i in (*c["owasp_asi"], *c["maestro"])}
    waived = {i for n in data.get("not_applicable", []) for i in (*n["owasp_asi"], *n["maestro"])}
    problems = [
        f"{item} is covered by no control and has no not_applicable entry"
        for item in (*ASI_IDS, *MAESTRO_IDS)
        if item not in covered | waived
    ]
    problems += [
        f"{item} is both mapped to a control and marked not applicable; pick one"
        for item in sorted(covered & waived)
    ]
    return problems


def enforced_in_problems(data: Map, repo: Path = REPO) -> list[str]:
    problems = []
    for control in data.get("control", []):
        for entry in control["enforced_in"]:
            path, symbol = _split(entry)
            if len(symbol) != 1 or not symbol[0]:
                problems.append(f"{control['id']}: {entry!r} must be 'path::symbol'")
                continue
            found = resolve(repo, path, symbol[0])
            if isinstance(found, str):
                problems.append(f"{control['id']}: {entry}: {found}")
    return problems


def named_test_problems(data: Map, repo: Path = REPO) -> list[str]:
    """Named tests exist and the default run collects and runs them."""
    problems = []
    for control in data.get("control", []):
        for entry in control["tests"]:
            path, parts = _split(entry)
            parts = [re.sub(r"\[.*\]$", "", p) for p in parts]
            problem = _test_entry_problem(repo, path, parts)
            if problem:
                problems.append(f"{control['id']}: {entry}: {problem}")
    return problems


def _test_entry_problem(repo: Path, path: str, parts: list[str]) -> str | None:
    if not path.startswith("tests/") or not Path(path).name.startswith("test_"):
        return "not a tests/test_*.py file, so `python -m pytest` would not collect it"
    if len(parts) not in (1, 2) or not parts[-1].startswith("test"):
        return "must be path::test_name or path::TestClass::test_name"
    if len(parts) == 2 and not parts[0].startswith("Test"):
        return f"class {parts[0]!r} is not collected by pytest (name it Test...)"
    found = resolve(repo, path, ".".join(parts))
    if isinstance(found, str):
        return found
    if not isinstance(found, ast.FunctionDef | ast.AsyncFunctionDef):
        return "is not a test function"
    if _marked_gpu(repo / path, found):
        return "is gpu-marked, so CI (no GPU) skips it; name a test that runs everywhere"
    return None


def _marked_gpu(path: Path, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    module = _module(path)
    assert module is not None
    pytestmark = _names(module.body).get("pytestmark")
    marks = [*function.decorator_list, *([pytestmark] if pytestmark is not None else [])]
    return any(isinstance(n, ast.Attribute) and n.attr == "gpu" for m in marks for n in ast.walk(m))


def _sections(markdown: str) -> dict[str, str]:
    """`## ` heading line -> the text up to the next `## ` heading."""
    chunks = re.split(r"^(?=## )", markdown, flags=re.MULTILINE)
    return {c.splitlines()[0]: c for c in chunks if c.startswith("## ")}


def doc_problems(data: Map, docs: dict[str, str]) -> list[str]:
    """owasp-asi.md and maestro.md: a section per item citing every control mapped to it
    (or saying why it does not apply); README.md cites every control."""
    problems = []
    for doc, key, items in (
        ("owasp-asi.md", "owasp_asi", ASI_IDS),
        ("maestro.md", "maestro", MAESTRO_IDS),
    ):
        sections = _sections(docs.get(doc, ""))
        for item in items:
            heading = next((h for h in sections if re.search(rf"\b{item}\b", h)), None)
            if heading is None:
                problems.append(f"{doc}: no '## ' section for {item}")
                continue
            text = sections[heading]
            mapped = [c["id"] for c in data.get("control", []) if item in c[key]]
            problems += [
                f"{doc}: section {item} does not cite {cid}"
                for cid in mapped
                if not re.search(rf"\b{cid}\b", text)
            ]
            waived = any(item in n[key] for n in data.get("not_applicable", []))
            if waived and "not apply" not in text.lower():
                problems.append(f"{doc}: section {item} must say why it does not apply")
    problems += [
        f"README.md does not cite {c['id']}"
        for c in data.get("control", [])
        if not re.search(rf"\b{c['id']}\b", docs.get("README.md", ""))
    ]
    return problems


def _docs() -> dict[str, str]:
    names = ("README.md", "owasp-asi.md", "maestro.md", "checklist.md")
    return {n: (MODEL_DIR / n).read_text(encoding="utf-8") for n in names}


# -- the tests ------------------------------------------------------------------------------


def _assert_none(problems: list[str]) -> None:
    assert not problems, "threat_model/controls.toml is out of date:\n" + "\n".join(problems)


def test_controls_toml_has_the_documented_shape() -> None:
    _assert_none(shape_problems(load_map()))


def test_every_asi_item_and_maestro_layer_is_covered() -> None:
    _assert_none(coverage_problems(load_map()))


def test_every_enforced_in_names_an_existing_file_and_symbol() -> None:
    _assert_none(enforced_in_problems(load_map()))


def test_every_named_test_exists_and_runs_in_the_default_pytest_run() -> None:
    _assert_none(named_test_problems(load_map()))
    with (REPO / "pyproject.toml").open("rb") as f:
        options = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert "tests" in options["testpaths"]
    assert not re.search(r"(^|\s)(-m|-k|--ignore|--deselect)\b", options.get("addopts", ""))


def test_the_docs_cite_every_mapped_control() -> None:
    docs = _docs()
    _assert_none(doc_problems(load_map(), docs))
    assert docs["checklist.md"].strip(), "threat_model/checklist.md is empty"


def test_the_checks_catch_a_broken_map(tmp_path: Path) -> None:
    """Positive control: each check reports a deliberately broken entry."""
    broken = load_map()
    first = broken["control"][0]
    first["maestro"] = ["L9"]
    first["enforced_in"] = ["policy/access.py::AccessPolicy.no_such_method", "nope/gone.py::x"]
    first["tests"] = ["tests/test_threat_model.py::test_that_does_not_exist", "docs/x.md::test"]
    broken["not_applicable"] = []
    assert any("L9" in p for p in shape_problems(broken))
    assert any("ASI09 is covered by no control" in p for p in coverage_problems(broken))
    missing = enforced_in_problems(broken)
    assert any("no_such_method" in p for p in missing) and any("gone.py" in p for p in missing)
    tests = named_test_problems(broken)
    assert any("test_that_does_not_exist" in p for p in tests)
    assert any("docs/x.md" in p for p in tests)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_g.py").write_text(
        "import pytest\npytestmark = pytest.mark.gpu\ndef test_on_gpu(): pass\n"
    )
    first["tests"] = ["tests/test_g.py::test_on_gpu"]
    assert any("gpu-marked" in p for p in named_test_problems(broken, tmp_path))
    docs = {**_docs(), "owasp-asi.md": "## ASI01 Agent Goal Hijack\nno controls cited\n"}
    assert any("section ASI01 does not cite" in p for p in doc_problems(load_map(), docs))
    assert any("no '## ' section for ASI02" in p for p in doc_problems(load_map(), docs))


# -- C02: a source invariant that no behavioural test can see reliably ------------------------


def timing_problems(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Why `function` might compare a secret in variable time (empty: it does not)."""
    problems = []
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
    if not any(
        isinstance(c.func, ast.Attribute) and c.func.attr == "compare_digest" for c in calls
    ):
        problems.append("does not use hmac.compare_digest")
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops
        ):
            problems.append(f"line {node.lineno}: compares with ==, != or in")
        if isinstance(node, ast.For):
            exits = [n for n in ast.walk(node) if isinstance(n, ast.Break | ast.Return)]
            problems += [f"line {n.lineno}: leaves the loop early" for n in exits]
    return problems


def test_bearer_tokens_are_compared_in_constant_time() -> None:
    """C02. A timing test of one 32-byte comparison is noise on shared CI machines, so
    the property is checked in the source: hmac.compare_digest against every stored
    hash, no ==, and no early exit from the loop (vLLM's API key check leaked through
    timing: CVE-2025-59425)."""
    found = resolve(REPO, "policy/identity.py", "Authenticator._by_token")
    assert isinstance(found, ast.FunctionDef), found
    assert timing_problems(found) == []
    leaky = ast.parse(
        "def _by_token(self, token):\n"
        "    for c in self._tokens:\n"
        "        if hash_token(token) == c.token_sha256:\n"
        "            return c.principal\n"
    ).body[0]
    assert isinstance(leaky, ast.FunctionDef)
    assert len(timing_problems(leaky)) == 3  # positive control: no compare_digest, ==, return
