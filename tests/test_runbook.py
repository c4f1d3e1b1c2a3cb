"""The GPU runbook's plan and verdict (the passes themselves run the conformance suite on a GPU runner)."""

from __future__ import annotations

from pathlib import Path

from conformance.kit.runbook import DTYPE_MARKER, RUNNER_MARKER, Outcome, plan_passes, read_junit, verdict

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="conformance.test_parity" name="test_a[hf]"/>
<testcase classname="conformance.test_parity" name="test_b[vllm]"><failure message="assert 1 == 2"/></testcase>
<testcase classname="conformance.test_served" name="test_c"><skipped message="no"/></testcase>
<testcase classname="conformance.test_served" name="test_d"><error message="fixture broke">y</error></testcase>
</testsuite></testsuites>"""


def test_both_runners_then_bf16_when_vllm_is_installed():
    passes = plan_passes(("hf", "vllm"))
    assert [p.env.get("VLLM_USE_V2_MODEL_RUNNER") for p in passes] == ["1", "0", None]
    assert [(p.checks, p.marker) for p in passes] == [((), RUNNER_MARKER)] * 2 + [((), DTYPE_MARKER)]
    assert [p.dtype for p in passes] == ["float32", "float32", "bfloat16"]


def test_the_runner_dependent_checks_carry_the_marker_the_runner_passes_select():
    """The runbook's two runner passes select by marker (it names no check): the modules whose path differs between
    vLLM's model runners must carry it."""
    suite = Path(__file__).resolve().parents[1] / "conformance"
    marked = {f.name for f in suite.glob("test_*.py") if f"pytest.mark.{RUNNER_MARKER}" in f.read_text()}
    assert marked == {"test_vllm_adapters.py", "test_vllm_plugin.py", "test_repeat.py", "test_rule_ends.py",
                      "test_parity.py", "test_served.py", "test_engine_core_process.py", "test_structured_rules.py",
                      "test_portable_sampler.py"}


def test_the_dtype_dependent_checks_carry_the_marker_the_bf16_passes_select():
    """The bf16 pass of the runbook and of CI (nox -s conformance-bf16) select by marker: every module whose
    comparisons depend on the dtype must carry it, or that pass silently leaves it out."""
    suite = Path(__file__).resolve().parents[1] / "conformance"
    marked = {f.name for f in suite.glob("test_*.py") if f"pytest.mark.{DTYPE_MARKER}" in f.read_text()}
    assert marked == {"test_parity.py", "test_batch_invariance.py", "test_rule_ends.py", "test_repeat.py",
                      "test_stop.py", "test_sampling.py", "test_structured_rules.py", "test_portable_sampler.py"}
    assert f'"{DTYPE_MARKER}: ' in (suite.parent / "pyproject.toml").read_text()


def test_junit_counts_and_failures(tmp_path):
    (tmp_path / "r.xml").write_text(JUNIT)
    counts, failures = read_junit(tmp_path / "r.xml")
    assert counts == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert failures == ["test_parity::test_b[vllm]: assert 1 == 2", "test_served::test_d: fixture broke"]
    assert read_junit(tmp_path / "absent.xml")[1] == ["no JUnit report: pytest did not finish"]


def test_the_verdict_fails_on_any_failure_and_says_when_only_hf_ran():
    good = Outcome("hf-fp32", 12.0, {"passed": 3, "failed": 0, "errors": 0, "skipped": 0}, [], 0)
    bad = Outcome("bf16", 5.0, {"passed": 2, "failed": 1, "errors": 0, "skipped": 0}, ["t::x: boom"], 1)
    assert verdict(["torch"], "v2", [good], ("hf",))[-2].strip() == "VERDICT: PASS (HF side only: vLLM is not " \
                                                                    "installed here)"
    lines = verdict(["torch"], "v2", [good, bad], ("hf", "vllm"))
    assert "  VERDICT: FAIL" in lines and "  FAIL bf16: t::x: boom" in lines


def test_a_cuda_host_with_vllm_must_plan_v2():
    clean = Outcome("runner-v2-fp32", 9.0, {"passed": 3, "failed": 0, "errors": 0, "skipped": 0}, [], 0)
    lines = verdict(["torch"], "v1 (row rules: supported)", [clean], ("hf", "vllm"), expect_v2=True)
    assert "  VERDICT: FAIL" in lines and any("should plan Model Runner V2" in line for line in lines)
    assert "  VERDICT: PASS" in verdict(["torch"], "v2 (row rules: supported)", [clean], ("hf", "vllm"),
                                        expect_v2=True)
