"""``--engine-target-*``: bad values are refused by name before anything starts, in the options' own rule and through
the plugin (a usage error, exit 4); the refusal-shape and differs rules of ``conformance/subjects/target.py``."""

from __future__ import annotations

import pytest

from conformance.subjects.target import Findings, TargetOptions, error_shape_problem
from tests.test_plugin_scope import pytest_in

GOOD = {"url": "http://127.0.0.1:8000", "model": None, "key": None, "extra_body": None, "context": None,
        "strict": False}


@pytest.mark.parametrize(("change", "match"), [
    ({"extra_body": "{repeat_penalty: 1}"}, r"--engine-target-extra-body: .* is not JSON"),
    ({"extra_body": "[1, 2]"}, r"--engine-target-extra-body: .* is not a JSON object"),
    ({"url": "127.0.0.1:8000"}, r"--engine-target-url: '127.0.0.1:8000' is not an http\(s\) URL"),
    ({"url": None, "model": "m"}, r"need --engine-target-url"),
    ({"url": None, "strict": True}, r"need --engine-target-url"),
    ({"context": 4}, r"--engine-target-context: 4 is too small"),
])
def test_bad_target_options_are_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        TargetOptions.of(**{**GOOD, **change})


def test_the_url_is_the_servers_base():
    assert TargetOptions.of(**{**GOOD, "url": "http://127.0.0.1:8000/v1/"}).url == "http://127.0.0.1:8000"
    assert TargetOptions.of(**{**GOOD, "url": None}) == TargetOptions()


def test_the_plugin_refuses_a_bad_target_before_the_session(tmp_path):
    (tmp_path / "test_user.py").write_text("def test_x():\n    pass\n")
    done = pytest_in(tmp_path, "--engine-target-url=http://127.0.0.1:9", "--engine-target-extra-body=[1]")
    assert done.returncode == 4 and "--engine-target-extra-body: '[1]' is not a JSON object" in done.stderr


@pytest.mark.parametrize(("status", "body", "problem"), [
    (400, {"error": {"message": "max_tokens must be at least 1"}}, None),
    (404, {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError"}}, None),
    (422, {"detail": [{"msg": "bad"}]}, "no 'error' object"),
    (400, {"error": {"message": ""}}, "no 'error' object"),
    (500, {"error": {"message": "validation error"}}, "not a 4xx"),
    (200, {"choices": []}, "accepted"),
])
def test_a_refusal_has_the_openai_shape(status, body, problem):
    found = error_shape_problem(status, body)
    assert (found is None) if problem is None else (problem in found)


def test_findings_pass_when_none_and_otherwise_differ_or_fail():
    Findings(strict=False).settle()  # nothing found: the check passes
    lenient = Findings(strict=False)
    lenient.differ("stop_token_ids ignored")
    with pytest.raises(pytest.xfail.Exception, match="differs: stop_token_ids ignored"):
        lenient.settle()
    strict = Findings(strict=True)
    strict.differ("stop_token_ids ignored")
    with pytest.raises(pytest.fail.Exception, match="differs from the HF reference: stop_token_ids ignored"):
        strict.settle()


def test_the_stock_launcher_refuses_a_model_without_its_gguf(capsys):
    from conformance.subjects import stock

    with pytest.raises(SystemExit) as exited:
        stock.main(["llama-cpp-server", "--model", "/my/model", "--", "-k", "greedy"])  # nothing starts
    assert exited.value.code == 2 and "--gguf: required with --model" in capsys.readouterr().err
