"""The conformance suite's pytest plugin: its options, markers, shared engines and report, for any pytest run.

Installed with the package (``pip install "xbackend-engine[conformance]"``), it is registered by the ``pytest11``
entry point ``xbackend_engine_conformance``, so ``pytest --pyargs conformance`` runs the suite from any folder, with no
clone and no conftest (``-p no:xbackend_engine_conformance`` turns it off). It acts on the suite's own checks only
(test modules of the ``conformance`` package): a user's other tests in the same session see its options and markers
and nothing else; nothing loads, no engine starts and no report is written unless a conformance check is collected.

Options (all under "engine conformance" in ``pytest --help``):
``--engine-backends``, ``--engine-require``, ``--engine-model``, ``--engine-vlm-model``, ``--engine-dtype``,
``--engine-device``, ``--engine-vllm-multiprocessing``, ``--engine-shard``, ``--engine-reports``, and
``--engine-target-url`` (with ``-model``, ``-key``, ``-extra-body``, ``-context``, ``-strict``): a server to check
through its OpenAI API against the HF reference (``conformance/test_target.py``); the checks that need the engine's
own backends or server then skip, with that reason.
Defaults are the fixture models built by ``python -m engine_fixtures build`` (built on first use when missing). A
backend that cannot run here is skipped with its reason printed in the summary, never silently, unless
``--engine-require`` lists it: then the session fails before any test (``nox -s conformance`` requires all three).
After each run the report is written to ``reports/``: ``conformance-report.json`` (``conformance/kit/record.py``), the
HTML matrix and the Markdown summary (``conformance/kit/matrix.py``).

Checks marked ``servable`` run twice, as the ``reach`` parameter says: ``in-process``, and ``served`` (marked
``served``), where every engine they compare is reached through ``python -m engine.serve`` too and must answer the
same (see ``conformance/subjects/served.py``). Served twins run last, grouped by module, then backend after backend per
check, so each server is started about once (and the other backends' twins of it start ahead, in the
background). ``-m "not served"`` leaves them out; ``-m served`` runs only them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

from conformance.kit import reaper
from conformance.kit.availability import check_required, unavailable_reason
from conformance.kit.isa import follow_aten_capability
from conformance.kit.report import SummaryCollector
from conformance.kit.shards import parse as parse_shard
from conformance.kit.shards import split as split_shards
from conformance.kit.tiers import QuickTier
from conformance.subjects.plan import (
    TEXT,
    Roles,
    last_users,
    model_tier,
    module_subjects,
    plan_lines,
    served_rank,
    servers,
    spared,
)
from conformance.subjects.pool import EnginePool, PoolOptions
from conformance.subjects.served import IN_PROCESS, SERVED
from conformance.subjects.target import TargetOptions
from engine.backends.host import name_mkl_branch
from engine.config import BACKENDS, DTYPES

PACKAGE = "conformance"
POOL_KEY = pytest.StashKey[EnginePool]()
CHECKS_KEY = pytest.StashKey[set[str]]()
"""Node ids of the collected conformance checks: the collection and report hooks act on these only."""
DECLARED_PROCESSES = pytest.StashKey[dict[str, list[str]]]()
"""Check module -> the foreign process kinds its SUBJECTS declare (compared with the census at the end)."""
FORCED_PROBES = pytest.StashKey[list[str]]()
TARGET_KEY = pytest.StashKey[TargetOptions]()
TARGET_DESCRIBED = pytest.StashKey[dict[str, Any]]()
"""The external target as the report's run field ``target`` (set by the ``target`` fixture on first use)."""
CALL_PASSED = pytest.StashKey[bool]()
RELEASES_KEY = pytest.StashKey[dict[str, list[Any]]]()
"""Check node id -> the (subject, backend) pairs whose last user it is (``plan.last_users``): the pool stops them after
its teardown."""
SPARED_KEY = pytest.StashKey[dict[tuple[str, str], tuple[Any, ...]]]()
"""(check node id, backend) -> the subjects whose servers a release after it leaves running (``plan.spared``)."""
REPORTS_KEY = pytest.StashKey[Path]()
"""The folder the run's report and outputs record go to (``--engine-reports``)."""
PREFETCH_KEY = pytest.StashKey[list[str]]()
"""The backends whose text server the session plan's checks reach (``servers("text")``), in a run that holds served
twins: the pool starts them in the background when the first check sets up (``ServerPool.prefetch``); emptied once
started."""
LATER_BACKENDS = pytest.StashKey[frozenset[str]]()
"""Per per-backend check: the backends its other variants run on after it (the same function and parameters, another
backend; for an ``on_servers`` check, its module's later ``on_servers`` checks), whose servers the server pool may
start ahead while it runs; a cross-backend check has none (all it compares start at once)."""
MARKERS = {
    "quick": "the conformance quick tier (-m quick): every check function at least once on each backend, served "
             "twins where marked (conformance/kit/tiers.py picks it; a parametrization may be marked to represent its "
             "function)",
    "gate_only": "gate_only(reason=...): a conformance check function the quick tier leaves to the full gate, the "
                 "reason naming the quick check that carries what it proves (conformance/kit/tiers.py)",
    "quick_on": "quick_on(backend, reason=...): the backend a per-backend conformance check function runs on in the "
                "quick tier (a server of its own is cheaper to start there), the reason saying why it carries the "
                "check (conformance/kit/tiers.py)",
    "servable": "a conformance check that also runs as its served twin (reach=served), every engine it compares "
                "reached through python -m engine.serve too",
    "served": "the served twin of a servable check (-m 'not served' skips them)",
    "on_servers": "an in-process conformance check that reaches its module's pool servers itself (a foreign client "
                  "against them): it runs among its module's served twins, which start those servers anyway",
    "ends_servers": "a conformance check that stops the pool server it is handed (a signal mid-stream): it runs after "
                    "the text servers' other users (plan.ENDS_GROUP), their last user, and takes the server from the "
                    "pool (ServerPool.hand_over), so no server is started for it alone",
    "text_server": "a servable conformance check in a module that also reaches other servers, whose served twin "
                   "reaches the text model's server only: its twin runs among the text server's users "
                   "(plan.served_rank), before the check that ends that server",
    "model_tier": "model_tier('tiny'), at module level: a conformance check module where the model is only a payload; "
                  "its engine, engines and text_model fixtures give the tiny tier's model (--engine-tiny-model) "
                  "instead of --engine-model (docs/conformance.md, 'Model tiers')",
    "slow": "takes more than a few seconds (deselect with -m 'not slow')",
    "dtype_dependent": "a conformance check that compares backends or batches by the dtype's rule (exact in "
                       "float32, vLLM's rule below it); nox -s conformance-bf16 runs them",
    "runner_dependent": "a conformance check whose path differs between vLLM's two model runners (processor "
                        "interface, events, async scheduling); the GPU runbook (nox -s gpu) runs it on each",
    "external_target": "a conformance check that runs against --engine-target-url (a server of any kind, through its "
                       "OpenAI API); with a target, every other check skips",
}
"""The suite's markers, registered by the plugin (so ``--strict-markers`` accepts them in any repository)."""


def is_check(item: pytest.Item) -> bool:
    """Whether ``item`` is one of the suite's checks (a test function of the ``conformance`` package)."""
    module = getattr(item, "module", None)
    return module is not None and module.__name__.split(".")[0] == PACKAGE


def module_file(item: pytest.Item) -> str:
    """The check's module file name (``test_stop.py``), from a clone or a wheel (``--pyargs`` node ids name none)."""
    return item.path.name


def built_fixture(name: str) -> str:
    """A fixture model's folder, built first where the cache has none or an outdated one (from registry packages
    only; an up-to-date one costs hashing its source)."""
    from engine_fixtures import ensure

    return str(ensure(name))


def _cuda_host() -> bool:
    from engine.backends.host import has_cuda

    return has_cuda()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine conformance")
    group.addoption("--engine-backends", default=",".join(BACKENDS),
                    help=f"comma-separated backends to check (default: {','.join(BACKENDS)})")
    group.addoption("--engine-require", default="",
                    help="comma-separated backends that must run: one that cannot (not installed) fails the session "
                         "instead of skipping its checks (default: none; nox -s conformance: hf,vllm,llamacpp)")
    group.addoption("--engine-model", default=None,
                    help="text model folder (default: the smollm2-135m-instruct fixture)")
    group.addoption("--engine-gguf-model", default=None,
                    help="the GGUF (file, or folder with its tokenizer) the llamacpp backend loads for --engine-model "
                         "(default: the smollm2-135m-instruct-gguf fixture, the twin of the default model)")
    group.addoption("--engine-vlm-model", default=None,
                    help="vision-language model folder (default: the tiny-qwen2-vl fixture)")
    group.addoption("--engine-tiny-model", default=None,
                    help="the tiny tier's payload model folder, what modules marked model_tier('tiny') run on "
                         "(default: the tiny-chat fixture, with its GGUF twin for llama.cpp)")
    group.addoption("--engine-dtype", default="float32", choices=DTYPES,
                    help="model dtype; float32 gives exact greedy parity on CPU (default: float32)")
    group.addoption("--engine-device", default="auto",
                    help="HF device: auto, cpu, cuda, cuda:N (default: auto)")
    group.addoption("--engine-vllm-multiprocessing", action="store_true", default=False,
                    help="run every vLLM engine core in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1), as "
                         "servers and multi-GPU runs do (default: in-process on CPU hosts; always on CUDA hosts, "
                         "where the pool stops engines to stay within the card)")
    group.addoption("--engine-gpu-vllm-engines", type=int, default=6,
                    help="CUDA hosts: vLLM engines held on the card at once, servers' included; each gets an "
                         "equal share of 0.8 of the card (default: 6, 0.13 each)")
    group.addoption("--engine-shard", default=None, metavar="K/N",
                    help="run shard K of N (a CI matrix): each backend's checks and each cross-backend module go "
                         "whole to one shard, so a shard loads only its own engines (conformance/kit/shards.py); merge "
                         "the reports with python -m conformance.kit.matrix")
    group.addoption("--engine-target-url", default=None, metavar="URL",
                    help="an OpenAI-compatible server to check against the in-process HF reference on "
                         "--engine-model (e.g. http://127.0.0.1:8000 of vllm serve or python -m llama_cpp.server); "
                         "the checks that need the engine's own backends or server skip")
    group.addoption("--engine-target-model", default=None,
                    help="the model name the target serves (default: the first of its /v1/models)")
    group.addoption("--engine-target-key", default=os.environ.get("ENGINE_TARGET_KEY"),
                    help="the target's API key (default: $ENGINE_TARGET_KEY, else none)")
    group.addoption("--engine-target-extra-body", default=None, metavar="JSON",
                    help="fields added to every request to the target except the plain-request check, e.g. "
                         "'{\"repeat_penalty\": 1.0}' for llama.cpp's server (recorded in the report)")
    group.addoption("--engine-target-context", type=int, default=None,
                    help="the target's context length in tokens (default: max_model_len of its /v1/models)")
    group.addoption("--engine-target-strict", action="store_true", default=False,
                    help="a target that differs from the reference fails the check (default: the verdict "
                         "'differs', a finding about the server that fails no run)")
    group.addoption("--engine-record", default="on", choices=("on", "off"),
                    help="record what every check saw (reports/conformance-outputs.parquet, compared between "
                         "releases by python -m conformance.kit.history); off only to measure what it costs "
                         "(default: on)")
    group.addoption("--engine-reports", default=None,
                    help="folder of the conformance report, matrix and summary (default: reports/ in the folder pytest "
                         "was started from)")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    census = None
    if any(PACKAGE in str(arg) for arg in config.args):  # a run of the suite, from any folder
        name_mkl_branch()
        fd, census = tempfile.mkstemp(prefix="conformance-census-", suffix=".tsv")
        os.close(fd)
        reaper.start(census=census)  # every process this run starts dies with it, however it ends; each is counted
        config.add_cleanup(lambda: Path(census).unlink(missing_ok=True))
    config.stash[FORCED_PROBES] = follow_aten_capability()  # before anything imports vLLM (conformance/kit/isa.py)
    backends = selected_backends(config)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"--engine-backends: unknown {unknown}; available: {', '.join(BACKENDS)}")
    check_required(config.getoption("--engine-require"), list(backends))
    shard = config.getoption("--engine-shard")
    if shard:
        try:
            parse_shard(shard)
        except ValueError as err:
            raise pytest.UsageError(f"{err}; fix: e.g. --engine-shard 1/2 on one runner, 2/2 on the other") from None
    try:
        config.stash[TARGET_KEY] = TargetOptions.of(
            url=config.getoption("--engine-target-url"), model=config.getoption("--engine-target-model"),
            key=config.getoption("--engine-target-key") if config.getoption("--engine-target-url") else None,
            extra_body=config.getoption("--engine-target-extra-body"),
            context=config.getoption("--engine-target-context"), strict=config.getoption("--engine-target-strict"))
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    config.stash[CHECKS_KEY] = set()
    tier = QuickTier(is_check)
    config.pluginmanager.register(tier, "engine-quick-tier")

    dtype = config.getoption("--engine-dtype")

    def describe() -> dict[str, Any]:  # read at the session's end, for the report
        pool = config.stash.get(POOL_KEY, None)
        context = {} if pool is None else {
            "vllm_runner": ",".join(sorted(pool.runners)) or "none started", "vllm_engine_core": pool.vllm_mode,
            "served_calls": pool.reach.served_calls}
        return {"model": pool.options.model if pool else "", "dtype": dtype, "backends": backends,
                "workload": tier.workload.name, "context": context, "shards": [shard] if shard else [],
                "target": config.stash.get(TARGET_DESCRIBED, {}), "plan": pool.bill.plan_lines() if pool else [],
                "declared_processes": config.stash.get(DECLARED_PROCESSES, {})}

    stem = "conformance-summary" + ("" if dtype == "float32" else f"-{dtype}")
    out = Path(config.getoption("--engine-reports") or Path(config.invocation_params.dir) / "reports")
    config.stash[REPORTS_KEY] = out
    collector = SummaryCollector(out, describe, stem, checks=config.stash[CHECKS_KEY],
                                 census=Path(census) if census else None)
    config.pluginmanager.register(collector, "engine-summary")


def selected_backends(config: pytest.Config) -> tuple[str, ...]:
    return tuple(b.strip() for b in config.getoption("--engine-backends").split(",") if b.strip())


def pool_of(config: pytest.Config) -> EnginePool:
    """The session's engine pool, made on first need: a run that collects no conformance check makes none (and
    imports no torch for it)."""
    pool = config.stash.get(POOL_KEY, None)
    if pool is not None:
        return pool
    from engine.backends.registry import SPECS
    from engine_fixtures import GGUF_TWINS
    from engine_fixtures.build import ADAPTER_TWINS, default_fixtures

    backends = selected_backends(config)
    wants_gguf = any(SPECS[b].model_format == "gguf" for b in backends if b in SPECS)  # the registry: who reads GGUF
    gguf_only = {*GGUF_TWINS.values(), *ADAPTER_TWINS.values()}
    for name in default_fixtures():  # what the checks load by name (the GGUF twins only for a backend that reads them)
        if wants_gguf or name not in gguf_only:
            built_fixture(name)
    model = config.getoption("--engine-model") or built_fixture("smollm2-135m-instruct")
    twins = {}
    if wants_gguf:  # the GGUF twins are built only for a run that checks a GGUF backend (llama.cpp)
        twins = {built_fixture(hf): built_fixture(gguf) for hf, gguf in GGUF_TWINS.items()}
        for adapters, gguf in ADAPTER_TWINS.items():  # each adapter folder -> the same folder of its GGUF twin
            hf_root, gguf_root = Path(built_fixture(adapters)), Path(built_fixture(gguf))
            twins.update({str(folder): str(gguf_root / folder.name) for folder in sorted(hf_root.iterdir())
                          if (gguf_root / folder.name).is_dir()})
    if config.getoption("--engine-gguf-model"):
        twins[model] = config.getoption("--engine-gguf-model")
    options = PoolOptions(
        backends=backends,
        model=model,
        vlm_model=config.getoption("--engine-vlm-model") or built_fixture("tiny-qwen2-vl"),
        tiny_model=config.getoption("--engine-tiny-model") or built_fixture("tiny-chat"),
        dtype=config.getoption("--engine-dtype"),
        device=config.getoption("--engine-device"),
        vllm_multiprocessing=config.getoption("--engine-vllm-multiprocessing") or _cuda_host(),
        gpu_vllm_engines=config.getoption("--engine-gpu-vllm-engines"),
        gguf_models=tuple(twins.items()),
        target=config.stash[TARGET_KEY],
    )
    pool = EnginePool(options)
    pool.reach.record.enabled = config.getoption("--engine-record") == "on"
    pool.bill.roles = Roles(text=options.model, vlm=options.vlm_model, tiny=options.tiny_model,
                            fixtures=str(Path(built_fixture("smollm2-135m-instruct")).parent))
    config.stash[POOL_KEY] = pool
    if not _cuda_host():  # CPU hosts: eager engines (CPU_VLLM), and vLLM's compiled sampler helpers run as plain ops
        from engine.backends.host import turn_torch_compile_off

        pool.compile_off = turn_torch_compile_off()
    return pool


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by backend, which it keeps for in-process checks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Served twins after every in-process check (with them the checks marked ``on_servers``), grouped by module,
    modules in the order of the servers they declare (``plan.served_group``), a module's checks in the order it states
    them (so a module orders its checks by the servers they reach); each check's variants backend after backend (hf,
    llamacpp, vllm on one guard, then the next guard). Checks marked ``ends_servers`` (each stops the server it is
    handed) run last (``plan.served_rank``). Each server then starts once, and the pool can start the other
    backends' twin of a server ahead while one backend works (a cross-backend check compares all of them at once).
    Other tests of the session keep their order, ahead."""
    checks = [item for item in items if is_check(item)]
    require_declarations(checks)
    config.stash[DECLARED_PROCESSES] = {module_file(item): [s.model for s in module_subjects(item.module) or ()
                                                            if s.kind == "process"] for item in checks}
    if config.getoption("--engine-shard") and checks:
        checks = keep_shard(config, items, checks)
    config.stash[CHECKS_KEY].update(item.nodeid for item in checks)
    if not checks:
        return
    if config.stash[TARGET_KEY].url:
        skip_own_engine_checks(config, checks)
    order = {item: i for i, item in enumerate(items)}
    first: dict[tuple[str, ...], int] = {}

    def params(item: pytest.Item) -> dict[str, Any]:
        spec = getattr(item, "callspec", None)
        return spec.params if spec else {}

    def variant(item: pytest.Item) -> tuple[str, ...]:  # the check and its parameters other than the backend
        rest = sorted((k, repr(v)) for k, v in params(item).items() if k not in ("backend", "reach", "target"))
        return (item.nodeid.split("::")[0], getattr(item, "originalname", item.name), repr(rest))

    for item in checks:
        first.setdefault(variant(item), order[item])

    def rank(item: pytest.Item) -> tuple[Any, ...]:
        if not is_check(item):
            return (-1, order[item])
        own_server = "target" in params(item) and not config.stash[TARGET_KEY].url
        on_servers = item.get_closest_marker("on_servers") is not None
        ends = item.get_closest_marker("ends_servers") is not None
        text_only = item.get_closest_marker("text_server") is not None
        if params(item).get("reach", IN_PROCESS) != SERVED and not own_server and not on_servers and not ends:
            return (0, order[item])
        module = module_file(item)
        backend = params(item).get("backend", params(item).get("target", ""))
        stated = item.location[1] or 0  # the check's line in its module: pytest's own order groups by parameter
        return (1, *served_rank(module_subjects(item.module), module, stated, ends=ends, text_only=text_only),
                first[variant(item)], backend, order[item])

    items.sort(key=rank)
    ordered = [item for item in items if is_check(item)]
    # A check that reaches its module's pool servers itself (on_servers) shares them with the module's other such
    # checks: its later backends are theirs too, so the server one backend's check starts is started ahead on the
    # backends the next checks reach (the adapters' vLLM LoRA server, 28 s to start, while HF's and llama.cpp's
    # model-field checks run).
    runs = [((module_file(item), "on_servers") if item.get_closest_marker("on_servers") is not None else
             (*variant(item), str(params(item).get("reach", IN_PROCESS))),
             params(item).get("backend", params(item).get("target"))) for item in ordered]
    for item, backends in zip(ordered, later_backends(runs), strict=True):
        if backends is not None:
            item.stash[LATER_BACKENDS] = backends
    pool = pool_of(config)
    cross = any({"backend_names", "engines"} & set(getattr(item, "fixturenames", ())) for item in checks)
    reached = {params(item)[key] for item in checks for key in ("backend", "target") if key in params(item)}
    pool.servers.ahead_backends = frozenset(b for b in pool.options.backends if (cross or b in reached)
                                            and unavailable_reason(b) is None)


def require_declarations(checks: list[pytest.Item]) -> None:
    """Every collected check module declares what it uses (``SUBJECTS``, ``conformance/subjects/plan.py``); one that
    does not fails collection, by name."""
    missing = sorted({module_file(item) for item in checks if module_subjects(item.module) is None})
    if missing:
        raise pytest.UsageError(f"{', '.join(missing)}: no SUBJECTS; fix: declare what its checks start or reach at "
                                "module level, SUBJECTS = uses(engines(...), servers(...), ...) "
                                "(conformance/subjects/plan.py)")
    # A module's checks share its engines (module-scoped fixtures): its model tier is the module's, never a check's.
    on_checks = sorted({item.nodeid.split("[")[0] for item in checks
                        if any(m.name == "model_tier" for m in getattr(item, "own_markers", ()))})
    if on_checks:
        raise pytest.UsageError(f"{', '.join(on_checks)}: model_tier marks a check; fix: mark its module "
                                "(pytestmark = pytest.mark.model_tier(...)), whose checks share its engines")
    for module in {item.module for item in checks}:
        try:
            model_tier(module)
        except ValueError as err:
            raise pytest.UsageError(f"{module.__name__}: {err}") from None


def later_backends(runs: list[tuple[Any, Any]]) -> list[frozenset[str] | None]:
    """For each (variant, backend) in run order, the backends the same variant runs on after it (None where a check
    has no backend: a cross-backend one).

    >>> [None if b is None else sorted(b) for b in later_backends([("f", "hf"), ("f", "vllm"), ("g", None),
    ...                                                             ("f", "llamacpp"), ("h", "hf")])]
    [['llamacpp', 'vllm'], ['llamacpp'], None, [], []]
    """
    seen: dict[Any, set[str]] = {}
    out: list[frozenset[str] | None] = []
    for key, backend in reversed(runs):
        if backend is None:
            out.append(None)
            continue
        out.append(frozenset(seen.get(key, set())))
        seen.setdefault(key, set()).add(str(backend))
    return out[::-1]


OWN_ENGINE_REASON = ("needs the engine's own backends or server (its envelope, guards, plugins, weight sync); "
                     "--engine-target-url checks a server through its OpenAI API only (conformance/test_target.py)")


def skip_own_engine_checks(config: pytest.Config, checks: list[pytest.Item]) -> None:
    """With an external target, every check but the target's skips, with the reason."""
    for item in checks:
        if item.get_closest_marker("external_target") is None:
            item.add_marker(pytest.mark.skip(reason=OWN_ENGINE_REASON))


def keep_shard(config: pytest.Config, items: list[pytest.Item], checks: list[pytest.Item]) -> list[pytest.Item]:
    """``--engine-shard K/N``: keep shard K's checks (other tests of the session stay in shard 1 only)."""
    from conformance.kit.record import result_id

    k, n = parse_shard(config.getoption("--engine-shard"))
    mine = set(split_shards([result_id(item.location) for item in checks], selected_backends(config), n)[k - 1])
    kept = [item for item in items if (result_id(item.location) in mine if is_check(item) else k == 1)]
    dropped = [item for item in items if item not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    return [item for item in kept if is_check(item)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before its fixtures (session-scoped ones first built for it included): the check's module is whom the pool's
    engines, servers and kept objects count as their user (``Bill.used``), for the plan printed at the end."""
    pool = item.config.stash.get(POOL_KEY, None)
    if pool is not None and is_check(item):
        pool.bill.user, pool.bill.declared = module_file(item), module_subjects(item.module)
        pool.reach.record.check = item.nodeid  # what its calls get is recorded under its id
        prefetch = item.config.stash.get(PREFETCH_KEY, [])
        while prefetch:  # the first check: the text servers the plan's later checks reach start in the background
            pool.servers.prefetch(prefetch.pop(0), pool.options.model)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """The engines the check reaches through fixtures built before it (session- or module-scoped) count it too."""
    pool = item.config.stash.get(POOL_KEY, None)
    if pool is not None and is_check(item):
        pool.count_fixture_users(getattr(item, "funcargs", {}).values())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After the check's own teardown (its module's fixtures included when it is the module's last): stop every server
    and kept object whose last user, by the session plan, it was."""
    result = yield
    pool = item.config.stash.get(POOL_KEY, None)
    if pool is not None:
        spare = item.config.stash.get(SPARED_KEY, {})
        for subject, backend in item.config.stash.get(RELEASES_KEY, {}).get(item.nodeid, ()):
            pool.release(subject, backend, spare=spare.get((item.nodeid, backend), ()))
    return result


def reached_backends(item: pytest.Item, backends: tuple[str, ...]) -> tuple[str, ...]:
    """The backends a check reaches: its own (a ``backend`` or ``target`` parameter naming one), else every one of the
    session's (a cross-backend check)."""
    spec = getattr(item, "callspec", None)
    params = spec.params if spec else {}
    own = params.get("backend", params.get("target"))
    return (own,) if own in backends else backends


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[CALL_PASSED] = report.passed
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    pool = session.config.stash.get(POOL_KEY, None)
    writer = session.config.get_terminal_writer()
    if pool is not None and pool.starts:
        for line in pool.report():  # the subjects and their users follow with the summary (describe()["plan"])
            writer.line(line)
    if pool is not None and pool.reach.record.rows:
        writer.line(write_outputs(session.config, pool))


def write_outputs(config: pytest.Config, pool: EnginePool) -> str:
    """The run's outputs record beside its report (``conformance/kit/outputs.py``); the line that says where and how
    much."""
    import time

    from conformance.kit import outputs

    began = time.perf_counter()
    record, options = pool.reach.record, pool.options
    suffix = "" if options.dtype == "float32" else f"-{options.dtype}"
    tier = config.pluginmanager.get_plugin("engine-quick-tier")  # its rule says whether this run is the quick tier
    tier = "quick" if tier is not None and tier.workload.quick else "full"
    run = outputs.stack(model=options.model, tiny_model=options.tiny_model, dtype=options.dtype,
                        device=options.device, tier=tier)
    path = record.write(config.stash[REPORTS_KEY] / outputs.FILE.replace(".parquet", f"{suffix}.parquet"), run)
    return (f"outputs record: {path} ({len(record.rows)} rows from {record.checks()} checks, "
            f"{path.stat().st_size / 1024:.0f} KiB; recording took {record.seconds:.2f} s, writing "
            f"{time.perf_counter() - began:.2f} s)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not config.stash.get(FORCED_PROBES, None):
        return []
    return [f"cpu kernels: forced below AVX-512 (ATEN_CPU_CAPABILITY); torch.cpu probes answering False in "
            f"this process: {', '.join(config.stash[FORCED_PROBES])} (conformance/kit/isa.py)"]


def text_server_backends(releases: dict[str, list[Any]], available: Collection[str]) -> list[str]:
    """The backends among ``available`` whose text server (``servers("text")``, the pool's defaults) some collected
    check reaches, by the plan's last users (each pair once), vLLM first: its start is the longest.

    >>> from conformance.subjects.plan import servers
    >>> releases = {"a.py::t": [(servers("text"), "hf")], "b.py::u[vllm]": [(servers("text"), "vllm")],
    ...             "c.py::v": [(servers("text", model={"logprobs_mode": "processed_logprobs"}), "llamacpp")]}
    >>> text_server_backends(releases, {"hf", "vllm", "llamacpp"}), text_server_backends(releases, {"hf"})
    (['vllm', 'hf'], ['hf'])
    """
    text = servers(TEXT)
    reached = {backend for pairs in releases.values() for subject, backend in pairs if subject == text}
    return sorted(reached & set(available), key=lambda b: (b != "vllm", b))


def pytest_collection_finish(session: pytest.Session) -> None:
    """``--collect-only``: the session plan (what each subject serves, ``conformance/subjects/plan.py``); then vLLM's
    own model-runner decision for ``--engine-model``, once conformance checks are collected."""
    checks = [item for item in session.items if is_check(item)]
    pool = session.config.stash.get(POOL_KEY, None)
    if pool is not None:  # the order is final here (the quick tier and -k have deselected): the plan's last users
        session.config.stash[RELEASES_KEY] = last_users(
            (item.nodeid, reached_backends(item, pool.options.backends), module_subjects(item.module) or (),
             getattr(item, "fixturenames", ())) for item in checks)
        session.config.stash[SPARED_KEY] = spared(session.config.stash[RELEASES_KEY])
        twins = any(getattr(getattr(item, "callspec", None), "params", {}).get("reach") == SERVED for item in checks)
        if twins and not session.config.stash[TARGET_KEY].url and not session.config.option.collectonly:
            # only where served twins run: a selection without them (the kit's "not served") may start none at all
            session.config.stash[PREFETCH_KEY] = text_server_backends(
                session.config.stash[RELEASES_KEY], pool.servers.ahead_backends)
    if session.config.option.collectonly and checks:
        writer = session.config.get_terminal_writer()
        for line in plan_lines(((module_file(item), module_subjects(item.module) or ()) for item in checks),
                               session.config.stash.get(RELEASES_KEY, {})):
            writer.line(line)
    if pool is None or "vllm" not in pool.options.backends or unavailable_reason("vllm"):
        return
    try:
        from engine.backends.vllm.backend import predicted_runner
        from engine.config import ModelConfig, VllmConfig

        plan = predicted_runner(ModelConfig(path=pool.options.model, dtype=pool.options.dtype),
                                VllmConfig(multiprocessing=pool.options.vllm_multiprocessing))
        runner = f"{plan.runner} (vLLM's own decision for --engine-model; row rules: {plan.problem or 'supported'})"
    except Exception as err:  # the line must not hide the run; the engines will report the real error
        runner = f"undecided ({type(err).__name__}: {err})"
    compile_state = "; torch.compile off (CPU host)" if pool.compile_off else ""
    session.config.get_terminal_writer().line(f"vllm: model runner {runner}; engine core {pool.vllm_mode}"
                                              f"{compile_state}")
