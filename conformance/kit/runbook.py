"""The GPU runbook: the checks whose behaviour differs on a CUDA host, run on both vLLM model runners, with a
one-screen verdict to send back (``nox -s gpu``, or ``python -m conformance.kit.runbook`` in an installed stack).

On one CUDA GPU with no internet (the fixtures are built from registry packages the install already fetched):

1. the host: torch is a CUDA build, the card, the vLLM version (the newest the vllm-cuda extra allows, 0.30-0.33);
2. vLLM's own runner decision for the fixture model: Model Runner V2 is the CUDA default;
3. the adapter, repeat, rule-ended, parity, served and engine-core checks on V2 (the default), then again with
   ``VLLM_USE_V2_MODEL_RUNNER=0`` (V1), each in float32;
4. the dtype-dependent checks in bfloat16 (vLLM's low-precision rule instead of exact equality).

Each pass is one pytest process with its own JUnit file under ``reports/``; the verdict counts them, names every
failure, and is written to ``reports/gpu-verdict.txt``. A backend that is not installed (vLLM on a machine without
it) is left out of every pass and named in the verdict: such a run proves the HF side only.

>>> [p.name for p in plan_passes(("hf", "vllm"))]
['runner-v2-fp32', 'runner-v1-fp32', 'bf16']
>>> [p.name for p in plan_passes(("hf",))]
['hf-fp32', 'bf16']
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"
RUNNER_MARKER = "runner_dependent"
"""The marker of the checks that differ between the two model runners (processor interface, events, async
scheduling; the guard's vLLM plugin, whose ``EngineGuard`` takes Model Runner V2's path only on CUDA; the portable
sampler, whose draw runs in the V2 processor there and which is compared with Model Runner V2's own Gumbel sampler):
each module says so itself (``pytestmark``), the runbook names none."""
DTYPE_MARKER = "dtype_dependent"
"""The marker of the checks whose comparisons depend on the dtype (exact in float32, vLLM's rule below it)."""


@dataclass(frozen=True)
class Pass:
    name: str
    checks: tuple[str, ...]
    dtype: str
    env: dict[str, str] = field(default_factory=dict)
    marker: str | None = None
    """Run the checks carrying this marker (``checks`` empty: across the whole suite)."""


def plan_passes(backends: tuple[str, ...]) -> list[Pass]:
    """The passes for the installed ``backends``: both runners when vLLM is among them, else one fp32 pass."""
    if "vllm" in backends:
        passes = [Pass("runner-v2-fp32", (), "float32", {"VLLM_USE_V2_MODEL_RUNNER": "1"}, marker=RUNNER_MARKER),
                  Pass("runner-v1-fp32", (), "float32", {"VLLM_USE_V2_MODEL_RUNNER": "0"}, marker=RUNNER_MARKER)]
    else:
        passes = [Pass("hf-fp32", (), "float32", marker=RUNNER_MARKER)]
    return [*passes, Pass("bf16", (), "bfloat16", marker=DTYPE_MARKER)]


@dataclass
class Outcome:
    name: str
    seconds: float
    counts: dict[str, int]
    failures: list[str]
    exit_code: int


def read_junit(path: Path) -> tuple[dict[str, int], list[str]]:
    """(passed/failed/errors/skipped counts, one line per failure) from a pytest JUnit file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    if not path.is_file():
        return counts, ["no JUnit report: pytest did not finish"]
    for case in ET.parse(path).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
        counts[{"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[kind]] += 1
        if kind in ("failure", "error"):
            detail = next(c for c in case if c.tag == kind)
            first = (detail.get("message") or detail.text or "").strip().splitlines()[:1]
            failures.append(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}: "
                            f"{first[0][:160] if first else kind}")
    return counts, failures


def run_pass(p: Pass, *, backends: tuple[str, ...], extra: list[str], timeout: float | None = None) -> Outcome:
    junit = REPORTS / f"gpu-{p.name}.xml"
    junit.unlink(missing_ok=True)
    where = [f"conformance/{c}" for c in p.checks] or ["conformance"]
    args = [sys.executable, "-m", "pytest", *where, *(["-m", p.marker] if p.marker else []),
            f"--engine-backends={','.join(backends)}", f"--engine-require={','.join(backends)}",
            f"--engine-dtype={p.dtype}", f"--junitxml={junit}", "-q", "-p", "no:cacheprovider", *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **p.env}
    print(f"\n=== {p.name}: {' '.join(args[3:])}", flush=True)
    began = time.monotonic()
    process = subprocess.Popen(args, cwd=ROOT, env=env)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # interrupted like Ctrl-C: pytest still writes its JUnit file
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
    counts, failures = read_junit(junit)
    if timeout is not None and time.monotonic() - began >= timeout:
        failures.append(f"the pass ran out of its {timeout:.0f} s (--pass-timeout) and was interrupted")
    return Outcome(p.name, time.monotonic() - began, counts, failures, code)


def host_facts() -> list[str]:
    lines = []
    try:
        import torch

        cuda = torch.version.cuda
        card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
        memory = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB" if torch.cuda.is_available() \
            else "-"
        lines.append(f"torch {torch.__version__} (CUDA {cuda}); {card}, {memory}")
    except ImportError:
        lines.append("torch: not installed")
    try:
        import vllm

        lines.append(f"vllm {vllm.__version__}")
    except ImportError as err:
        lines.append(f"vllm: not installed ({err}); its passes are left out: this run proves the HF side only")
    import transformers

    lines.append(f"transformers {transformers.__version__}")
    return lines


def planned_runner() -> str:
    """vLLM's own runner decision for the SmolLM2 fixture ("v2 ..." expected on CUDA)."""
    try:
        from engine.backends.vllm.backend import predicted_runner
        from engine.config import ModelConfig
        from engine_fixtures import ensure

        plan = predicted_runner(ModelConfig(path=str(ensure("smollm2-135m-instruct")), dtype="float32"))
        return f"{plan.runner} (row rules: {plan.problem or 'supported'})"
    except Exception as err:  # the verdict must still come; the passes show the real error
        return f"not decided: {type(err).__name__}: {err}"


def passed(runner: str, outcomes: list[Outcome], *, expect_v2: bool) -> bool:
    """Every pass clean, and on a CUDA host with vLLM, V2 is vLLM's default runner (step 2)."""
    return all(o.exit_code == 0 and not o.failures for o in outcomes) and (not expect_v2 or runner.startswith("v2"))


def verdict(facts: list[str], runner: str, outcomes: list[Outcome], backends: tuple[str, ...], *,
            expect_v2: bool = False) -> list[str]:
    ok = passed(runner, outcomes, expect_v2=expect_v2)
    lines = ["GPU runbook verdict", *[f"  {f}" for f in facts], f"  vLLM runner planned by default: {runner}",
             f"  backends: {', '.join(backends)}", ""]
    if expect_v2 and not runner.startswith("v2"):
        lines.insert(-1, "  FAIL runner: a CUDA host with vLLM should plan Model Runner V2 by default")
    lines.append(f"  {'pass':<16}{'passed':>7}{'failed':>7}{'errors':>7}{'skipped':>8}{'seconds':>9}")
    for o in outcomes:
        c = o.counts
        lines.append(f"  {o.name:<16}{c['passed']:>7}{c['failed']:>7}{c['errors']:>7}{c['skipped']:>8}"
                     f"{o.seconds:>9.0f}")
    for o in outcomes:
        for failure in o.failures[:8]:
            lines.append(f"  FAIL {o.name}: {failure}")
        if len(o.failures) > 8:
            lines.append(f"  ... {len(o.failures) - 8} more in reports/gpu-{o.name}.xml")
    lines += ["", f"  VERDICT: {'PASS' if ok else 'FAIL'}"
                  f"{'' if 'vllm' in backends else ' (HF side only: vLLM is not installed here)'}",
              "  Send back reports/gpu-verdict.txt and the reports/gpu-*.xml files."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.kit.runbook", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="hf,vllm", help="backends to check (default: hf,vllm; a backend "
                                                              "that is not installed is left out and named)")
    parser.add_argument("--pass-timeout", type=float, default=None,
                        help="seconds each pass may run before it is interrupted and counted as failed (default: none)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    from conformance.kit.availability import unavailable_reason

    wanted = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    missing = [b for b in wanted if unavailable_reason(b)]
    backends = tuple(b for b in wanted if b not in missing)
    REPORTS.mkdir(exist_ok=True)
    facts = host_facts() + [f"left out (not installed): {b}" for b in missing]
    runner = planned_runner() if "vllm" in backends else "not decided: vLLM is not installed"
    from engine.backends.host import has_cuda

    expect_v2 = "vllm" in backends and has_cuda()
    outcomes = [run_pass(p, backends=backends, extra=args.pytest_args, timeout=args.pass_timeout)
                for p in plan_passes(backends)]
    lines = verdict(facts, runner, outcomes, backends, expect_v2=expect_v2)
    (REPORTS / "gpu-verdict.txt").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return 0 if passed(runner, outcomes, expect_v2=expect_v2) else 1


if __name__ == "__main__":
    sys.exit(main())
