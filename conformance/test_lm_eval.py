"""The engine as an lm-evaluation-harness model, on the project's small tasks (``fixtures/lm_eval_tasks``).

Reference: lm-eval's own ``hf`` model on the same model and tasks. Each backend's ``engine`` model must give
its scores (multiple choice, rolling perplexity over 64-token windows, JSON-answer generation), its
log-likelihoods within 1e-4 and its generations exactly (fp32); HF and vLLM must agree the same way. Then the
schema path (constrained vs not, the ``on_invalid`` strategies), the cache, and the real ``lm_eval`` CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance.subjects.plan import engines, processes, servers, uses

SUBJECTS = uses(
    engines("text"),
    servers("text"),
    processes("lm_eval CLI", why="the real lm_eval CLI scores the engine model and the server"),
)

pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed (pip install 'xbackend-engine[lm-eval]')")



def task_root() -> Path:
    """The folder the task YAMLs name their data from (``fixtures/lm_eval_tasks/...``): the repository's root in a
    clone; installed from the wheel (where the folder is ``engine_fixtures``), a folder in the temp dir whose
    ``fixtures/lm_eval_tasks`` links to the installed tasks."""
    import tempfile

    import engine_fixtures

    tasks = Path(engine_fixtures.__file__).resolve().parent / "lm_eval_tasks"
    if (tasks.parents[1] / "fixtures" / "lm_eval_tasks").is_dir():
        return tasks.parents[1]
    root = Path(tempfile.gettempdir()) / f"xbackend-engine-lm-eval-tasks-{os.getuid()}"
    link = root / "fixtures" / "lm_eval_tasks"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(tasks, target_is_directory=True)
    return root


ROOT = task_root()
TASKS = ROOT / "fixtures" / "lm_eval_tasks"
SCHEMA = TASKS / "city_schema.json"
SCORING = ["engine_mc", "engine_ppl"]
WINDOW = 64  # max_length for the scoring tasks: every paragraph of engine_ppl spans several windows
TOL = 1e-4

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def engines(engines: dict[str, Any]) -> dict[str, Any]:
    """The shared engines of the backends the lm-eval model runs on: those that score sequences and constrain
    output (HF, vLLM). llama.cpp has neither here; :func:`test_a_backend_without_scoring_is_refused` covers it."""
    return {b: e for b, e in engines.items()
            if e.backend.capabilities.scoring and e.backend.capabilities.structured_outputs}


@pytest.fixture(scope="module", autouse=True)
def environment_reported_once() -> Any:
    """lm-eval adds torch's ``collect_env`` report to every result, and that runs ``pip list``: 6 s per ``evaluate``
    call in the suite's venv, about 20 calls here. The environment cannot change within the module, so the report is
    collected once and every later result gets the same values (the CLI check runs lm-eval unchanged)."""
    import copy

    import lm_eval.evaluator as evaluator

    collected: dict[str, Any] = {}
    original = evaluator.add_env_info

    def once(storage: dict[str, Any]) -> None:
        if not collected:
            original(collected)
        storage.update(copy.deepcopy(collected))

    patch = pytest.MonkeyPatch()
    patch.setattr(evaluator, "add_env_info", once)
    yield
    patch.undo()


def evaluate(model: Any, tasks: list[str], *, model_args: dict[str, Any] | None = None, chat: bool = False,
             limit: int | None = None, max_gen_toks: int | None = None) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from engine.lm_eval import register

    register()
    os.chdir(ROOT)  # the task YAMLs name their data relative to it (task_root)
    shorter = {"max_gen_toks": max_gen_toks} if max_gen_toks else None  # overrides the task's generation_kwargs
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True, limit=limit,
                           apply_chat_template=chat, gen_kwargs=shorter,
                           task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))


def engine_lm(engine: Any, **args: Any) -> Any:
    from engine.lm_eval.model import EngineLM

    return EngineLM(engine=engine, **args)


def sample_values(result: dict[str, Any], task: str) -> list[Any]:
    """Per document, what the model answered: log-likelihoods (floats) or generated texts."""
    values = []
    for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"]):
        for resp in sample["resps"]:
            first = resp[0]
            values.append(first[0] if isinstance(first, (tuple, list)) else first)
    return values


def metrics(result: dict[str, Any], task: str) -> dict[str, float]:
    return {k: v for k, v in result["results"][task].items() if "," in k and "stderr" not in k}


def assert_close(got: list[Any], want: list[Any], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, str):
            assert g == w, f"{what} [{i}]: {g!r} != {w!r}"
        else:
            assert abs(float(g) - float(w)) <= TOL * max(1.0, abs(float(w))), f"{what} [{i}]: {g} vs {w}"


@pytest.fixture(scope="module")
def limit(workload) -> int | None:
    """Documents per task: all of them in the full gate, the first 4 in the quick tier (every task still has
    documents of each kind: several 64-token windows per paragraph, answers that are and are not valid JSON)."""
    return workload.pick(full=None, quick=4)


@pytest.fixture(scope="module")
def reference(pool, limit) -> dict[str, dict[str, Any]]:
    """lm-eval's own hf model on the scoring tasks (window 64) and on the JSON task (chat template)."""
    from engine.backends.hf.backend import resolve_device

    # batch_size 8 (lm-eval's default is 1): its generations and scores are the same (greedy JSON answers identical,
    # multiple-choice log-likelihoods 1.5e-5 apart, well inside TOL) in a quarter less time.
    args = {"pretrained": pool.options.model, "dtype": pool.options.dtype,
            "device": resolve_device(pool.options.device), "batch_size": 8}
    return {"scoring": evaluate("hf", SCORING, model_args={**args, "max_length": WINDOW}, limit=limit),
            "json": evaluate("hf", ["engine_json"], model_args=args, chat=True, limit=limit)}


@pytest.fixture(scope="module")
def runs(engines, limit) -> dict[str, dict[str, Any]]:
    """Each backend's engine model on the same runs as :func:`reference`."""
    return {b: {"scoring": evaluate(engine_lm(e, max_length=WINDOW), SCORING, limit=limit),
                "json": evaluate(engine_lm(e), ["engine_json"], chat=True, limit=limit)} for b, e in engines.items()}


def test_scores_equal_lm_evals_hf_model(runs, reference, pool):
    if pool.options.dtype != "float32":
        pytest.skip("exact agreement is the fp32 contract; other dtypes follow vLLM's close-logprobs rule")
    for backend, run in runs.items():
        for kind, tasks in (("scoring", SCORING), ("json", ["engine_json"])):
            for task in tasks:
                got, want = metrics(run[kind], task), metrics(reference[kind], task)
                assert got.keys() == want.keys(), task
                assert_close([got[k] for k in want], list(want.values()), f"{backend} {task} scores")
                assert_close(sample_values(run[kind], task), sample_values(reference[kind], task),
                             f"{backend} {task} per-document answers")
        print(f"{backend}: " + "; ".join(f"{t} {metrics(run[k], t)}" for k, ts in
                                         (("scoring", SCORING), ("json", ["engine_json"])) for t in ts))


def test_backends_agree_on_loglikelihoods_and_generations(runs, pool):
    if pool.options.dtype != "float32":
        pytest.skip("exact agreement is the fp32 contract; other dtypes follow vLLM's close-logprobs rule")
    (name_a, run_a), (name_b, run_b) = list(runs.items())[:2]
    for task in SCORING:
        assert_close(sample_values(run_a["scoring"], task), sample_values(run_b["scoring"], task),
                     f"{name_a} vs {name_b} {task}")
    assert sample_values(run_a["json"], "engine_json") == sample_values(run_b["json"], "engine_json")


def test_constrained_answers_are_all_valid_where_free_ones_are_not(engines, limit):
    rates, answers = {}, {}
    for backend, engine in engines.items():
        for constrained in (False, True):
            lm = engine_lm(engine, response_schema=str(SCHEMA), constrained=constrained)
            result = evaluate(lm, ["engine_json"], chat=True, limit=limit)
            counts = result["config"]["engine"]["schema_answers"]
            assert counts["checked"] == len(result["samples"]["engine_json"])
            rates[backend, constrained] = counts["valid_rate"]
            answers[backend, constrained] = sample_values(result, "engine_json")
            if constrained:
                assert all(isinstance(json.loads(a), dict) for a in answers[backend, True])
    print("schema-valid rate (free, constrained): "
          + ", ".join(f"{b} {rates[b, False]:.2f} / {rates[b, True]:.2f}" for b in engines))
    for backend in engines:
        assert rates[backend, True] == 1.0, answers[backend, True]
        assert rates[backend, False] < 1.0
    first, *others = list(engines)
    for other in others:
        assert answers[other, True] == answers[first, True]


def test_on_invalid_strategies(engines):
    """Unconstrained, the fixture model never answers engine_json with the schema's object: every strategy
    handles the failures its own way, and counts them. (24 new tokens instead of the task's 64: no answer is valid
    either way, and the five runs cost a third.)"""
    engine = engines["hf"] if "hf" in engines else next(iter(engines.values()))
    schema = {"response_schema": str(SCHEMA)}
    short = {"chat": True, "limit": 3, "max_gen_toks": 24}
    raw = evaluate(engine_lm(engine, **schema, on_invalid="raw"), ["engine_json"], **short)
    free = evaluate(engine_lm(engine), ["engine_json"], **short)
    assert sample_values(raw, "engine_json") == sample_values(free, "engine_json")  # text as generated
    assert raw["config"]["engine"]["schema_answers"]["valid"] == 0

    marked = evaluate(engine_lm(engine, **schema, invalid_answer="<bad>"), ["engine_json"], **short)
    assert set(sample_values(marked, "engine_json")) == {"<bad>"}
    counts = marked["config"]["engine"]["schema_answers"]
    assert sum(counts["invalid"].values()) == 3 and counts["first_reason"]

    retried = evaluate(engine_lm(engine, **schema, on_invalid="retry", retries=2), ["engine_json"], **short)
    counts = retried["config"]["engine"]["schema_answers"]
    assert counts["retried"] >= 3  # every failure was generated again (sampled) before giving up
    assert counts["valid"] + sum(counts["invalid"].values()) == 3
    assert counts["valid"] == counts["recovered_by_retry"]

    from engine.lm_eval.schema import InvalidAnswerError

    with pytest.raises(InvalidAnswerError, match="not valid for the response schema"):
        evaluate(engine_lm(engine, **schema, on_invalid="raise"), ["engine_json"], **short)


def test_cache_answers_a_second_run_and_misses_on_any_change(engines, tmp_path):
    engine = engines["hf"] if "hf" in engines else next(iter(engines.values()))
    cache = str(tmp_path / "answers.sqlite")
    base = {"cache": cache, "response_schema": str(SCHEMA), "constrained": True}

    first = engine_lm(engine, **base)
    one = evaluate(first, ["engine_json", "engine_mc"], chat=True, limit=4)
    assert first.backend_calls > 0 and first.cache_hits == 0

    again = engine_lm(engine, **base)
    two = evaluate(again, ["engine_json", "engine_mc"], chat=True, limit=4)
    assert again.backend_calls == 0, "a second identical run must answer from the cache"
    assert again.cache_misses == 0 and again.cache_hits == first.cache_misses
    for task in ("engine_json", "engine_mc"):
        assert sample_values(two, task) == sample_values(one, task)

    other_schema = json.loads(SCHEMA.read_text())
    other_schema["properties"]["city"]["maxLength"] = 40
    changed = engine_lm(engine, **{**base, "response_schema": other_schema})
    evaluate(changed, ["engine_json"], chat=True, limit=4)
    assert changed.cache_hits == 0 and changed.backend_calls > 0, "a schema change must not reuse answers"

    setting = engine_lm(engine, **{**base, "constrained": False})
    evaluate(setting, ["engine_json"], chat=True, limit=4)
    assert setting.cache_hits == 0 and setting.backend_calls > 0, "a settings change must not reuse answers"


@pytest.mark.slow
def test_lm_eval_cli_runs_the_engine_model(pool, tmp_path):
    """The real CLI (lm-eval's own, with ``engine`` registered): a constrained JSON run and a scoring task, on the
    first 4 documents of each (``--limit``, a CLI option too): the in-process checks above cover every document
    in the full gate."""
    args = {"backend": "hf", "pretrained": pool.options.model, "dtype": pool.options.dtype,
            "response_schema": str(SCHEMA), "constrained": True}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "engine.lm_eval", "run", "--model", "engine", "--model_args", json.dumps(args),
               "--tasks", "engine_json", "engine_mc", "--include_path", str(TASKS), "--apply_chat_template",
               "--output_path", str(out), "--log_samples", "--limit", "4"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    info = results["config"]["engine"]
    assert info["backend"] == "hf" and info["constrained"] is True
    assert info["schema_answers"]["valid_rate"] == 1.0
    assert results["results"]["engine_json"]["valid_json,none"] == 1.0
    assert 0.0 <= results["results"]["engine_mc"]["acc,none"] <= 1.0
    assert "engine_json" in done.stdout  # lm-eval's own results table


@pytest.mark.gate_only(reason=(
    "a third lm_eval CLI run per backend, over HTTP (34 s on CI); CI keeps the lm_eval CLI on the "
    "engine model (test_lm_eval_cli_runs_the_engine_model), its scores against lm_eval's own hf model "
    "(test_scores_equal_lm_evals_hf_model) and /v1/completions echo scoring (test_hostile.py's echo "
    "checks, test_vllm_serve_side_by_side)"))
@pytest.mark.slow
def test_lm_eval_local_completions_over_the_server_scores_as_the_engine_model(runs, chat_server, pool, tmp_path,
                                                                            limit):
    """lm-eval's own ``local-completions`` model (the real CLI, tokenizing through the server's ``/tokenizer_info``
    and ``/tokenize``) scores over HTTP with ``echo`` and ``logprobs`` on ``/v1/completions``: per document the same
    log-likelihoods (multiple choice, rolling perplexity in the same 64-token windows) and the same metrics as the
    in-process ``engine`` model, on every backend that scores."""
    import httpx

    from conformance.subjects.served import scrape

    if pool.options.dtype != "float32":
        pytest.skip("exact agreement is the fp32 contract; other dtypes follow vLLM's close-logprobs rule")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = {}  # one CLI per backend, all at once (each on its own server): their start-ups overlap
    try:
        for backend in runs:
            server = chat_server(backend)
            model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
            # lm-eval's API models keep one token for generation and one for the window's context: max_length 66 gives
            # the 64-token windows of the engine model's max_length 64.
            args = {"base_url": f"{server.url}/v1/completions", "model": model, "max_length": WINDOW + 2,
                    "num_concurrent": 1, "max_retries": 1}
            out = tmp_path / backend
            command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
                       json.dumps(args), "--tasks", *SCORING, "--include_path", str(TASKS), "--output_path", str(out),
                       "--log_samples", "--batch_size", "16"]  # 16 prompts per request
            command += ["--limit", str(limit)] if limit else []  # the in-process runs' documents
            tokenized = scrape(server.url, "engine_requests_total", endpoint="tokenize", status="200")
            log = (tmp_path / f"{backend}.log").open("w+")
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            started[backend] = (server, out, tokenized, process, log)
        for backend, (server, out, tokenized, process, log) in started.items():
            code = process.wait(timeout=600)
            log.seek(0)
            assert code == 0, log.read()[-3000:]
            assert scrape(server.url, "engine_requests_total", endpoint="tokenize", status="200") > tokenized, \
                "lm-eval did not tokenize through the server (its /tokenizer_info and /tokenize)"
            served = {"results": json.loads(next(out.rglob("results_*.json")).read_text())["results"], "samples": {}}
            for task in SCORING:
                lines = next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
                served["samples"][task] = [json.loads(line) for line in lines]
                got, want = metrics(served, task), metrics(runs[backend]["scoring"], task)
                assert got.keys() == want.keys(), task
                assert_close([got[k] for k in want], list(want.values()), f"{backend} {task} metrics over HTTP")
                assert_close(sample_values(served, task), sample_values(runs[backend]["scoring"], task),
                             f"{backend} {task} per-document log-likelihoods over HTTP")
    finally:  # a failure leaves no CLI running
        for *_, process, log in started.values():
            process.kill()
            log.close()


def test_a_backend_without_scoring_is_refused(pool, backend_names):
    """On llama.cpp (no scoring, no structured outputs) the lm-eval model refuses log-likelihood requests and
    constrained answers with a typed error naming the capability, before anything is generated."""
    if "llamacpp" not in backend_names:
        pytest.skip("needs the llamacpp backend (the one without scoring) in --engine-backends")
    from engine.errors import UnsupportedCapabilityError

    engine = pool.text_engine("llamacpp")
    calls: list[int] = []
    original = engine.backend.generate
    engine.backend.generate = lambda p, plan, **kw: calls.append(len(p)) or original(p, plan, **kw)
    try:
        with pytest.raises(UnsupportedCapabilityError, match="score"):
            evaluate(engine_lm(engine), ["engine_mc"], limit=1)
        with pytest.raises(UnsupportedCapabilityError, match="JSON Schema"):
            evaluate(engine_lm(engine, response_schema=str(SCHEMA), constrained=True), ["engine_json"], chat=True,
                     limit=1)
    finally:
        del engine.backend.generate
    assert calls == [], "a refused request generated tokens"


def test_is_greedy_holds_exactly_for_argmax_continuations(engines):
    """lm-eval's ``is_greedy`` (exact-match metrics read it): true when every continuation token is the model's argmax
    there, false as soon as one is not, on every backend that scores. The continuation is the engine's own greedy
    answer as token ids (no retokenization), then that answer with its first or its last token swapped."""
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    for backend, engine in engines.items():
        lm = engine_lm(engine)
        vocab = len(engine.tokenizer)
        requests, expected = [], []
        for text in prompts:
            (answer,) = engine.complete([text], options={"max_new_tokens": 5, "temperature": 0})
            context = engine.tokenizer.encode(text, add_special_tokens=False)
            greedy = [t for t in answer.token_ids if t not in engine.load_info.eos_token_ids]
            assert len(greedy) >= 2, f"{backend}: {text!r} ended too early to swap a token"
            first = [(greedy[0] + 1) % vocab, *greedy[1:]]
            last = [*greedy[:-1], (greedy[-1] + 1) % vocab]
            for continuation, want in ((greedy, True), (first, False), (last, False)):
                requests.append(((text, ""), context, continuation))
                expected.append(want)
        answers = lm._loglikelihood_tokens(requests)
        assert [greedy for _, greedy in answers] == expected, backend
        for i in range(0, len(answers), 3):  # the argmax path is the likeliest of the three
            assert answers[i][0] > max(answers[i + 1][0], answers[i + 2][0]), f"{backend}: prompt {i // 3}"
