"""vLLM adapter of row rules, the part shared by both model runners (no vllm import here).

Per-request rules travel in ``SamplingParams.extra_args[EXTRA_KEY]`` as :class:`RuleSpec` dicts plus the EOS
id, the terminal ids and a request key (vLLM hands processors no request id). Each runner has a thin
processor class (``v1_rules`` for the V1 model runner, ``v2_rules`` for Model Runner V2, the GPU
default) that rebuilds each row's :class:`RuleSet` with :func:`build_row`, feeds it the row's new tokens and
applies the decisions with ``engine.backends.row_apply`` (shared with the HF adapter). So the two runners
share everything but the way they see their batch.

**Rule events** (repeat trigger, EOS suppressed, JSON boundary closed) stay where the processor runs, in the
process-wide :data:`EVENTS` store of the worker process, keyed by request key. The engine collects them with
``LLM.collective_rpc("engine_rule_events", keys)`` (a method of
:class:`engine.backends.vllm.events.EngineWorkerExtension`, vLLM's ``worker_extension_cls``): one path for
in-process engines, engine cores in child processes and tensor-parallel workers.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.backends.vllm.portable import DRAW_KEY
from engine.rules.base import RuleSet, RuleSpec

log = logging.getLogger(__name__)

EXTRA_KEY = "engine_rules"
V1, V2 = "v1", "v2"
PROCESSORS = {V1: "engine.backends.vllm.v1_rules:RowRulesV1", V2: "engine.backends.vllm.v2_rules:RowRulesV2"}
"""The processor class for each model runner, as vLLM's ``module:Class`` names (picklable to child processes)."""
INTERFACES = {V1: "vllm.v1.sample.logits_processor", V2: "vllm.v1.worker.gpu.sample.logits_processor"}
WORKER_EXTENSION = "engine.backends.vllm.events.EngineWorkerExtension"  # a dotted name, as vLLM wants it
EVENTS_METHOD = "engine_rule_events"


def request_args(specs: Sequence[RuleSpec], *, key: str, eos_id: int, terminal_ids: Sequence[int],
                 min_new: int = 0, draw: Mapping[str, Any] | None = None) -> dict:
    """The ``extra_args`` for one request (``min_new``: no rule ends the row before that many tokens; ``draw``: the
    portable sampler's arguments, :func:`engine.backends.vllm.portable.draw_args`).

    >>> request_args([], key="k", eos_id=2, terminal_ids=[2])
    {'engine_rules': {'specs': [], 'key': 'k', 'eos': 2, 'terminal': [2], 'min_new': 0}}
    """
    args = {"specs": [s.as_dict() for s in specs], "key": key, "eos": eos_id, "terminal": list(terminal_ids),
            "min_new": min_new}
    if draw is not None:
        args[DRAW_KEY] = dict(draw)
    return {EXTRA_KEY: args}


class RequestRules:
    """What both model runners' processors (``v1_rules.RowRulesV1``, ``v2_rules.RowRulesV2``) answer alike, mixed in
    before vLLM's ``LogitsProcessor``: a request's rule arguments, checked at admission; where ended rows' events go.
    The plugin's guard (:mod:`engine.vllm_plugin.processor`) overrides these to read the user's settings instead."""

    tracks_events = True
    """Rows are kept in the process's event store until the engine collects them (``build_row``)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        cls.row_args(sampling_params, check=True)

    @classmethod
    def row_args(cls, params: Any, *, check: bool) -> RowArgs | None:
        """The rule arguments of a request (``check``: at admission, everything proved to build), or None when its
        row runs no rule. The engine's own requests carry them in ``extra_args``; the plugin
        (:mod:`engine.vllm_plugin`) derives them from the user's settings instead."""
        return parse_request_args(params.extra_args, check=check)

    def ended(self, rows: list[Row]) -> None:
        """Called with the rows a rule ends this step (EOS forced); the engine collects events another way."""


@dataclass(frozen=True)
class RowArgs:
    """One request's validated rule arguments."""

    specs: tuple[RuleSpec, ...]
    key: str
    eos: int
    terminal: frozenset[int]
    min_new: int = 0
    draw: Mapping[str, Any] | None = None
    """The portable sampler's arguments (``engine.backends.vllm.portable``), or None: vLLM's own draw."""


def parse_request_args(extra_args: Mapping[str, Any] | None, *, check: bool = True) -> RowArgs | None:
    """The request's rule arguments, or None when it carries none; ``ValueError`` naming the field if malformed.

    Both processors call it from ``validate_params`` (``check``: every per-row spec is built once to prove it
    builds, an id-only repeat spec's thresholds are validated), so a bad spec fails at admission, not in the
    sampler; when the request joins a batch they read the admitted arguments again without building anything
    (``check=False``): the row builds its per-row rules once, and id-only repeat rules (``RuleSpec.bank``, decided
    when the engine made the spec) are never built, their thresholds go to the bank.

    >>> parse_request_args({"engine_rules": {"specs": [], "key": "k", "eos": 2, "terminal": [2]}}).eos
    2
    >>> parse_request_args({"engine_rules": {"specs": [], "key": "k", "eos": "2", "terminal": [2]}})
    Traceback (most recent call last):
    ...
    ValueError: extra_args.engine_rules.eos must be an integer token id, got '2'
    """
    if not extra_args or EXTRA_KEY not in extra_args:
        return None
    args = extra_args[EXTRA_KEY]
    where = f"extra_args.{EXTRA_KEY}"
    if not isinstance(args, Mapping):
        raise ValueError(f"{where} must be a mapping (engine.backends.vllm.rules.request_args), got {args!r}")
    missing = sorted({"specs", "key", "eos", "terminal"} - set(args))
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}; build it with engine.backends.vllm.rules.request_args")
    if not isinstance(args["key"], str) or not args["key"]:
        raise ValueError(f"{where}.key must be a non-empty string, got {args['key']!r}")
    if not _is_id(args["eos"]):
        raise ValueError(f"{where}.eos must be an integer token id, got {args['eos']!r}")
    terminal = args["terminal"]
    if not isinstance(terminal, (list, tuple)) or not all(_is_id(t) for t in terminal):
        raise ValueError(f"{where}.terminal must be a list of integer token ids, got {terminal!r}")
    if not isinstance(args["specs"], (list, tuple)):
        raise ValueError(f"{where}.specs must be a list of rule specs, got {args['specs']!r}")
    min_new = args.get("min_new", 0)
    if not _is_id(min_new):
        raise ValueError(f"{where}.min_new must be a non-negative integer (generation.min_new_tokens), got {min_new!r}")
    specs = []
    for i, raw in enumerate(args["specs"]):
        if not isinstance(raw, Mapping) or not isinstance(raw.get("target"), str):
            raise ValueError(f"{where}.specs[{i}] must be a mapping with a 'target' string, got {raw!r}")
        extra = sorted(set(raw) - {"target", "params", "mechanism", "bank"})
        if extra:
            raise ValueError(f"{where}.specs[{i}] has unknown keys {extra}; allowed: target, params, mechanism, bank")
        if not isinstance(raw.get("bank", False), bool):
            raise ValueError(f"{where}.specs[{i}].bank must be true or false, got {raw['bank']!r}")
        spec = RuleSpec(raw["target"], dict(raw.get("params") or {}), raw.get("mechanism", "logits_processor"),
                        bank=raw.get("bank", False))
        if check:
            _check_spec(spec, f"{where}.specs[{i}]")
        specs.append(spec)
    draw = args.get(DRAW_KEY)
    if draw is not None:
        from engine.backends.vllm.portable import check_draw_args

        check_draw_args(draw, f"{where}.draw")
    return RowArgs(specs=tuple(specs), key=args["key"], eos=int(args["eos"]), terminal=frozenset(terminal),
                   min_new=int(min_new), draw=draw)


def _check_spec(spec: RuleSpec, where: str) -> None:
    """A bank spec must be the repeat rule with id-only thresholds; any other must build."""
    from engine.rules.repeat import RepeatRule, RepeatThresholds

    try:
        if not spec.bank:
            spec.build()
            return
        if spec.target != "engine.rules.repeat:RepeatRule":
            raise ValueError(f"only {RepeatRule.__name__} runs in a bank, not {spec.target}")
        if RepeatThresholds(**spec.params["thresholds"]).needs_text:
            raise ValueError("its thresholds read text (max_object_keys): it runs per row")
    except Exception as err:  # an import error, a bad parameter, a class that is no RowRule
        raise ValueError(f"{where} ({spec.target}) cannot be built: {err}") from err


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class Row:
    """One request's rule state inside a processor.

    Id-only repeat rules (``repeat``) run in the processor's :class:`~engine.rules.repeat_bank.RepeatBank`, at
    the row's bank index while the request is in the batch (``bank_at``); every other rule runs in ``rules``. When
    the request leaves its index, :meth:`leave` keeps its bank events.
    """

    rules: RuleSet
    eos: int
    key: str
    repeat: list[Any] = field(default_factory=list)
    """At most one id-only repeat threshold set, run in the processor's bank."""
    bank: Any = None
    bank_at: int | None = None
    bank_seen: int = 0
    """Output tokens offered to the bank since the row joined it."""
    left_events: dict[str, Any] = field(default_factory=dict)
    draw: Any = None
    """The row's :class:`~engine.backends.vllm.portable.PortableDraw` (``generation.sampler: portable``), or None."""
    reported: bool = False
    """Its end was reported (the vLLM plugin's audit: once per row, though EOS may be forced on several steps)."""

    def join(self, bank: Any, index: int, terminal: Iterable[int]) -> None:
        """Take bank index ``index``; the bank starts the row from its first token (a resumed request's
        committed tokens are fed again: the same tokens give the same state)."""
        if self.repeat:
            bank.assign(index, self.repeat[0], terminal_ids=terminal)
        self.bank, self.bank_at, self.bank_seen = bank, index, 0

    def leave(self) -> None:
        """The request leaves its bank index (finished, preempted, or the index is reused): keep its events."""
        if self.repeat and self.bank_at is not None:
            self.left_events = self.bank.events(self.bank_at)
            self.bank.release(self.bank_at)
        self.bank_at = None

    def moved_to(self, index: int) -> None:
        self.bank_at = index

    def events(self) -> dict[str, Any]:
        merged = dict(self.rules.events())
        if self.repeat:
            merged.update(self.bank.events(self.bank_at) if self.bank_at is not None else self.left_events)
        if self.draw is not None:
            merged.update(self.draw.events())
        return merged

    def take_draw(self, args: RowArgs, prompt: Sequence[int]) -> None:
        """Start the row's portable draw (``args.draw``) on ``prompt``; a resumed request keeps the one it had."""
        if args.draw is not None and self.draw is None:
            from engine.backends.vllm.portable import PortableDraw

            self.draw = PortableDraw.of(args.draw, prompt=prompt, terminal=sorted(args.terminal),
                                        min_new=args.min_new)


class EventStore:
    """Rule state by request key (anything with ``events()``), in the process where the processor runs, until
    the engine collects it.

    Bounded: past ``capacity`` keys (requests never collected, e.g. aborted) the oldest are dropped, logged.

    >>> store = EventStore(capacity=2)
    >>> for key in "abc":
    ...     store.track(key, RuleSet([], terminal_ids=set()))
    >>> sorted(store.collect(["a", "b", "c"]))
    ['b', 'c']
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._sets: OrderedDict[str, Any] = OrderedDict()
        self.dropped = 0

    def track(self, key: str, rules: Any) -> None:
        self._sets[key] = rules  # a re-admitted (preempted) request replaces its earlier state
        self._sets.move_to_end(key)
        while len(self._sets) > self.capacity:
            self._sets.popitem(last=False)
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.warning("rule event store full: dropped %d uncollected entries", self.dropped)

    def get(self, key: str) -> Any:
        return self._sets.get(key)

    def collect(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The events of each known key (removed from the store); unknown keys are left out."""
        out = {}
        for key in keys:
            rules = self._sets.pop(key, None)
            if rules is not None:
                out[key] = rules.events()
        return out

    def __len__(self) -> int:
        return len(self._sets)


EVENTS = EventStore()
"""This process's store; the worker extension reads it, processors write it."""


def build_row(args: RowArgs, decode: Any, *, track: bool = True) -> Row:
    """The row for ``args``, tracked in this process's :data:`EVENTS` under its key (``track``; the vLLM plugin's
    rows, whose events nobody collects, are not: a request it sees again after a preemption restarts its rules and
    is fed its committed tokens again, the same state for every rule but what min-length noted on the way).

    A request that comes back after a preemption (same key, not yet collected) keeps its rule state: its
    per-row rules go on from the first committed token they have not seen, and what they noted on the way (e.g.
    an EOS held back by min-length, which no replay of tokens could recover) is kept; its bank rows restart
    and are fed the committed tokens again."""
    from engine.rules.repeat_bank import split_vectorizable

    row = EVENTS.get(args.key) if track else None
    if row is None:
        repeat, specs = split_vectorizable(args.specs)
        if len(repeat) > 1:  # a bank row holds one threshold set; more run per row
            specs = [s for s in args.specs if s not in specs][1:] + specs
            repeat = repeat[:1]
        rules = RuleSet([s.build() for s in specs], terminal_ids=args.terminal, decode=decode,
                        min_new_tokens=args.min_new)
        row = Row(rules=rules, eos=args.eos, key=args.key, repeat=repeat)
    if track:
        EVENTS.track(args.key, row)
    return row


class TokenizerText:
    """What text-reading rules read in the processor's process, loaded on first use: the tokenizer's byte table
    (``engine.rules.token_text``), or its incremental ``decode`` when the table does not cover its decoder."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._source: Any = None

    def stream(self) -> Any:
        if self._source is None:
            from transformers import AutoTokenizer

            from engine.rules.detok import IncrementalDetokenizer
            from engine.rules.token_text import TokenBytes

            tokenizer = AutoTokenizer.from_pretrained(self.path)
            table = TokenBytes.from_tokenizer(tokenizer)
            self._source = table.stream if table is not None else (
                lambda: IncrementalDetokenizer(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)))
        return self._source()


def merge_worker_events(replies: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """One event dict per key from every worker's reply (tensor-parallel ranks all run the processor and
    report the same events; the first reply that knows a key wins). Tuples that a transport turned into lists
    come back as tuples, so in-process and multi-process results are equal.

    >>> merge_worker_events([{"k": {"repeat_terminate": ["ngram_repeats", 9]}}, {"k": {}}])
    {'k': {'repeat_terminate': ('ngram_repeats', 9)}}
    """
    merged: dict[str, dict[str, Any]] = {}
    for reply in replies:
        for key, events in (reply or {}).items():
            if key not in merged:
                merged[key] = {k: tuple(v) if isinstance(v, list) else v for k, v in events.items()}
    return merged
