"""The session plan's declarations (``conformance/subjects/plan.py``): a check module without ``SUBJECTS`` fails
collection by name, every module of the suite declares one, and the plan counts each subject's users."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from conformance.kit.plugin import require_declarations
from conformance.subjects.plan import BUILT, Roles, Subject, engines, plan_lines, processes, servers, uses

ROOT = Path(__file__).resolve().parents[1]


def item(name: str, subjects: object) -> SimpleNamespace:
    module = ModuleType(f"conformance.{name}")
    if subjects is not None:
        module.SUBJECTS = subjects
    return SimpleNamespace(module=module, path=Path(f"conformance/{name}.py"))


def test_a_module_without_subjects_fails_collection_naming_it():
    require_declarations([item("test_a", uses(engines()))])
    with pytest.raises(pytest.UsageError, match=r"^test_b.py, test_c.py: no SUBJECTS; fix: declare"):
        require_declarations([item("test_a", uses()), item("test_c", None), item("test_b", None)])


def test_a_model_tier_marks_a_module_never_a_check_and_names_a_known_tier():
    """The ``engine``/``engines`` fixtures are module-scoped: a check-level ``model_tier`` mark, or an unknown tier,
    fails collection by name."""
    on_check = item("test_a", uses(engines()))
    on_check.nodeid, on_check.own_markers = "conformance/test_a.py::test_x[hf]", [pytest.mark.model_tier("tiny").mark]
    with pytest.raises(pytest.UsageError, match=r"^conformance/test_a.py::test_x: model_tier marks a check; fix: "):
        require_declarations([on_check])
    unknown = item("test_b", uses(engines()))
    unknown.module.pytestmark = [pytest.mark.model_tier("huge")]
    with pytest.raises(pytest.UsageError, match=r"^conformance.test_b: model_tier\('huge'\).*\['text', 'tiny'\]"):
        require_declarations([unknown])
    tiny = item("test_c", uses(engines("tiny")))
    tiny.module.pytestmark = [pytest.mark.model_tier("tiny")]
    require_declarations([tiny])


def test_every_check_module_of_the_suite_declares_its_subjects():
    """Read, not imported (some need vLLM, absent from the tests' venv): each holds ``SUBJECTS = uses(...)`` at
    module level; the conformance run builds them at collection."""
    lacking = []
    modules = sorted((ROOT / "conformance").glob("test_*.py"))
    for path in modules:
        tree = ast.parse(path.read_text())
        declared = [node for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "SUBJECTS" for t in node.targets)
                    and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "uses"]
        if not declared:
            lacking.append(path.name)
    assert len(modules) > 30 and lacking == []


def test_declarations_refuse_what_cannot_be_planned():
    with pytest.raises(ValueError, match=r"processes\('curl'\): not a census kind; fix: one of \["):
        processes("curl", why="a client")
    with pytest.raises(ValueError, match=r"any_config accepts every load already; fix: drop \['hf'\]"):
        engines("text", any_config="sweeps", hf={"max_batch_size": 2})
    with pytest.raises(TypeError, match="is not a subject"):
        uses("text")  # type: ignore[arg-type]


def test_a_subject_matches_its_model_and_the_settings_it_names():
    declared = engines("tiny-looper", model={"checkpoint_eos": True})
    assert declared.matches("engine", "tiny-looper", {"model": {"checkpoint_eos": True}})
    assert declared.matches("engine", "tiny-looper", {"model": {"checkpoint_eos": True, "dtype": "float32"}})
    assert not declared.matches("engine", "tiny-looper", {})  # the section it names is missing
    assert not declared.matches("engine", "tiny-looper", {"model": {"checkpoint_eos": False}})
    assert not declared.matches("engine", "tiny-looper", {"model": {"checkpoint_eos": True}, "hf": {}})  # one more
    assert not declared.matches("server", "tiny-looper", {"model": {"checkpoint_eos": True}})
    assert servers(BUILT, any_config="each check builds its own").matches("server", BUILT, {"hf": {"x": 1}})
    assert Roles(text="/f/smol", vlm="/f/vl", fixtures="/f").of("/f/smol-gguf") == "smol-gguf"
    assert isinstance(declared, Subject)


def test_the_plan_lists_each_subject_once_with_its_users_in_run_order():
    a, b = uses(engines(), servers()), uses(servers())
    lines = plan_lines([("test_b.py", b), ("test_a.py", a), ("test_b.py", b)])
    assert lines == ["session plan: 2 subjects for 3 checks in 2 modules",
                     "  server text: 3 checks in 2 modules: test_b.py (2), test_a.py (1)",
                     "  engine text: 1 checks in 1 modules: test_a.py (1)"]


class Stoppable:
    """A running server as the server pool holds one: ``stop()`` is all the release path calls."""

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_the_pool_stops_what_the_plan_says_is_done_on_that_backend_only():
    """``ServerPool.release`` stops a backend's servers of the declared configuration and no other: the text server of
    HF, not HF's processed-logprobs server, not vLLM's text server; then the processed one by its own declaration."""
    from conformance.subjects.bill import Bill
    from conformance.subjects.servers import ServerPool

    def configure(backend, path, /, model=None):
        return {"backend": backend, "model": {"path": path, **(model or {})}, "vllm": {"max_num_seqs": 16}}

    bill = Bill(roles=Roles(text="/m/smol", vlm="/m/vl", fixtures="/m"))
    pool = ServerPool(SimpleNamespace(model="/m/smol"), configure=configure, bill=bill)
    running = {}
    for backend, sections in [("hf", {}), ("hf", {"model": {"logprobs_mode": "processed_logprobs"}}), ("vllm", {})]:
        key, _ = pool.served_config(backend, "/m/smol", **sections)
        running[(backend, str(sections))] = pool._servers[key] = Stoppable()
    assert pool.release("hf", servers("text")) == ["server hf smol"]
    assert [k for k, s in running.items() if s.stopped] == [("hf", "{}")]
    processed = servers("text", model={"logprobs_mode": "processed_logprobs"})
    assert pool.release("hf", processed) == ['server hf smol {"model": {"logprobs_mode": "processed_logprobs"}}']
    assert pool.release("vllm", processed) == [] and not running[("vllm", "{}")].stopped
    assert pool.release("hf", servers("text")) == []  # stopped already: nothing left to stop


def test_an_any_config_release_leaves_the_servers_a_later_check_declares():
    """An adapter module declares ``servers("text", any_config=...)``, which matches the plain text server too: its
    release stops its own servers but leaves the plain one that a later check (the SIGTERM check, last of all) is
    handed, and its served twins run after the plain server's users (group 2), so those never start twice."""
    from conformance.subjects.bill import Bill
    from conformance.subjects.plan import last_users, served_group, spared
    from conformance.subjects.servers import ServerPool

    def configure(backend, path, /, model=None):
        return {"backend": backend, "model": {"path": path, **(model or {})}, "vllm": {"max_num_seqs": 16}}

    any_text, text = servers("text", any_config="its adapters at start"), servers("text")
    assert served_group(uses(any_text)) > served_group(uses(text))
    releases = last_users([("test_adapters.py::t[hf]", ["hf"], uses(any_text), ()),
                           ("test_hostile.py::sigterm[hf]", ["hf"], uses(text), ())])
    spare = spared(releases)
    assert spare == {("test_adapters.py::t[hf]", "hf"): (text,)}

    bill = Bill(roles=Roles(text="/m/smol", vlm="/m/vl", fixtures="/m"))
    pool = ServerPool(SimpleNamespace(model="/m/smol"), configure=configure, bill=bill)
    running = {}
    for sections in ({}, {"model": {"adapters": {"r8": "/a/r8"}}}):
        key, _ = pool.served_config("hf", "/m/smol", **sections)
        running[str(sections)] = pool._servers[key] = Stoppable()
    stopped = pool.release("hf", any_text, spare[("test_adapters.py::t[hf]", "hf")])
    assert stopped == ['server hf smol {"model": {"adapters": {"r8": "/a/r8"}}}']
    assert not running["{}"].stopped
    assert pool.release("hf", any_text) == ["server hf smol"]  # nothing spared: every text server is its
