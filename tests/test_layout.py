"""The folder layout is the architecture: these rules keep it so (docs/ARCHITECTURE.md).

Every import in every module counts, function-local and TYPE_CHECKING ones included, because a
lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("conductor", "prefill", "decode", "messenger", "store", "kv_connector")
PROJECT = ("mooncake", *COMPONENTS)
# The composition root: the command line and the single-machine launcher start components.
COMPOSITION_ROOT = {"mooncake/cli.py", "mooncake/launcher.py"}


def imports_of(path: Path) -> set[str]:
    """Top-level package names plus full dotted names of everything `path` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def top(name: str) -> str:
    return name.split(".", 1)[0]


def violations(package: str, forbidden, skip=frozenset()) -> list[str]:
    found = []
    for path in modules(package):
        if rel(path) in skip:
            continue
        for name in sorted(imports_of(path)):
            if forbidden(name):
                found.append(f"{rel(path)} imports {name}")
    return found


def test_base_imports_no_component():
    assert violations("mooncake", lambda n: top(n) in COMPONENTS, skip=COMPOSITION_ROOT) == []


def test_prefill_and_decode_do_not_import_each_other():
    assert violations("prefill", lambda n: top(n) == "decode") == []
    assert violations("decode", lambda n: top(n) == "prefill") == []


def test_conductor_imports_no_worker_messenger_or_store_code():
    forbidden = {"prefill", "decode", "messenger", "store", "kv_connector"}
    assert violations("conductor", lambda n: top(n) in forbidden or n.startswith("mooncake.engine")) == []


def test_conductor_serving_path_imports_nothing_of_vllm():
    # The profiler drives a real engine on purpose; everything else serves requests or simulates.
    offline = {rel(p) for p in modules("conductor/profile")}
    assert violations("conductor", lambda n: top(n) == "vllm", skip=offline) == []


def test_messenger_imports_no_project_code():
    # It moves bytes: nothing of KV, the protocol or any component.
    assert violations("messenger", lambda n: top(n) in PROJECT and top(n) != "messenger") == []


def test_store_imports_no_role_or_conductor():
    assert violations("store", lambda n: top(n) in {"conductor", "prefill", "decode", "kv_connector"}) == []


def test_only_the_connector_composes_both_halves():
    both = []
    for package in PROJECT:
        for path in modules(package):
            tops = {top(n) for n in imports_of(path)}
            if {"prefill", "decode"} <= tops and rel(path) not in COMPOSITION_ROOT:
                both.append(rel(path))
    assert all(p.startswith("kv_connector/") for p in both), both


def test_our_connector_class_does_not_clash_with_vllm_builtin():
    names = {node.name for p in modules("kv_connector") for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.ClassDef)}
    assert "MooncakeServeConnector" in names and "MooncakeConnector" not in names


@pytest.mark.parametrize("rule", [test_base_imports_no_component, test_messenger_imports_no_project_code])
def test_rules_can_fail(tmp_path, monkeypatch, rule):
    """A planted violation is caught, so a passing rule means something."""
    package = "mooncake" if rule is test_base_imports_no_component else "messenger"
    (tmp_path / package).mkdir()
    (tmp_path / package / "bad.py").write_text("def f():\n    from conductor.app import create_app\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError):
        rule()
