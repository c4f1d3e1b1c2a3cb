"""The quick tier over this session's own collection: every check function keeps one parametrization in ``-m quick``
(but those marked ``gate_only``, with their reasons), and every module meets every backend it has
(``conformance.kit.tiers``). ``tests/test_tiers.py`` runs pytest's real ``-m quick`` collection; this check sees the
modules only the conformance venv can import (vLLM's own)."""

from __future__ import annotations

from conformance.kit.tiers import missing_from_quick
from conformance.subjects.plan import uses

SUBJECTS = uses()


def test_every_collected_check_function_runs_in_the_quick_tier(pytestconfig, summary_note):
    tier = pytestconfig.pluginmanager.get_plugin("engine-quick-tier")
    full = [(c.function, c.spread()) for c in tier.checks]
    quick = [(c.function, c.spread()) for c in tier.quick]
    assert full, "the tier plugin saw no collection"
    assert missing_from_quick(full, quick, tier.gate_only) == []
    functions = {f for f, _ in full}
    summary_note(f"quick tier: {len(quick)} of {len(full)} collected checks, {len(functions) - len(tier.gate_only)} "
                 f"of {len(functions)} check functions, each once (per-backend ones on the module's backends in turn; "
                 f"served twins where marked; {len(tier.gate_only)} left to the full gate: "
                 f"{', '.join(sorted(tier.gate_only))})")
