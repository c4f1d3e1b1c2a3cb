"""The suite's fixtures: the shared engine pool, the backend as a parameter, the served twin's reach.

They live in the package's conftest, not in the plugin (``conformance/kit/plugin.py``), so that they apply to the
suite's own checks only: generic names (``engine``, ``client``, ``pool``) never reach a user's other tests, and another
plugin's fixture of the same name (pytest-flask's ``client``) never replaces ours here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conformance.kit.availability import unavailable_reason
from conformance.kit.plugin import CALL_PASSED, LATER_BACKENDS, TARGET_DESCRIBED, pool_of
from conformance.kit.tiers import Workload
from conformance.subjects.looper import NAME as LOOPER
from conformance.subjects.looper import LooperServers
from conformance.subjects.pool import EnginePool
from conformance.subjects.served import IN_PROCESS, SERVED
from conformance.subjects.target import TARGET, Target
from engine.backends.registry import SPECS

VLM_BACKENDS = tuple(name for name, s in SPECS.items() if s.serves_images)
"""Backends that serve vision-language models (llamacpp does not: its VLM checks skip with the reason)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", list(pool_of(metafunc.config).options.backends), scope="session")
    if "target" in metafunc.fixturenames:  # conformance/test_target.py: the external server, or each of ours
        options = pool_of(metafunc.config).options
        metafunc.parametrize("target", [TARGET] if options.target.url else list(options.backends), indirect=True)
    if metafunc.definition.get_closest_marker("servable") is not None:
        metafunc.parametrize("reach", [IN_PROCESS, pytest.param(SERVED, marks=pytest.mark.served)], indirect=True)


@pytest.fixture(autouse=True)
def reach(request: pytest.FixtureRequest, pytestconfig: pytest.Config) -> Iterator[str]:
    """How this check reaches the pool's engines: in-process, or (the served twin of a servable check) through
    their servers too. A served twin none of whose calls reached a server fails: it would prove nothing. A served
    twin starts with its in-process variant's calls sent to their servers at once (``Reach.replay``)."""
    pool = pool_of(pytestconfig)
    how = getattr(request, "param", IN_PROCESS)
    before, pool.reach.how = pool.reach.served_calls, how
    pool.reach.check = script_key(request.node) if request.node.get_closest_marker("servable") else ""
    pool.servers.ahead_for = request.node.stash.get(LATER_BACKENDS, None)  # None: a cross-backend check
    if how == SERVED:
        pool.reach.replay()  # the in-process variant's calls, sent to their servers at once
    yield how
    pool.reach.settle()
    pool.reach.how, pool.reach.check, pool.servers.ahead_for = IN_PROCESS, "", None
    if how == SERVED and request.node.stash.get(CALL_PASSED, False) and pool.reach.served_calls == before:
        pytest.fail("this served twin never reached a server (its calls ran in-process only): drop its servable "
                    "mark, or make it compare engines through generate()", pytrace=False)


def script_key(node: Any) -> str:
    """A servable check without its reach: its in-process and served variants share it (the served twin's script)."""
    spec = getattr(node, "callspec", None)
    params = sorted((k, repr(v)) for k, v in (spec.params if spec else {}).items() if k != "reach")
    return f"{node.nodeid.split('[', 1)[0]} {params}"


@pytest.fixture
def target(request: pytest.FixtureRequest, pool: EnginePool) -> Iterator[Target]:
    """The server a target check asks (``conformance/subjects/target.py``): ``--engine-target-url``'s, or the selected
    backend's own (the pool's text server, shared with the served twins)."""
    name, options = request.param, pool.options.target
    if name == TARGET:
        subject = Target(options.url or "", model=options.model, key=options.key, extra_body=options.extra_body,
                         context=options.context)
        if not request.config.stash.get(TARGET_DESCRIBED, None):
            listed = subject.listed()
            request.config.stash[TARGET_DESCRIBED] = {
                "url": subject.url, "model": subject.model, "owned_by": listed.get("owned_by", ""),
                "root": listed.get("root", ""), "extra_body": options.extra_body}
    else:
        reason = unavailable_reason(name)
        if reason:
            pytest.skip(reason)
        subject = Target(pool.text_server(name).url, name=name)
    yield subject
    subject.close()


@pytest.fixture(scope="session")
def workload(pytestconfig: pytest.Config) -> Workload:
    """The quick tier's smaller workload where ``-m`` selected quick checks only, else the full gate's
    (conformance/kit/tiers.py)."""
    return pytestconfig.pluginmanager.get_plugin("engine-quick-tier").workload


@pytest.fixture(scope="session")
def pool(pytestconfig: pytest.Config) -> Iterator[EnginePool]:
    p = pool_of(pytestconfig)
    yield p
    p.close()


@pytest.fixture(scope="session")
def looper_servers(pool: EnginePool) -> Iterator[LooperServers]:
    """The looper's server per backend that test_served.py and test_weight_sync.py share
    (``conformance/subjects/looper.py``), its guard ``LOOP_GUARD`` from the environment."""
    from conformance.test_repeat import LOOP_GUARD
    from engine_fixtures import fixture_path

    looper = str(fixture_path("tiny-looper"))
    servers = LooperServers(configure=lambda backend: pool.config(backend, looper), guard=LOOP_GUARD,
                            checkpoint=looper, bill=pool.bill)
    pool.releasers[LOOPER] = servers.release  # stopped per backend after its last user (the session plan)
    yield servers
    pool.releasers.pop(LOOPER, None)
    servers.close()


@pytest.fixture(scope="session")
def backend_names(pool: EnginePool) -> tuple[str, ...]:
    """Every selected backend that can run here; parity checks skip (with the reason) below two."""
    runnable = tuple(b for b in pool.options.backends if unavailable_reason(b) is None)
    if len(runnable) < 2:
        reasons = [unavailable_reason(b) for b in pool.options.backends]
        pytest.skip(f"parity needs two runnable backends; have {runnable} ({'; '.join(r for r in reasons if r)})")
    return runnable


@pytest.fixture(scope="module")
def text_model(pool: EnginePool, request: pytest.FixtureRequest) -> str:
    """The model folder the module's checks run on: its model tier's (``pytest.mark.model_tier("tiny")``: the tiny
    tier's payload model, ``--engine-tiny-model``), else ``--engine-model`` (``conformance.subjects.plan``)."""
    from conformance.subjects.plan import model_tier

    return pool.tier_model(model_tier(request.module))


@pytest.fixture(scope="module")
def engine(pool: EnginePool, backend: str, text_model: str) -> Any:
    """The shared engine of ``backend`` on the module's model (``text_model``)."""
    reason = unavailable_reason(backend)
    if reason:
        pytest.skip(reason)
    return pool.engine(backend, text_model)


@pytest.fixture(scope="module")
def engines(pool: EnginePool, backend_names: tuple[str, ...], text_model: str) -> dict[str, Any]:
    """The shared engine of every runnable backend on the module's model (``text_model``), by name."""
    return {b: pool.engine(b, text_model) for b in backend_names}


@pytest.fixture(scope="session")
def vlm_engines(pool: EnginePool, backend_names: tuple[str, ...]) -> dict[str, Any]:
    """The shared engine of every runnable backend that serves vision-language models on ``--engine-vlm-model``."""
    serving = [b for b in backend_names if b in VLM_BACKENDS]
    if len(serving) < 2:
        pytest.skip(f"VLM parity needs two backends that serve VLMs ({', '.join(VLM_BACKENDS)}); have {serving}")
    return {b: pool.engine(b, pool.options.vlm_model) for b in serving}


@pytest.fixture(scope="module")
def model_path(text_model: str) -> Path:
    return Path(text_model)


@pytest.fixture
def summary_note(request: pytest.FixtureRequest) -> Any:
    """``summary_note(text)``: a measured fact of this check, printed at the end and kept in the summary files."""
    from conformance.kit.record import result_id

    collector = request.config.pluginmanager.get_plugin("engine-summary")
    check = result_id(request.node.location)
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
