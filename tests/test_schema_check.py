"""The schema check's bounds (``engine.rules.schema_check``), with a stand-in compile: a schema whose grammar takes
longer than the bound is refused, and while its work still runs a new schema waits for the one worker, then is
refused as busy; a cached schema never waits. The real compiles run in conformance/test_hostile.py."""

from __future__ import annotations

import threading
import time

import pytest

from engine.errors import RequestError
from engine.rules import schema_check

pytest.importorskip("xgrammar", reason="the schema check needs xgrammar (installed by `nox -s tests`)")


def test_a_slow_schema_is_refused_and_holds_one_worker_until_its_work_ends(monkeypatch):
    monkeypatch.setattr(schema_check, "CHECK_SECONDS", 0.3)
    released = threading.Event()

    def slow(schema):
        released.wait(5)

    with pytest.raises(RequestError, match=r"took longer than 0\.3 s"):
        schema_check.check_schema('{"type":"string","maxLength":7}', slow)
    began = time.perf_counter()
    with pytest.raises(RequestError, match="still being built"):
        schema_check.check_schema('{"type":"string","maxLength":8}', slow)
    assert time.perf_counter() - began >= 0.3  # it waited for the worker, up to the bound
    released.set()
    time.sleep(0.2)  # the late work ends and frees the worker
    schema_check.check_schema('{"type":"string","maxLength":9}', lambda schema: None)
    schema_check.check_schema('{"type":"string","maxLength":9}', slow)  # another owner: checked again, fast now


def test_a_compile_error_is_a_request_error_naming_json_schema():
    def refuses(schema):
        raise RuntimeError("[12:00:00] /project/cpp/x.cc:12: Check failed: no")

    with pytest.raises(RequestError, match="cannot be built into a grammar: Check failed: no") as err:
        schema_check.check_schema('{"type":"string","maxLength":10}', refuses)
    assert err.value.field == "json_schema"


def test_oversized_schemas_and_nested_counts_are_refused_before_building():
    with pytest.raises(RequestError, match="characters long"):
        schema_check.check_schema('{"enum":["' + "x" * schema_check.MAX_SCHEMA_CHARS + '"]}')
    with pytest.raises(RequestError, match="repeating 1998 times in all"):
        schema_check.check_schema('{"type":"string","pattern":"(a{999}){999}"}')
