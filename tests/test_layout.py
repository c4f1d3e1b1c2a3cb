"""The house rules of ``engine/``: backend facts come from one registry of specs, modules import each other
without cycles, and the config stays data (it imports no backend, plugin or serving code)."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import pytest

from engine.backends import load_target
from engine.backends.base import AsyncGenerating, AsyncScoring, Scoring, TokenStreaming, WeightLoading
from engine.backends.registry import SPECS

ENGINE = Path(__file__).resolve().parents[1] / "engine"


def module_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function bodies too), except under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                self.generic_visit(node)
            else:
                for child in node.orelse:
                    self.visit(child)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    return found


def engine_modules() -> dict[str, Path]:
    modules = {}
    for path in ENGINE.rglob("*.py"):
        parts = path.relative_to(ENGINE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def packages_above(name: str, modules: Collection[str]) -> set[str]:
    """The packages Python runs before module ``name`` (``a.b`` and ``a`` for ``a.b.c``), those in ``modules``."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))} & set(modules)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it makes Python run: each it imports, and each package above those (an import
    of ``engine.backends.registry`` runs ``engine/backends/__init__.py`` first), less the packages above itself
    (already running when it is)."""
    modules = engine_modules()
    graph = {}
    for name, path in modules.items():
        reached = {m for m in module_imports(path) if m in modules}
        reached |= {package for m in reached for package in packages_above(m, modules)}
        graph[name] = reached - {name} - packages_above(name, modules)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_in_the_library():
    """Lazy imports count too: a cycle hidden in a function body is still two modules that need each other."""
    graph = import_graph()
    assert len(graph) > 80 and graph["engine.engine"]  # the scan really read the package
    assert cycles(graph) == []


def test_the_scan_finds_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_package_init_is_counted_as_a_module_its_importers_run():
    """The cycle this caught: ``engine.config`` -> ``engine.backends.registry`` runs ``engine/backends/__init__.py``,
    which imported the contract, which imports ``engine.config`` back."""
    assert packages_above("engine.backends.registry", {"engine", "engine.backends", "x"}) == {"engine",
                                                                                              "engine.backends"}
    graph = {"p": {"p.base"}, "p.base": {"q"}, "p.registry": set(), "q": {"p.registry"}}
    with_packages = {n: ({*e, *(a for m in e for a in packages_above(m, graph))} - packages_above(n, graph))
                     for n, e in graph.items()}
    assert cycles(graph) == [] and cycles(with_packages) == [["p", "p.base", "q"]]


def test_import_engine_config_runs_no_backend_module():
    """The config is data: importing it runs the registry of backend facts (pure data) and no module of any backend
    or of their contract (``engine.backends.base``), and nothing of plugins, serving or the engine."""
    import subprocess
    import sys

    code = "import sys, engine.config; print(' '.join(sorted(m for m in sys.modules if m.startswith('engine'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "engine.config.engine_config" in loaded and "engine.backends.registry" in loaded  # it did import them
    strays = [m for m in loaded if m.startswith(("engine.backends.", "engine.plugins", "engine.serve", "engine.engine"))
              and m != "engine.backends.registry"]
    assert strays == [], f"import engine.config ran {strays}"


def test_config_is_data():
    """Config modules import validation, errors and rule data only: no backend, plugin, serving or engine code
    (the registry of specs is pure data and may be read)."""
    allowed = ("engine.config", "engine.errors", "engine.rules.repeat", "engine.backends.registry")
    graph = import_graph()
    on_the_way = {package for m in allowed for package in packages_above(m, graph)}  # their packages' __init__s
    for name, imports in graph.items():
        if name.startswith("engine.config"):
            strays = sorted(m for m in imports if not m.startswith(allowed) and m not in on_the_way)
            assert strays == [], f"{name} imports {strays}"


def test_registry_imports_nothing_of_the_project_at_module_level():
    tree = ast.parse((ENGINE / "backends" / "registry.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and not (n.module or "").startswith("engine") for n in top)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_spec_names_a_class_that_agrees_with_it(name):
    spec = SPECS[name]
    targets = [spec.target, *([spec.async_target] if spec.async_target else [])]
    for target in targets:
        cls = load_target(target)  # a backend module imports no heavy package at module level
        assert cls.name == name and cls.declared_hooks == spec.hooks
        assert spec.logits_hook in spec.hooks
    assert spec.model_format in ("hf", "gguf")


def test_optional_protocols_match_what_each_backend_implements():
    hf, vllm, vllm_async, llamacpp = (load_target(t) for t in (
        SPECS["hf"].target, SPECS["vllm"].target, SPECS["vllm"].async_target, SPECS["llamacpp"].target))
    assert [issubclass(c, Scoring) for c in (hf, vllm, vllm_async, llamacpp)] == [True, True, True, False]
    assert [issubclass(c, AsyncScoring) for c in (hf, vllm, vllm_async, llamacpp)] == [False, False, True, False]
    assert [issubclass(c, AsyncGenerating) for c in (hf, vllm, vllm_async, llamacpp)] == [False, False, True, False]
    assert [issubclass(c, TokenStreaming) for c in (hf, vllm, vllm_async, llamacpp)] == [False, False, True, False]
    assert [issubclass(c, WeightLoading) for c in (hf, vllm, vllm_async, llamacpp)] == [True, False, True, False]


def test_async_target_is_chosen_by_the_settings():
    from engine.config import VllmConfig

    vllm = SPECS["vllm"]
    assert vllm.target_for(VllmConfig(async_engine=True)) == vllm.async_target
    assert vllm.target_for(VllmConfig()) == vllm.target
    assert vllm.engine_core_in_child(VllmConfig(multiprocessing=True))
    assert not vllm.engine_core_in_child(VllmConfig())


def test_every_file_docs_layout_names_exists():
    """docs/layout.md is the newcomer's map: every ``*.py`` file and folder it names in backquotes exists (by its
    path, or by its name somewhere in the repository), so a moved or deleted file cannot stay on the map."""
    import re
    import subprocess

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "layout.md").read_text()
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    names = {Path(f).name for f in tracked} | {p.name for f in tracked for p in Path(f).parents}
    paths = set(tracked) | {str(p) for f in tracked for p in Path(f).parents}
    missing = []
    for token in re.findall(r"`([A-Za-z0-9_./*-]+?(?:\.py|/))`", text):
        token = token.rstrip("/")
        if "*" in token or token.startswith("/") or token in paths or Path(token).name in names:  # /infer/: a route
            continue
        missing.append(token)
    assert not missing, f"docs/layout.md names what the repository does not hold: {sorted(set(missing))}"


def engine_section_paths() -> set[str]:
    """The ``*.py`` paths docs/layout.md's ``engine/`` section names in backquotes (paths under ``engine/``)."""
    import re

    text = (ENGINE.parent / "docs" / "layout.md").read_text()
    section = text.split("## `engine/`, the library", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([A-Za-z0-9_./]+\.py)`", section))


def modules_the_map_must_name() -> set[str]:
    """Every module of ``engine/`` by its path under it; a package ``__init__.py`` only where it holds code (a
    function or a class), else its folder's row stands for it."""
    named = set()
    for path in ENGINE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        holds_code = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body)
        if path.name != "__init__.py" or holds_code:
            named.add(str(path.relative_to(ENGINE)))
    return named


def test_the_layout_map_names_every_engine_module_by_its_path_and_nothing_else():
    """Both ways: a module the map does not name fails (a newcomer could not find it), and so does a named path that
    does not exist (a moved or deleted file cannot stay on the map)."""
    named, modules = engine_section_paths(), modules_the_map_must_name()
    assert len(modules) > 130 and "backends/hf/rules.py" in modules  # the scan really read the package
    unnamed = sorted(modules - named)
    outside = {p for p in named if p.startswith("tests/")}  # the house rules' own file, named beside them
    gone = sorted(p for p in named - outside if not (ENGINE / p).is_file())
    gone += sorted(p for p in outside if not (ENGINE.parent / p).is_file())
    assert unnamed == [], f"docs/layout.md's engine/ section does not name {unnamed}: add each by its path"
    assert gone == [], f"docs/layout.md's engine/ section names what engine/ does not hold: {gone}"


def test_no_function_of_the_served_engine_is_over_60_lines():
    """Routes only route: a route hands its parsed call to its wire format's answer, and the route tables are data;
    a route factory that grew its handlers inside it again (the 110-line ``router`` this replaced) fails here."""
    long = []
    for path in (ENGINE / "serve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ENGINE)}::{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], f"functions over 60 lines in engine/serve/: {long}"


def test_the_configs_backend_sections_are_the_registrys():
    """The registry is the one list of backends: each built-in's settings section is a section of ``EngineConfig``,
    and every backend section ``EngineConfig`` holds (a ``*Config`` of ``engine_config.py`` that is not the model's or
    the serve's) belongs to a registered backend, so a backend added to one and not the other fails here."""
    import dataclasses

    from engine.backends.registry import BUILT_IN, settings_section
    from engine.config import EngineConfig

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    sections = {settings_section(name) for name in BUILT_IN}
    assert sections <= set(fields), f"registered backends without a config section: {sorted(sections - set(fields))}"
    backend_like = {name for name, f in fields.items() if str(f.type).endswith("Config") and str(f.type) not in
                    ("ModelConfig", "ServeConfig", "RepeatTerminateConfig")}
    assert backend_like == sections, f"config sections that name no registered backend: {backend_like - sections}"
