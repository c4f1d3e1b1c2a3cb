"""What the conformance session's pools started and what it cost: every engine, server and kept object, in order,
with its seconds (printed at the session's end with the time by module, ``conformance/kit/report.py``)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

STARTS = {"engine": "engine", "server": "server", "server ahead": "server", "kept": "kept"}
"""The bill's kinds of start, as the kind of subject they start (a server started ahead is a server)."""


@dataclass
class Bill:
    """(kind, key, seconds) of every start, shared by the engine pool and the server pool.

    >>> bill = Bill()
    >>> with bill.timed("engine", ("hf", "smol")):
    ...     pass
    >>> [(kind, key) for kind, key, _ in bill.starts]
    [('engine', 'hf smol')]
    """

    starts: list[tuple[str, str, float]] = field(default_factory=list)
    announce: Callable[[str], None] | None = None
    """Told ``starting <kind> <key> ...`` as each start begins (the benchmarks' progress lines)."""
    user: str = ""
    """The check module running now (the plugin's ``pytest_runtest_setup`` sets it): whom :meth:`used` counts."""
    users: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """(kind, subject) -> the check modules that asked for it: what a session plan groups its checks by."""
    declared: tuple[Any, ...] | None = None
    """The running module's ``SUBJECTS`` (``conformance/subjects/plan.py``); None: nothing is checked (no module
    running, or a pool outside the suite's plugin)."""
    roles: Any = None
    """How a model folder is named in a declaration (``plan.Roles``; the plugin sets it with the pool)."""
    released: list[tuple[str, str]] = field(default_factory=list)
    """(what, the module after whose last check it stopped): subjects the pool stopped after their last user, as the
    session plan foresaw (``EnginePool.release``)."""

    def used(self, kind: str, key: tuple[str, ...], *, model: str = "", sections: dict[str, Any] | None = None) -> None:
        """Count the running check module as a user of ``key`` (an engine's load key, a server, a kept object); with
        a declaration to check (``declared``), one that does not declare it fails the check, naming what to add.
        ``model``: the model folder (engine, server) or the kept object's name; ``sections``: what it was loaded with
        (an engine's load sections; a server's config beyond the pool's defaults for its model).

        >>> bill = Bill(user="test_stop.py")
        >>> bill.used("engine", ("hf", "smol", "[]", ""))
        >>> bill.users
        {('engine', 'hf smol'): {'test_stop.py'}}
        """
        if not self.user:
            return
        if self.declared is not None and model:
            from conformance.subjects.plan import undeclared

            role = self.roles.of(model) if kind in ("engine", "server") and self.roles is not None else model
            missing = undeclared(self.declared, kind, role, sections or {})
            if missing:
                import pytest

                pytest.fail(f"{self.user} asks for {kind} {named(key)}, which its SUBJECTS do not declare; fix: add "
                            f"{missing} to its SUBJECTS (conformance/subjects/plan.py)", pytrace=False)
        self.users.setdefault((kind, named(key)), set()).add(self.user)

    def plan_lines(self) -> list[str]:
        """Every subject the run asked for, with its starts and the modules that used it, most used first.

        >>> bill = Bill(user="a.py")
        >>> with bill.timed("server", ("hf", "smol")):
        ...     bill.used("server", ("hf", "smol"))
        >>> bill.user = "b.py"; bill.used("server", ("hf", "smol"))
        >>> print("\\n".join(bill.plan_lines()))
        subjects and their users (1 subjects, 1 starts):
          server hf smol: 1 starts, 2 modules: a.py b.py
        """
        started: Counter[tuple[str, str]] = Counter()
        for kind, key, _ in self.starts:
            if kind in STARTS:
                started[(STARTS[kind], key)] += 1
        subjects = sorted(set(self.users) | set(started), key=lambda s: (-len(self.users.get(s, ())), s))
        lines = [f"subjects and their users ({len(subjects)} subjects, {sum(started.values())} starts):"]
        for subject in subjects:
            modules = sorted(self.users.get(subject, ()))
            lines.append(f"  {subject[0]} {subject[1]}: {started.get(subject, 0)} starts, {len(modules)} modules: "
                         + (" ".join(modules) or "(none: started ahead for nobody)"))
        if self.released:
            lines.append(f"stopped after their last user ({len(self.released)}): "
                         + "; ".join(f"{what} after {module}" for what, module in self.released))
        return lines

    @contextmanager
    def timed(self, kind: str, key: tuple[str, ...]) -> Iterator[None]:
        named_key = named(key)
        if self.announce is not None:
            self.announce(f"starting {kind} {named_key} ...")
        began = time.monotonic()
        yield
        self.starts.append((kind, named_key, time.monotonic() - began))


def named(key: tuple[str, ...]) -> str:
    """A subject's key in a line: its non-empty parts."""
    return " ".join(k for k in key if k and k != "[]")
