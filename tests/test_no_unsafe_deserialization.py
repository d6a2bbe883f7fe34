"""No pickle, torch.load, marshal, eval or exec anywhere in kvshare's own code (control C16).

Pickle-based KV transports gave remote code execution to whoever could write to the
wire or the store (vLLM GHSA-x3m8-f7g5-qhm7, lmdeploy #4804, LightLLM CVE-2026-26220).
kvshare moves blocks as a fixed header plus raw tensor bytes and reads configs as TOML,
so none of these APIs is needed; this scan keeps it so. It parses the source with `ast`
(nothing is imported), so a forbidden name in a comment or string does not count and an
aliased import (`import pickle as p`) still does.

`multiprocessing` pickles every object it sends between processes. It is allowed only in
the demo and bench tools, which talk to child processes they spawned themselves over
anonymous pipes; never in the server, the policy code or the agent's data path.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("kvshare", "cacheserver", "replica_agent", "policy", "scripts", "benchmarks")
UNSAFE_MODULES = frozenset(
    {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "jsonpickle", "shelve", "marshal"}
    | {"joblib", "torch.serialization"}
)
UNSAFE_BUILTINS = frozenset({"eval", "exec"})
# Attribute uses that load code or pickles: torch.load, torch.jit.load, pandas.read_pickle,
# yaml.load / yaml.unsafe_load (yaml.safe_load is fine).
UNSAFE_ATTRIBUTES = {("torch", "load"), ("jit", "load"), ("yaml", "load"), ("yaml", "unsafe_load")}
UNSAFE_ANY_OWNER = frozenset({"read_pickle"})
MULTIPROCESSING_ALLOWED = {
    "kvshare/bench/worker.py": "bench workers: spawned children, anonymous Pipe",
    "kvshare/demo/runner.py": "demo replicas: spawned children, anonymous Pipe",
    "kvshare/demo/replica.py": "demo replica side of that Pipe",
}


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def find_unsafe(source: str, path: str = "<source>") -> list[str]:
    """`path:line: what` for every unsafe use in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        found += [f"{path}:{getattr(node, 'lineno', 0)}: {what}" for what in _unsafe(node, path)]
    return found


def _unsafe(node: ast.AST, path: str) -> list[str]:
    uses = []
    for name in _imported(node):
        root = name.split(".")[0]
        if name in UNSAFE_MODULES or root in UNSAFE_MODULES:
            uses.append(f"imports {name}")
        elif root == "multiprocessing" and path not in MULTIPROCESSING_ALLOWED:
            uses.append(f"imports {name} (pickles; demo and bench tools only)")
        elif name in ("torch.load", "torch.jit.load"):
            uses.append(f"imports {name}")
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in UNSAFE_BUILTINS
    ):
        uses.append(f"calls {node.func.id}()")
    if isinstance(node, ast.Attribute):
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else None
        owner = node.value.id if isinstance(node.value, ast.Name) else owner
        if (owner, node.attr) in UNSAFE_ATTRIBUTES or node.attr in UNSAFE_ANY_OWNER:
            uses.append(f"uses {owner}.{node.attr}")
    if (
        isinstance(node, ast.keyword)
        and node.arg == "allow_pickle"
        and not (isinstance(node.value, ast.Constant) and node.value.value is False)
    ):
        uses.append("passes allow_pickle")
    return uses


def project_sources() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS for p in (REPO / root).rglob("*.py"))


def test_project_source_has_no_unsafe_deserialization() -> None:
    sources = project_sources()
    assert len(sources) > 50  # control: the scan really covers the project
    found = []
    for path in sources:
        relative = path.relative_to(REPO).as_posix()
        found += find_unsafe(path.read_text(encoding="utf-8"), relative)
    assert not found, "unsafe deserialization or code execution:\n" + "\n".join(found)


def test_the_scanner_finds_each_forbidden_use() -> None:
    """Positive control: every forbidden form is reported, and harmless look-alikes are not."""
    unsafe = """
import pickle
import marshal as m
from dill import loads
import torch
import numpy as np
import yaml
import multiprocessing
from torch.serialization import load
torch.load(f)
torch.jit.load(f)
np.load(f, allow_pickle=True)
yaml.load(text)
df = pd.read_pickle(f)
eval(text)
exec(code)
"""
    found = find_unsafe(unsafe, "replica_agent/agent.py")
    expected = ["pickle", "marshal", "dill", "multiprocessing", "torch.serialization"]
    expected += ["torch.load", "jit.load", "allow_pickle", "yaml.load", "read_pickle"]
    expected += ["eval()", "exec()"]
    for what in expected:
        assert any(what in line for line in found), f"the scanner missed {what}: {found}"
    harmless = """
import json, tomllib
model.eval()
np.load(f, allow_pickle=False)
yaml.safe_load(text)
text = "pickle.loads(torch.load(eval('x')))"
"""
    assert find_unsafe(harmless) == []


def test_the_multiprocessing_allowlist_is_current() -> None:
    """Each allowed file exists and still needs the exception, so the list cannot rot."""
    for path in MULTIPROCESSING_ALLOWED:
        source = (REPO / path).read_text(encoding="utf-8")
        imports = [n for node in ast.walk(ast.parse(source)) for n in _imported(node)]
        assert any(name.split(".")[0] == "multiprocessing" for name in imports), path
