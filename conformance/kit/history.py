"""Compare two runs' outputs records (``conformance/kit/outputs.py``): what a release, an upgrade or a new stack
changed in what the checks saw, case by case, named by the first layer that differs (``conformance/kit/layers.py``).

    python -m conformance.kit.history compare OLD NEW            # exit 1 on a change no entry accepts
    python -m conformance.kit.history compare OLD NEW --accept --reason "transformers 5.18 renders ..."

Every check x subject x case of the two records is ``equal``, ``changed`` (with its first layer and what differs
there), ``new`` (only NEW asked it) or ``gone`` (NEW ran the check but no longer asked it); cases of checks NEW did
not run at all (the quick tier against a full record, another shard) are counted as ``not run``. Only ``changed``
fails: a case is keyed by the question, so a new or gone case is a change of the suite's own code, which its review
sees, while a change of the stack moves an answer to the same question.

Accepting works like a snapshot update: ``--accept --reason TEXT`` writes one entry per unaccepted change (check,
subject, case, layer, a digest of the new answer, the reason) into the accepted-changes file, a file that lives in the
repository (``conformance/baselines/accepted.json`` by default) and is reviewed with the change. A later compare
passes a change that matches an entry: the same case, the same layer and the same new answer; the next different
answer fails again.

>>> row = {"check": "c", "subject": "hf", "case": "k-0/0", "error": "", "prompt_text": "p", "prompt_ids": [1],
...        "ids": [5, 2], "top_ids": [], "top_logprobs": [], "finish_reason": "stop", "stop_reason": "2",
...        "text": "a", "raw_text": "a</s>", "meta": "{}"}
>>> result = compare([row], [dict(row, ids=[5, 2, 2])])
>>> [(c.status, c.layer) for c in result.changes], result.failing()
([('changed', 'ending')], 1)
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.kit.layers import LAYERS, bound_for, first_layer
from conformance.kit.outputs import FIELDS, digest, read_all

ACCEPTED = Path(__file__).resolve().parents[1] / "baselines" / "accepted.json"
"""The repository's accepted changes (``--accepted`` names another)."""
OUTPUT_FIELDS = tuple(name for name in FIELDS if name not in ("check", "subject", "case", "request", "call"))
STATUSES = ("equal", "changed", "new", "gone", "not run")
SHOWN = 200
"""Changes listed one by one in the Markdown and the page (the summary counts all of them)."""


@dataclass(frozen=True)
class Change:
    """One case that is not equal: its status, and for ``changed`` the first layer, what differs there, and the
    new answer's digest (what an acceptance entry matches)."""

    check: str
    subject: str
    case: str
    status: str
    layer: str = ""
    detail: str = ""
    answer: str = ""
    accepted: str = ""
    """The reason of the acceptance entry that matches it ('' when none does)."""

    def key(self) -> tuple[str, str, str]:
        return self.check, self.subject, self.case


@dataclass
class Comparison:
    """The result of :func:`compare`: the counts by status and every case that is not equal."""

    counts: Counter[str] = field(default_factory=Counter)
    changes: list[Change] = field(default_factory=list)
    old_run: dict[str, Any] = field(default_factory=dict)
    new_run: dict[str, Any] = field(default_factory=dict)

    def failing(self) -> int:
        """Changes no acceptance entry matches: what makes the compare fail."""
        return sum(1 for c in self.changes if c.status == "changed" and not c.accepted)

    def by_layer(self) -> Counter[str]:
        return Counter(c.layer for c in self.changes if c.status == "changed")

    def stack_differences(self) -> list[str]:
        """What differs between the two runs' stacks: package versions, fixture content, dtype, device, ISA."""
        old, new = self.old_run, self.new_run
        lines = []
        for group in ("versions", "fixtures"):
            a, b = old.get(group, {}), new.get(group, {})
            for name in sorted(set(a) | set(b)):
                if a.get(name) != b.get(name):
                    lines.append(f"{group[:-1] if group == 'versions' else 'fixture'} {name}: "
                                 f"{a.get(name) or '-'} -> {b.get(name) or '-'}")
        for name in ("dtype", "device", "isa", "cpu", "tier", "model"):
            if old.get(name) != new.get(name):
                lines.append(f"{name}: {old.get(name) or '-'} -> {new.get(name) or '-'}")
        return lines


def answer_digest(row: Mapping[str, Any]) -> str:
    return digest({name: row.get(name) for name in OUTPUT_FIELDS})


def compare(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]], *, bound: float | None = None,
            accepted: Sequence[Mapping[str, Any]] = (), old_run: dict[str, Any] | None = None,
            new_run: dict[str, Any] | None = None) -> Comparison:
    """Every case of ``old`` and ``new`` (rows of two records) by status; ``bound``: the log-probability bound
    (default: the new run's dtype's, ``layers.bound_for``)."""
    old_run, new_run = old_run or {}, new_run or {}
    bound = bound_for(new_run.get("dtype", "float32")) if bound is None else bound
    entries = {(e["check"], e["subject"], e["case"], e["layer"], e["answer"]): e["reason"] for e in accepted}
    result = Comparison(old_run=old_run, new_run=new_run)
    before = {(r["check"], r["subject"], r["case"]): r for r in old}
    after = {(r["check"], r["subject"], r["case"]): r for r in new}
    ran = {r["check"] for r in new}
    for key, row in after.items():
        if key not in before:
            result.counts["new"] += 1
            result.changes.append(Change(*key, status="new"))
            continue
        found = first_layer(before[key], row, bound=bound)
        if found is None:
            result.counts["equal"] += 1
            continue
        layer, detail = found
        answer = answer_digest(row)
        result.counts["changed"] += 1
        result.changes.append(Change(*key, status="changed", layer=layer, detail=detail, answer=answer,
                                     accepted=entries.get((*key, layer, answer), "")))
    for key in before.keys() - after.keys():
        status = "gone" if key[0] in ran else "not run"
        result.counts[status] += 1
        if status == "gone":
            result.changes.append(Change(*key, status="gone"))
    result.changes.sort(key=lambda c: (STATUSES.index(c.status), LAYERS.index(c.layer) if c.layer else 0, c.key()))
    return result


def read_accepted(path: Path) -> list[dict[str, Any]]:
    """The accepted-changes file's entries (none when it does not exist)."""
    if not path.is_file():
        return []
    return list(json.loads(path.read_text())["accepted"])


def accept(result: Comparison, path: Path, reason: str) -> int:
    """Add one entry per unaccepted change to the accepted-changes file, with ``reason``; returns how many."""
    if not reason.strip():
        raise ValueError("--reason is empty. Fix: say why the change is right (it is kept in the repository)")
    entries = read_accepted(path)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    stack = "; ".join(result.stack_differences()) or "the same stack"
    added = [{"check": c.check, "subject": c.subject, "case": c.case, "layer": c.layer, "answer": c.answer,
              "detail": c.detail, "reason": reason, "stack": stack, "accepted": when}
             for c in result.changes if c.status == "changed" and not c.accepted]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"accepted": entries + added}, indent=1) + "\n")
    return len(added)


BASELINE = ACCEPTED.parent / "outputs-quick.parquet"
"""The committed record CI compares with: the quick tier on the fixture models, float32 (``nox -s conformance``)."""
FIXTURE_MODEL = "smollm2-135m-instruct"


def rebase(record: Path, baseline: Path = BASELINE, accepted: Path = ACCEPTED) -> str:
    """Make ``record`` the committed baseline (after its changes were reviewed): only a quick-tier float32 record of
    the fixture models qualifies; the accepted changes, now part of the baseline, are cleared. Returns what it did."""
    import shutil

    from conformance.kit.outputs import read

    run, rows = read(record)
    wrong = {k: run.get(k) for k, want in (("tier", "quick"), ("dtype", "float32"), ("model", FIXTURE_MODEL))
             if run.get(k) != want}
    if wrong:
        raise ValueError(f"{record} is not a quick-tier float32 record of the fixture models ({wrong}). Fix: record "
                         "one with ENGINE_TIER=quick nox -s conformance")
    source = record / "conformance-outputs.parquet" if record.is_dir() else record
    baseline.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, baseline)
    cleared = len(read_accepted(accepted))
    accepted.write_text(json.dumps({"accepted": []}, indent=1) + "\n")
    return (f"baseline {baseline}: {len(rows)} cases from {len({r['check'] for r in rows})} checks, "
            f"{baseline.stat().st_size / 1024:.0f} KiB; {cleared} accepted changes cleared (they are in it now)")


def headline(result: Comparison) -> str:
    """One line: the counts by status, and how many changes fail.

    >>> headline(Comparison(counts=Counter(equal=3, changed=1), changes=[Change("c", "hf", "k", "changed", "ids")]))
    'outputs: 3 equal, 1 changed (1 not accepted)'
    """
    parts = [f"{result.counts[s]} {s}" for s in STATUSES if result.counts[s]]
    accepted = sum(1 for c in result.changes if c.accepted)
    tail = f" ({result.failing()} not accepted)" if result.counts["changed"] else ""
    if accepted:
        tail = f" ({accepted} accepted, {result.failing()} not)"
    return "outputs: " + (", ".join(parts) or "nothing recorded") + tail


def markdown(result: Comparison) -> str:
    """The comparison as Markdown: the headline, the stack's differences, the changes by layer, then each change."""
    lines = ["# Outputs compared", "", f"**{headline(result)}**", ""]
    stack = result.stack_differences()
    lines += ["## What differs in the stack", "", *(f"- {s}" for s in stack or ["nothing (same versions, fixtures, "
                                                                                "dtype, device and ISA)"]), ""]
    layers = result.by_layer()
    if layers:
        lines += ["## Changes by first layer", "", "| layer | cases |", "|---|---|",
                  *(f"| {layer} | {layers[layer]} |" for layer in LAYERS if layers[layer]), ""]
    changed = [c for c in result.changes if c.status == "changed"]
    if changed:
        lines += ["## Changed cases", ""]
        for c in changed[:SHOWN]:
            lines.append(f"- `{c.check}` on `{c.subject}`, case `{c.case}`: at **{c.layer}**: {c.detail}"
                         + (f" (accepted: {c.accepted})" if c.accepted else ""))
        if len(changed) > SHOWN:
            lines.append(f"- ... and {len(changed) - SHOWN} more")
        lines.append("")
    for status in ("new", "gone"):
        checks = Counter(c.check for c in result.changes if c.status == status)
        if checks:
            lines += [f"## Checks with {status} cases", "",
                      *(f"- `{check}`: {n}" for check, n in sorted(checks.items())), ""]
    return "\n".join(lines)


def page(result: Comparison) -> str:
    """The comparison as an HTML page in the matrix's style."""
    from conformance.kit.matrix import PAGE_STYLE

    esc = html.escape
    colours = {"changed": "#c62828", "new": "#1565c0", "gone": "#ef6c00"}
    rows = "".join(
        f"<tr><th class=\"check\">{esc(c.check)}</th><td>{esc(c.subject)}</td><td><code>{esc(c.case)}</code></td>"
        f"<td style=\"background:{'#2e7d32' if c.accepted else colours[c.status]};color:#fff\">{esc(c.status)}</td>"
        f"<td>{esc(c.layer)}</td><td style=\"text-align:left\">{esc(c.detail)}"
        + (f"<br><i>accepted: {esc(c.accepted)}</i>" if c.accepted else "") + "</td></tr>"
        for c in result.changes[:SHOWN])
    stack = "".join(f"<li>{esc(s)}</li>" for s in result.stack_differences()) or "<li>nothing</li>"
    layers = "".join(f"<tr><td>{layer}</td><td>{n}</td></tr>" for layer in LAYERS if (n := result.by_layer()[layer]))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Outputs compared: {esc(headline(result))}</title>
<style>
{PAGE_STYLE}</style></head><body>
<h1>Outputs compared</h1>
<p><b>{esc(headline(result))}</b></p>
<h2>What differs in the stack</h2><ul>{stack}</ul>
<h2>Changes by first layer</h2><table><thead><tr><th>layer</th><th>cases</th></tr></thead><tbody>{layers}</tbody>
</table>
<h2>Cases</h2><table><thead><tr><th>check</th><th>subject</th><th>case</th><th>status</th><th>layer</th>
<th>what differs</th></tr></thead><tbody>{rows}</tbody></table>
</body></html>
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.kit.history", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("compare", help="compare NEW's outputs with OLD's, case by case")
    run.add_argument("old", type=Path, help="the earlier record: a conformance-outputs.parquet, or its folder")
    run.add_argument("new", type=Path, nargs="+", help="the later record (several files: the shards of one run)")
    run.add_argument("--accepted", type=Path, default=ACCEPTED, help=f"accepted-changes file (default: {ACCEPTED})")
    run.add_argument("--accept", action="store_true", help="add every unaccepted change to --accepted, with --reason")
    run.add_argument("--reason", default="", help="why the changes are right (with --accept)")
    run.add_argument("--bound", type=float, default=None,
                     help="log-probability bound (default: 1e-3 in float32, 0.5 below it)")
    run.add_argument("--markdown", type=Path, help="where to write the Markdown (default: beside NEW)")
    run.add_argument("--html", type=Path, help="where to write the HTML page (default: beside NEW)")
    base = verbs.add_parser("rebase", help="make a reviewed quick-tier record the committed baseline")
    base.add_argument("record", type=Path, help="the record (reports/ of ENGINE_TIER=quick nox -s conformance)")
    base.add_argument("--baseline", type=Path, default=BASELINE, help=f"default: {BASELINE}")
    base.add_argument("--accepted", type=Path, default=ACCEPTED, help=f"cleared (default: {ACCEPTED})")
    args = parser.parse_args(argv)
    if args.verb == "rebase":
        try:
            print(rebase(args.record, args.baseline, args.accepted))
        except ValueError as err:
            parser.error(str(err))
        return 0
    old_run, old = read_all([args.old])
    new_run, new = read_all(args.new)
    result = compare(old, new, bound=args.bound, accepted=read_accepted(args.accepted), old_run=old_run,
                     new_run=new_run)
    folder = args.new[0] if args.new[0].is_dir() else args.new[0].parent
    (args.markdown or folder / "outputs-compared.md").write_text(markdown(result))
    (args.html or folder / "outputs-compared.html").write_text(page(result))
    print(headline(result))
    for layer, n in sorted(result.by_layer().items(), key=lambda kv: LAYERS.index(kv[0])):
        print(f"  {layer}: {n}")
    for line in result.stack_differences():
        print(f"  stack: {line}")
    if args.accept:
        try:
            added = accept(result, args.accepted, args.reason)
        except ValueError as err:
            parser.error(str(err))
        print(f"accepted {added} changes into {args.accepted}")
        return 0
    return 1 if result.failing() else 0


if __name__ == "__main__":
    raise SystemExit(main())
