"""What each check module uses, declared beside its checks, and the session's plan built from those declarations.

A check module names, at module level, every engine, server, kept object and foreign process its checks start or
reach, with the configuration it loads them with::

    from conformance.subjects.plan import engines, processes, servers, uses

    SUBJECTS = uses(engines("text"), engines("tiny-looper", model={"checkpoint_eos": True}),
                    servers("text"), processes("stock vllm serve", why="the drop-in's other side"))

A model is ``"text"`` (``--engine-model``), ``"tiny"`` (``--engine-tiny-model``: the tiny tier's payload model, what
the ``engine`` and ``engines`` fixtures give a module marked ``pytest.mark.model_tier("tiny")``), ``"vlm"``
(``--engine-vlm-model``), a fixture's name (``tiny-looper``), or :data:`BUILT` (a model a check builds at test time,
``conformance/subjects/variants.py``). The keyword sections are
those the engine is loaded with (what ``pool.engine(backend, model, **sections)`` passes, less what is only per
request: the repeat guard, generation defaults, and the sections of the other backends), or for a server those its
config holds beyond the pool's defaults for that model; a section declared as a dict names the settings that matter
and matches any load that has them (``vllm={}``: some vLLM settings, whichever the host needs), so a declaration holds
on a CPU and a CUDA host alike. ``any_config="why"`` accepts every load of that model (a check that sweeps
configurations). An engine or server stands for every backend of the session.

At collection every collected check module must hold ``SUBJECTS`` (one that does not fails collection, by name);
``--collect-only`` prints the plan: each subject, the modules that use it and their checks, in run order. While the
suite runs, every engine, server and kept object a check asks the pool for is matched against its module's
declaration (``Bill.used``): one it did not declare fails the check by name, with the declaration to add. The plan
also says when each server and kept object has served its last user (:func:`last_users`): the pool stops it then,
per backend, instead of at the session's end.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEXT, TINY, VLM, BUILT = "text", "tiny", "vlm", "built"
"""Model roles: ``--engine-model``, ``--engine-tiny-model``, ``--engine-vlm-model``, and any model a check builds at
test time."""
KINDS = ("engine", "server", "kept", "process")


@dataclass(frozen=True)
class Subject:
    """One thing a module's checks start or reach.

    >>> engines("tiny-looper", model={"checkpoint_eos": True}).name
    "engine tiny-looper [('model', {'checkpoint_eos': True})]"
    """

    kind: str
    model: str
    """engine, server: a model role or fixture name; kept: the kept object's name; process: a census kind."""
    config: str = "[]"
    """engine, server: the declared sections as the pool keys them (``repr(sorted(sections.items()))``); ``*``:
    any."""
    why: str = field(default="", compare=False)
    """Why the module needs it (a process's, or an engine's ``any_config``); not part of what it is."""
    sections: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    """The declared sections themselves (what :meth:`matches` compares; ``config`` is their key)."""
    via: str = field(default="", compare=False)
    """kept: the fixture through which checks reach it, when not every check of the module does: only a check that
    requests it (directly or through another fixture) counts as its user in the session plan (:func:`last_users`)."""

    @property
    def name(self) -> str:
        if self.kind in ("kept", "process") or self.config == "[]":
            return f"{self.kind} {self.model}"
        config = "(any config)" if self.config == ANY else self.config
        return f"{self.kind} {self.model} {config}"

    def matches(self, kind: str, model: str, sections: Mapping[str, Any]) -> bool:
        """Whether a load of ``model`` with ``sections`` is this subject: the same section names, each declared
        dict's settings held with the same values (a declared dict names what matters), other values equal.

        >>> s = engines("text", model={"logprobs_mode": "processed_logprobs"}, vllm={})
        >>> s.matches("engine", "text", {"model": {"logprobs_mode": "processed_logprobs", "max_model_len": 2048},
        ...                              "vllm": {"max_num_seqs": 16}})
        True
        >>> s.matches("engine", "text", {"model": {"logprobs_mode": "processed_logprobs"}})  # no vllm section
        False
        """
        if kind != self.kind or model != self.model:
            return False
        if self.config == ANY:
            return True
        declared = dict(self.sections)
        if set(declared) != set(sections):
            return False
        for name, want in declared.items():
            got = sections[name]
            if isinstance(want, dict) and isinstance(got, dict):
                if any(key not in got or got[key] != value for key, value in want.items()):
                    return False
            elif want != got:
                return False
        return True


ANY = "*"


def sections_key(sections: Mapping[str, Any]) -> str:
    """Load sections as the pool keys them.

    >>> sections_key({"vllm": {"max_num_seqs": 4}, "model": {"dtype": "float32"}})
    "[('model', {'dtype': 'float32'}), ('vllm', {'max_num_seqs': 4})]"
    """
    return repr(sorted(sections.items()))


def engines(model: str = TEXT, /, *, any_config: str = "", **sections: Any) -> Subject:
    """The session's engine of ``model`` on every backend, loaded with ``sections`` (none: the pool's defaults)."""
    return _loaded("engine", model, any_config, sections)


def servers(model: str = TEXT, /, *, any_config: str = "", **sections: Any) -> Subject:
    """The pool's server (``python -m engine.serve``) of ``model``'s engine on every backend, with ``sections``."""
    return _loaded("server", model, any_config, sections)


def kept(name: str, *, why: str = "", via: str = "") -> Subject:
    """A session-lived object the pool keeps (``pool.keep((name, ...), factory)``), by its key's first part; ``via``:
    the fixture its checks reach it through, where only some checks of the module do."""
    return Subject("kept", name, ANY, why, via=via)


def processes(kind: str, *, why: str) -> Subject:
    """A foreign process the module's checks start themselves, by its census kind (``conformance/kit/census.py``)."""
    from conformance.kit.census import KINDS as CENSUS_KINDS

    known = [k for k, _ in CENSUS_KINDS]
    if kind not in known:
        raise ValueError(f"processes({kind!r}): not a census kind; fix: one of {known}")
    return Subject("process", kind, ANY, why)


def _loaded(kind: str, model: str, any_config: str, sections: Mapping[str, Any]) -> Subject:
    if any_config and sections:
        raise ValueError(f"{kind}s({model!r}): any_config accepts every load already; fix: drop {sorted(sections)}")
    return Subject(kind, model, ANY if any_config else sections_key(sections), any_config,
                   tuple(sorted(sections.items())))


def uses(*subjects: Subject) -> tuple[Subject, ...]:
    """A module's declaration (``SUBJECTS = uses(...)``); each subject once.

    >>> uses(engines(), engines())
    Traceback (most recent call last):
    ...
    ValueError: SUBJECTS: engine text is declared twice
    """
    seen: set[Subject] = set()
    for subject in subjects:
        if not isinstance(subject, Subject):
            raise TypeError(f"SUBJECTS: {subject!r} is not a subject; fix: engines(...), servers(...), kept(...) or "
                            "processes(...)")
        if subject in seen:
            raise ValueError(f"SUBJECTS: {subject.name} is declared twice")
        seen.add(subject)
    return tuple(subjects)


@dataclass(frozen=True)
class Roles:
    """How a model folder is named in a declaration: the session's text, tiny and VLM models, a fixture by its name,
    any other folder as :data:`BUILT`.

    >>> roles = Roles(text="/c/smollm2", vlm="/c/vl", fixtures="/c", tiny="/c/tiny-chat")
    >>> roles.of("/c/smollm2"), roles.of("/c/tiny-chat"), roles.of("/c/tiny-looper"), roles.of("/tmp/p/bos0/looper")
    ('text', 'tiny', 'tiny-looper', 'built')
    """

    text: str
    vlm: str
    fixtures: str
    tiny: str = ""

    def of(self, path: str) -> str:
        if path == self.text:
            return TEXT
        if path == self.tiny:
            return TINY
        if path == self.vlm:
            return VLM
        folder = Path(path)
        return folder.name if str(folder.parent) == self.fixtures else BUILT


def undeclared(subjects: Sequence[Subject], kind: str, model: str, sections: Mapping[str, Any]) -> str:
    """Empty when ``subjects`` declare (kind, model role, sections); else what to add to the module's ``SUBJECTS``.

    >>> undeclared(uses(engines("text")), "engine", "text", {})
    ''
    >>> undeclared(uses(engines("text")), "engine", "tiny-looper", {})
    'engines("tiny-looper")'
    >>> print(undeclared((), "server", "text", {"hf": {"max_batch_size": 2}}))
    servers("text", hf={'max_batch_size': 2})
    """
    if any(s.matches(kind, model, sections) for s in subjects):
        return ""
    call = {"engine": "engines", "server": "servers", "kept": "kept"}.get(kind, kind)
    return f'{call}("{model}"' + "".join(f", {k}={v!r}" for k, v in sorted(sections.items())) + ")"


MODEL_TIERS = {TEXT: "every check about numerics or real language (the default)",
               TINY: "checks where the model is only a payload: transport, refusals, wire formats, lifecycle, errors"}
"""A check module's model tier (``pytestmark = pytest.mark.model_tier("tiny")``) and what it is for."""


def model_tier(module: Any) -> str:
    """The module's model tier: its ``model_tier`` marker's, else ``text``; an unknown tier fails by name.

    >>> import types, pytest
    >>> model_tier(types.SimpleNamespace(pytestmark=[pytest.mark.model_tier("tiny")]))
    'tiny'
    >>> model_tier(types.SimpleNamespace(pytestmark=pytest.mark.model_tier("huge")))
    Traceback (most recent call last):
    ...
    ValueError: model_tier('huge') in its pytestmark: not a model tier; fix: one of ['text', 'tiny']
    """
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    for mark in marks:
        if getattr(mark, "name", "") == "model_tier":
            tier = mark.args[0] if mark.args else ""
            if tier not in MODEL_TIERS:
                raise ValueError(f"model_tier({tier!r}) in its pytestmark: not a model tier; fix: one of "
                                 f"{sorted(MODEL_TIERS)}")
            return tier
    return TEXT


def module_subjects(module: Any) -> tuple[Subject, ...] | None:
    """The module's ``SUBJECTS``, or None when it declares none."""
    subjects = getattr(module, "SUBJECTS", None)
    return None if subjects is None else tuple(subjects)


def served_group(subjects: Sequence[Subject] | None) -> int:
    """Where a module's served twins run among the other modules' (lower first): 0 when it declares a server of the
    text model beyond its defaults, 2 when it declares a server of another model or of the text model in any config,
    else 1 (the text server only).

    A backend whose servers take turns (vLLM keeps one at a time) then starts the text server once for every module
    of group 1: a module of group 0 (the processed-logprobs checks, which also reach the text server) ends on it, and
    those of group 2 (the looper's servers; the adapters' servers, each loaded with its adapters at start) leave it
    for good: run before group 1, the adapters' servers stopped the text servers and each started again after them
    (about 100 s of CI at eb30802).

    >>> served_group(uses(servers("text"), servers("text", model={"logprobs_mode": "processed_logprobs"})))
    0
    >>> served_group(uses(engines("tiny-looper"), servers("text"))), served_group(uses(servers("tiny-looper")))
    (1, 2)
    >>> served_group(uses(servers("text", any_config="its adapters at start")))
    2
    """
    declared = [s for s in subjects or () if s.kind == "server"]
    if any(s.model != TEXT or s.config == ANY for s in declared):
        return 2
    return 0 if any(s.config != "[]" for s in declared) else 1


ENDS_GROUP = 1.5
"""Where checks marked ``ends_servers`` run: after the text servers' users (groups 0 and 1, and the checks marked
``text_server``), before group 2, whose servers are other models' or other configurations': each is then its text
server's last user and is handed it (``ServerPool.hand_over``) while it still runs. At the session's end instead, vLLM's
text server (one vLLM server at a time) had been stopped by group 2's and was started once more for it (about 20 s
and one ``engine.serve`` of the gate at 10bba47); a check of group 2 that still reached a text server would start it
again, which costs a start, never a verdict."""


def served_rank(subjects: Sequence[Subject] | None, module: str, line: int, *, ends: bool = False,
                text_only: bool = False) -> tuple[float, str, int]:
    """Where a served twin (or a check that reaches the pool's servers itself) runs among the others: by its module's
    :func:`served_group` (1 for a check marked ``text_server``: its twin reaches the text server only, in a module of
    group 2), then module, then its line in the file (a module orders its checks by the servers they reach); a check
    that ends the server it is handed (``ends_servers``) after the text servers' other users (:data:`ENDS_GROUP`).

    >>> text, looper = uses(servers("text")), uses(servers("tiny-looper"), servers("text"))
    >>> ranks = {"sigterm": served_rank(text, "test_hostile.py", 535, ends=True),
    ...          "looper": served_rank(looper, "test_repeat.py", 90),
    ...          "healthy": served_rank(looper, "test_repeat.py", 189, text_only=True),
    ...          "hostile": served_rank(text, "test_hostile.py", 120), "chat": served_rank(text, "test_chat.py", 700)}
    >>> sorted(ranks, key=ranks.get)
    ['chat', 'hostile', 'healthy', 'sigterm', 'looper']
    """
    if ends:
        return (ENDS_GROUP, module, line)
    return (1 if text_only else served_group(subjects), module, line)


RELEASED = ("server", "kept")
"""The kinds of subject the pool stops after their last user: its servers and the kept objects that say how to stop
(``EnginePool.releasers``). In-process engines stay: destroying an in-process vLLM engine breaks every other live one
(``EnginePool.keep``), and an HF or llama.cpp engine holds no process; foreign processes belong to the fixtures of the
module that starts them."""


def last_users(order: Iterable[tuple[str, Sequence[str], Sequence[Subject], Collection[str]]],
               ) -> dict[str, list[tuple[Subject, str]]]:
    """For checks in run order, each given as (node id, the backends it reaches, its module's subjects, the fixtures it
    requests): node id -> the (subject, backend) pairs whose last user it is, of the kinds the pool stops
    (:data:`RELEASED`). A per-backend check reaches its own backend, a cross-backend check all of them; a subject
    reached ``via`` a fixture counts only the checks that request it.

    >>> a, b = uses(servers(), engines()), uses(servers(), kept("looper servers", via="looper"))
    >>> ends = last_users([("a.py::t[hf]", ["hf"], a, ()), ("b.py::u[hf]", ["hf"], b, ["looper"]),
    ...                    ("b.py::v", ["hf", "vllm"], b, ()), ("a.py::x", ["hf", "vllm"], a, ())])
    >>> {check: [(s.name, backend) for s, backend in pairs] for check, pairs in ends.items()}
    {'b.py::u[hf]': [('kept looper servers', 'hf')], 'a.py::x': [('server text', 'hf'), ('server text', 'vllm')]}
    """
    last: dict[tuple[Subject, str], str] = {}
    for nodeid, backends, subjects, fixtures in order:
        for subject in subjects:
            if subject.kind in RELEASED and (not subject.via or subject.via in fixtures):
                for backend in backends:
                    last.pop((subject, backend), None)  # re-inserted: the dict keeps the order of last uses
                    last[(subject, backend)] = nodeid
    out: dict[str, list[tuple[Subject, str]]] = {}
    for (subject, backend), nodeid in last.items():
        out.setdefault(nodeid, []).append((subject, backend))
    return out


def spared(releases: Mapping[str, Sequence[tuple[Subject, str]]]) -> dict[tuple[str, str], tuple[Subject, ...]]:
    """(node id, backend) -> the subjects whose servers a release there must leave running: where an any-config
    subject's last user comes before the last user of another subject of its kind and model on that backend, the
    servers that other one names are still to be used (an adapter module's ``servers("text", any_config=...)`` matches
    the plain text server too, which the SIGTERM check, last of all, is handed). ``releases`` is :func:`last_users`'s
    answer, in the order of last uses.

    >>> text, any_text = servers("text"), servers("text", any_config="adapters")
    >>> spare = spared({"a.py::t": [(any_text, "hf"), (any_text, "vllm")], "b.py::u": [(text, "hf")]})
    >>> {key: [s.name for s in subjects] for key, subjects in spare.items()}
    {('a.py::t', 'hf'): ['server text']}
    """
    order = [(nodeid, subject, backend) for nodeid, pairs in releases.items() for subject, backend in pairs]
    out: dict[tuple[str, str], tuple[Subject, ...]] = {}
    for i, (nodeid, subject, backend) in enumerate(order):
        if subject.config != ANY:
            continue
        later = tuple(s for _, s, b in order[i + 1:] if b == backend and s != subject
                      and (s.kind, s.model) == (subject.kind, subject.model))
        if later:
            out[(nodeid, backend)] = later
    return out


def plan_lines(order: Iterable[tuple[str, tuple[Subject, ...]]],
               stops: Mapping[str, Sequence[tuple[Subject, str]]] | None = None) -> list[str]:
    """The plan: each subject with the modules that use it and their checks, in run order; ``order`` holds (module,
    its subjects) once per collected check, in run order; ``stops`` (:func:`last_users`) adds, for a subject the pool
    stops after its last user, the modules after which it stops.

    >>> a, b = uses(engines(), servers()), uses(engines(), processes("lm_eval CLI", why="the CLI's own run"))
    >>> print("\\n".join(plan_lines([("test_a.py", a), ("test_a.py", a), ("test_b.py", b)],
    ...                              {"test_a.py::t": [(servers(), "hf")]})))
    session plan: 3 subjects for 3 checks in 2 modules
      engine text: 3 checks in 2 modules: test_a.py (2), test_b.py (1)
      server text: 2 checks in 1 modules: test_a.py (2); stops after test_a.py (hf)
      process lm_eval CLI: 1 checks in 1 modules: test_b.py (1)
    """
    users: dict[Subject, dict[str, int]] = {}
    modules: list[str] = []
    checks = 0
    for module, subjects in order:
        checks += 1
        if module not in modules:
            modules.append(module)
        for subject in subjects:
            users.setdefault(subject, {}).setdefault(module, 0)
            users[subject][module] += 1
    after: dict[Subject, dict[str, list[str]]] = {}
    for nodeid, pairs in (stops or {}).items():
        for subject, backend in pairs:
            after.setdefault(subject, {}).setdefault(nodeid.split("::")[0].rsplit("/", 1)[-1], []).append(backend)
    lines = [f"session plan: {len(users)} subjects for {checks} checks in {len(modules)} modules"]
    for subject, by_module in users.items():
        listed = ", ".join(f"{m} ({n})" for m, n in by_module.items())
        ends = "; ".join(f"{m} ({', '.join(b)})" for m, b in after.get(subject, {}).items())
        lines.append(f"  {subject.name}: {sum(by_module.values())} checks in {len(by_module)} modules: {listed}"
                     + (f"; stops after {ends}" if ends else ""))
    return lines
