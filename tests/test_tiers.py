"""The conformance suite's quick tier (``conformance.kit.tiers``): the pure rule on synthetic checks, and the real
collection of the suite, full and ``-m quick``, compared id by id."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conformance.kit.tiers import Check, missing_from_quick, quick_checks

ROOT = Path(__file__).resolve().parents[1]


def picked(checks):
    return [(c.function, c.params.get("backend"), c.params.get("reach"), c.params.get("x")) for c in
            quick_checks(checks)]


def test_each_function_runs_once_and_a_modules_backends_take_turns():
    checks = [Check(f"m::{f}", {"backend": b, "reach": r, "x": x})
              for f in "fgh" for r in ("served", "in-process") for x in (1, 2) for b in ("hf", "vllm", "llamacpp")]
    assert picked(checks) == [("m::f", "hf", "in-process", 1), ("m::g", "vllm", "in-process", 1),
                              ("m::h", "llamacpp", "in-process", 1)]


def test_after_a_first_turn_each_the_turns_go_where_they_cost_least():
    """HF costs 2.6 turns of the others (``TURN_COST``): seven functions give HF one, vLLM and llama.cpp three each."""
    checks = [Check(f"m::{f}", {"backend": b}) for f in "abcdefg" for b in ("hf", "vllm", "llamacpp")]
    backends = [b for _, b, _, _ in picked(checks)]
    assert backends == ["hf", "vllm", "llamacpp", "vllm", "llamacpp", "vllm", "llamacpp"]


def test_a_backend_the_turns_leave_out_of_a_module_gets_its_first_check_there():
    checks = [Check("m::f", {"backend": b}) for b in ("hf", "vllm", "llamacpp")] + [Check("n::g", {"backend": "hf"})]
    assert picked(checks) == [("m::f", "hf", None, None), ("m::f", "vllm", None, None),
                              ("m::f", "llamacpp", None, None), ("n::g", "hf", None, None)]


def test_a_turn_skips_a_backend_the_variant_lacks():
    checks = [Check("m::f", {"backend": "hf"}), Check("m::f", {"backend": "vllm"}), Check("m::g", {"backend": "hf"}),
              Check("m::h", {"backend": "hf"}), Check("m::h", {"backend": "vllm"})]
    assert picked(checks) == [("m::f", "hf", None, None), ("m::g", "hf", None, None), ("m::h", "vllm", None, None)]


def test_a_served_twin_is_quick_only_where_marked():
    checks = [Check("m::f", {"reach": "in-process"}), Check("m::f", {"reach": "served"}),
              Check("m::g", {"reach": "in-process"}, marked=True), Check("m::g", {"reach": "served"}, marked=True)]
    assert picked(checks) == [("m::f", None, "in-process", None), ("m::g", None, "in-process", None),
                              ("m::g", None, "served", None)]


def test_a_cross_backend_check_runs_once_and_each_function_is_its_own_group():
    checks = [Check("m::f", {"x": 1}), Check("m::f", {"x": 2}), Check("m::g", {"x": 1}), Check("n::f")]
    assert picked(checks) == [("m::f", None, None, 1), ("m::g", None, None, 1), ("n::f", None, None, None)]


def test_each_marked_representative_runs_once_on_the_next_backend_in_turn():
    checks = [Check("m::f", {"backend": b, "x": x}, marked=x > 1) for x in (1, 2, 3) for b in ("hf", "vllm")]
    assert picked(checks) == [("m::f", "hf", None, 2), ("m::f", "vllm", None, 3)]


def test_a_function_that_names_its_quick_backend_runs_there_and_takes_no_turn():
    checks = [Check(f"m::{f}", {"backend": b}, quick_on="llamacpp" if f == "g" else "")
              for f in "fgh" for b in ("hf", "vllm", "llamacpp")]
    assert picked(checks) == [("m::f", "hf", None, None), ("m::g", "llamacpp", None, None),
                              ("m::h", "vllm", None, None)]
    # a named backend this run does not collect: the turns choose, as for any function
    lacking = [Check("m::f", {"backend": b}, quick_on="llamacpp") for b in ("hf", "vllm")]
    assert picked(lacking) == [("m::f", "hf", None, None), ("m::f", "vllm", None, None)]


def test_what_the_quick_tier_leaves_out_is_named():
    full = [("m::f", ("hf",)), ("m::f", ("vllm",)), ("m::g", ("",))]
    assert missing_from_quick(full, full) == []
    assert missing_from_quick(full, [("m::f", ("vllm",)), ("m::g", ("",))]) == ["module m on hf"]
    assert missing_from_quick(full, [("m::f", ("hf",)), ("m::f", ("vllm",))]) == ["function m::g"]


PROBE = """
import json, sys, pytest
from conformance.kit.tiers import check_of
class Probe:
    def pytest_collection_finish(self, session):
        self.ids = [(c.function, list(c.spread())) for c in map(check_of, session.items)]
    def pytest_sessionfinish(self, session):
        tier = session.config.pluginmanager.get_plugin("engine-quick-tier")
        self.workload, self.gate_only = tier.workload.name, sorted(tier.gate_only)
probe = Probe()
code = pytest.main(["conformance", "--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[probe])
print("PROBE " + json.dumps([probe.workload, probe.ids, probe.gate_only]))
sys.exit(0 if code == 0 else code)
"""


def collected(*args: str) -> tuple[str, list[tuple[str, tuple[str, ...]]], list[str]]:
    """(the workload the run would use, its (function, backend) pairs, the functions left to the full gate) of a real
    collection with ``args``."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert done.returncode == 0 and line, f"collection failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr}"
    workload, ids, gate_only = json.loads(line.removeprefix("PROBE "))
    return workload, [(f, tuple(s)) for f, s in ids], gate_only


def test_the_collected_quick_tier_runs_every_check_function_and_meets_every_backend_in_each_module():
    """The suite as pytest collects it here (modules that need vLLM itself are collected by the conformance
    session's own check, ``conformance/test_tiers.py``): ``-m quick`` keeps every check function and every (module,
    backend) of the full gate, and leaves parametrizations out; it runs the quick workload, the full gate the full
    one."""
    full_workload, full, gate_only = collected()
    quick_workload, quick, _ = collected("-m", "quick")
    assert (full_workload, quick_workload) == ("full", "quick")
    assert len({f for f, _ in full}) >= 100, f"only {len(full)} checks collected: the probe saw too little"
    assert missing_from_quick(full, quick, gate_only) == []
    assert not {f for f, _ in quick} & set(gate_only), "a gate-only function runs in the quick tier"
    assert len(gate_only) <= 10, f"{len(gate_only)} check functions left to the full gate: CI would miss too much"
    assert len(quick) < len(full), f"the quick tier holds all {len(full)} checks: it leaves nothing to the full gate"
    # A parametrization marked quick (each hostile kind, on every backend's item) runs once, on one backend.
    from conformance.test_hostile import KINDS

    refused = "test_hostile.py::test_a_hostile_request_is_refused_by_name_and_the_next_one_answered"
    assert len([f for f, _ in quick if f.endswith(refused)]) == len(KINDS)


class Marked:
    """A collected item as ``check_of`` reads it: its node id, path and one mark."""

    def __init__(self, mark):
        self.nodeid, self.path, self.mark = "conformance/test_m.py::test_f", Path("test_m.py"), mark

    def get_closest_marker(self, name):
        return self.mark if self.mark is not None and self.mark.name == name else None


def test_a_gate_only_mark_needs_its_reason():
    import pytest

    from conformance.kit.tiers import check_of

    assert check_of(Marked(pytest.mark.gate_only(reason="test_g carries it").mark)).gate_only
    assert not check_of(Marked(None)).gate_only
    with pytest.raises(pytest.UsageError, match="needs reason"):
        check_of(Marked(pytest.mark.gate_only.mark))


def test_a_quick_on_mark_needs_one_backend_and_its_reason():
    import pytest

    from conformance.kit.tiers import check_of

    assert check_of(Marked(pytest.mark.quick_on("hf", reason="its server starts in 6 s").mark)).quick_on == "hf"
    assert check_of(Marked(None)).quick_on == ""
    for bad in (pytest.mark.quick_on("hf").mark, pytest.mark.quick_on(reason="why").mark,
                pytest.mark.quick_on("hf", "vllm", reason="why").mark):
        with pytest.raises(pytest.UsageError, match="needs one backend and reason"):
            check_of(Marked(bad))
