"""Conformance plumbing: one option group, engines shared per session, the backend as a parameter.

Options (all under "engine conformance" in ``pytest --help``):
``--engine-backends``, ``--engine-require``, ``--engine-model``, ``--engine-vlm-model``, ``--engine-dtype``,
``--engine-device``, ``--engine-vllm-multiprocessing``.
Defaults are the fixture models built by ``python -m fixtures build``. A backend that cannot run here is
skipped with its reason printed in the summary, never silently, unless ``--engine-require`` lists it: then the
session fails before any test (``nox -s conformance`` requires hf and vllm). After each run a per-backend x per-check
table is written to ``reports/conformance-summary.md`` (and ``.parquet`` when pandas is installed).

Checks marked ``servable`` run twice, as the ``reach`` parameter says: ``in-process``, and ``served`` (marked
``served``), where every engine they compare is reached through ``python -m engine.serve`` too and must answer the
same (see ``conformance/served.py``). Served twins run last, grouped by module, then backend after backend per
check, so each server is started about once (and the other backends' twins of it start ahead, in the
background). ``-m "not served"`` leaves them out; ``-m served`` runs only them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conformance.isa import follow_aten_capability
from conformance.pool import EnginePool, PoolOptions
from conformance.report import SummaryCollector
from conformance.served import IN_PROCESS, SERVED
from conformance.tiers import QuickTier, Workload
from engine.backends.registry import SPECS
from engine.config import BACKENDS, DTYPES

POOL_KEY = pytest.StashKey[EnginePool]()
FORCED_PROBES = pytest.StashKey[list[str]]()
CALL_PASSED = pytest.StashKey[bool]()
SERVED_ORDER = ("test_parity.py", "test_divergences.py", "test_plugins.py", "test_stop.py",
                "test_engine_core_process.py", "test_repeat.py")
"""Served twins run module by module in this order (then any other): the first four compare the text engine
of each backend, so one server per backend serves them all; the engine-core check leaves the looper's guarded
servers running for the repeat checks, which then need one server per guard setting."""
VLM_BACKENDS = tuple(name for name, s in SPECS.items() if s.serves_images)
"""Backends that serve vision-language models (llamacpp does not: its VLM checks skip with the reason)."""


def _default_model(name: str) -> str:
    from fixtures import fixture_path

    return str(fixture_path(name))


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


def pytest_configure(config: pytest.Config) -> None:
    config.stash[FORCED_PROBES] = follow_aten_capability()  # before anything imports vLLM (conformance/isa.py)
    backends = [b.strip() for b in config.getoption("--engine-backends").split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"--engine-backends: unknown {unknown}; available: {', '.join(BACKENDS)}")
    check_required(config.getoption("--engine-require"), backends)
    model = config.getoption("--engine-model") or _default_model("smollm2-135m-instruct")
    from fixtures import GGUF_TWINS

    twins = {_default_model(hf): _default_model(gguf) for hf, gguf in GGUF_TWINS.items()}
    if config.getoption("--engine-gguf-model"):
        twins[model] = config.getoption("--engine-gguf-model")
    options = PoolOptions(
        backends=tuple(backends),
        model=model,
        vlm_model=config.getoption("--engine-vlm-model") or _default_model("tiny-qwen2-vl"),
        dtype=config.getoption("--engine-dtype"),
        device=config.getoption("--engine-device"),
        vllm_multiprocessing=config.getoption("--engine-vllm-multiprocessing") or _cuda_host(),
        gpu_vllm_engines=config.getoption("--engine-gpu-vllm-engines"),
        gguf_models=tuple(twins.items()),
    )
    pool = EnginePool(options)
    config.stash[POOL_KEY] = pool
    if not _cuda_host():  # CPU hosts: eager engines (CPU_VLLM), and vLLM's compiled sampler helpers run as plain ops
        from engine.backends.host import turn_torch_compile_off

        pool.compile_off = turn_torch_compile_off()
    tier = QuickTier()
    context = lambda: {"vllm_runner": ",".join(sorted(pool.runners)) or "none started",  # noqa: E731
                       "vllm_engine_core": pool.vllm_mode, "served_calls": pool.reach.served_calls,
                       "workload": tier.workload.name}
    stem = "conformance-summary" + ("" if options.dtype == "float32" else f"-{options.dtype}")
    config.pluginmanager.register(tier, "engine-quick-tier")
    config.pluginmanager.register(SummaryCollector(Path(config.rootpath) / "reports", context, stem), "engine-summary")


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by backend, which it keeps for in-process checks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Served twins after every in-process check, grouped by module, cross-backend ones first; then each check's
    variants backend after backend (hf, llamacpp, vllm on one guard, then the next guard). Each server then
    starts once, and the pool can start the other backends' twin of a server ahead while one backend works (a
    cross-backend check compares all of them at once)."""
    order = {item: i for i, item in enumerate(items)}
    first: dict[tuple[str, ...], int] = {}

    def params(item: pytest.Item) -> dict[str, Any]:
        spec = getattr(item, "callspec", None)
        return spec.params if spec else {}

    def variant(item: pytest.Item) -> tuple[str, ...]:  # the check and its parameters other than the backend
        rest = sorted((k, repr(v)) for k, v in params(item).items() if k not in ("backend", "reach"))
        return (item.nodeid.split("::")[0], getattr(item, "originalname", item.name), repr(rest))

    for item in items:
        first.setdefault(variant(item), order[item])

    def rank(item: pytest.Item) -> tuple[Any, ...]:
        if params(item).get("reach", IN_PROCESS) != SERVED:
            return (0, order[item])
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        group = SERVED_ORDER.index(module) if module in SERVED_ORDER else len(SERVED_ORDER)
        per_backend = "backend" in params(item)
        return (1, group, module, per_backend, first[variant(item)], params(item).get("backend", ""), order[item])

    items.sort(key=rank)
    pool = config.stash[POOL_KEY]
    cross = any({"backend_names", "engines"} & set(getattr(item, "fixturenames", ())) for item in items)
    reached = {params(item)["backend"] for item in items if "backend" in params(item)}
    pool.servers.ahead_backends = frozenset(b for b in pool.options.backends if (cross or b in reached)
                                    and unavailable_reason(b) is None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[CALL_PASSED] = report.passed
    return report


@pytest.fixture(autouse=True)
def reach(request: pytest.FixtureRequest, pytestconfig: pytest.Config) -> Iterator[str]:
    """How this check reaches the pool's engines: in-process, or (the served twin of a servable check) through
    their servers too. A served twin none of whose calls reached a server fails: it would prove nothing."""
    pool = pytestconfig.stash[POOL_KEY]
    how = getattr(request, "param", IN_PROCESS)
    before, pool.reach.how = pool.reach.served_calls, how
    yield how
    pool.reach.how = IN_PROCESS
    if how == SERVED and request.node.stash.get(CALL_PASSED, False) and pool.reach.served_calls == before:
        pytest.fail("this served twin never reached a server (its calls ran in-process only): drop its servable "
                    "mark, or make it compare engines through generate()", pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    pool = session.config.stash.get(POOL_KEY, None)
    if pool is not None and pool.starts:
        writer = session.config.get_terminal_writer()
        for line in pool.report():
            writer.line(line)


def pytest_report_header(config: pytest.Config) -> list[str]:
    pool = config.stash[POOL_KEY]
    lines = []
    if config.stash[FORCED_PROBES]:
        lines.append(f"cpu kernels: forced below AVX-512 (ATEN_CPU_CAPABILITY); torch.cpu probes answering False in "
                     f"this process: {', '.join(config.stash[FORCED_PROBES])} (conformance/isa.py)")
    if "vllm" not in pool.options.backends or unavailable_reason("vllm"):
        return lines
    try:
        from engine.backends.vllm.backend import import_vllm, llm_kwargs, prepare_environment
        from engine.backends.vllm.runner import plan_runner
        from engine.config import ModelConfig, VllmConfig

        settings = VllmConfig(multiprocessing=pool.options.vllm_multiprocessing)
        prepare_environment(settings)
        import_vllm()  # as an engine does: without torchvision, its stand-in first (vLLM's config imports need it)
        plan = plan_runner(llm_kwargs(ModelConfig(path=pool.options.model, dtype=pool.options.dtype), settings))
        runner = f"{plan.runner} (vLLM's own decision for --engine-model; row rules: {plan.problem or 'supported'})"
    except Exception as err:  # the header must not hide the run; the engines will report the real error
        runner = f"undecided ({type(err).__name__}: {err})"
    compile_state = "; torch.compile off (CPU host)" if pool.compile_off else ""
    return [*lines, f"vllm: model runner {runner}; engine core {pool.vllm_mode}{compile_state}"]


def check_required(option: str, backends: list[str]) -> None:
    """``--engine-require``: every listed backend is selected and can run here, or the session stops now."""
    required = [b.strip() for b in option.split(",") if b.strip()]
    unknown = [b for b in required if b not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"--engine-require: unknown {unknown}; available: {', '.join(BACKENDS)}")
    unselected = [b for b in required if b not in backends]
    if unselected:
        raise pytest.UsageError(f"--engine-require lists {unselected}, which --engine-backends "
                                f"({','.join(backends)}) leaves out; fix: select them or require fewer")
    missing = [reason for b in required if (reason := unavailable_reason(b))]
    if missing:
        raise pytest.UsageError(f"--engine-require: required backends cannot run here ({'; '.join(missing)}); "
                                "fix: install them (nox -s conformance does) or drop them from --engine-require")


def unavailable_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run on this machine, or None when it can."""
    missing = [m for m in SPECS[backend].modules if importlib.util.find_spec(m) is None]
    return f"{backend}: {', '.join(missing)} not installed" if missing else None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", list(metafunc.config.stash[POOL_KEY].options.backends), scope="session")
    if metafunc.definition.get_closest_marker("servable") is not None:
        metafunc.parametrize("reach", [IN_PROCESS, pytest.param(SERVED, marks=pytest.mark.served)], indirect=True)


@pytest.fixture(scope="session")
def workload(pytestconfig: pytest.Config) -> Workload:
    """The quick tier's smaller workload where ``-m`` selected quick checks only, else the full gate's
    (conformance/tiers.py)."""
    return pytestconfig.pluginmanager.get_plugin("engine-quick-tier").workload


@pytest.fixture(scope="session")
def pool(pytestconfig: pytest.Config) -> Iterator[EnginePool]:
    p = pytestconfig.stash[POOL_KEY]
    yield p
    p.close()


@pytest.fixture(scope="session")
def backend_names(pool: EnginePool) -> tuple[str, ...]:
    """Every selected backend that can run here; parity checks skip (with the reason) below two."""
    runnable = tuple(b for b in pool.options.backends if unavailable_reason(b) is None)
    if len(runnable) < 2:
        reasons = [unavailable_reason(b) for b in pool.options.backends]
        pytest.skip(f"parity needs two runnable backends; have {runnable} ({'; '.join(r for r in reasons if r)})")
    return runnable


@pytest.fixture(scope="session")
def engine(pool: EnginePool, backend: str) -> Any:
    """The shared text engine of ``backend`` on ``--engine-model``."""
    reason = unavailable_reason(backend)
    if reason:
        pytest.skip(reason)
    return pool.text_engine(backend)


@pytest.fixture(scope="session")
def engines(pool: EnginePool, backend_names: tuple[str, ...]) -> dict[str, Any]:
    """The shared text engine of every runnable backend, by name."""
    return {b: pool.text_engine(b) for b in backend_names}


@pytest.fixture(scope="session")
def vlm_engines(pool: EnginePool, backend_names: tuple[str, ...]) -> dict[str, Any]:
    """The shared engine of every runnable backend that serves vision-language models on ``--engine-vlm-model``."""
    serving = [b for b in backend_names if b in VLM_BACKENDS]
    if len(serving) < 2:
        pytest.skip(f"VLM parity needs two backends that serve VLMs ({', '.join(VLM_BACKENDS)}); have {serving}")
    return {b: pool.engine(b, pool.options.vlm_model) for b in serving}


@pytest.fixture(scope="session")
def model_path(pool: EnginePool) -> Path:
    return Path(pool.options.model)


@pytest.fixture
def summary_note(request: pytest.FixtureRequest) -> Any:
    """``summary_note(text)``: a measured fact of this check, printed at the end and kept in the summary files."""
    collector = request.config.pluginmanager.get_plugin("engine-summary")
    check = request.node.nodeid
    return lambda text: collector.note(check, text)


@pytest.fixture
def count_backend_calls(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``calls = count_backend_calls(engine)``: from then on, ``calls`` lists each backend.generate batch size
    (to prove that a rejected request generated nothing)."""

    def install(eng: Any) -> list[int]:
        calls: list[int] = []
        original = eng.backend.generate
        monkeypatch.setattr(eng.backend, "generate", lambda p, plan: calls.append(len(p)) or original(p, plan))
        return calls

    return install


@pytest.fixture(scope="session")
def chat_server(pool: EnginePool) -> Any:
    """``chat_server(backend)``: the running server of ``backend``'s text engine (the pool's, started on first use,
    shared with the served twins; its Pattern C defaults are ``SERVED_CHAT``)."""

    def get(backend: str) -> Any:
        if unavailable_reason(backend):
            pytest.skip(unavailable_reason(backend))
        return pool.text_server(backend)

    return get


@pytest.fixture
def client(chat_server: Any, backend: str) -> Iterator[Any]:
    """The official ``openai`` client on ``backend``'s server."""
    import openai

    server = chat_server(backend)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
