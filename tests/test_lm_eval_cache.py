"""The lm-eval model's SQLite answer cache: keys, damaged and locked files, and a writer killed mid-run."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from engine.lm_eval.cache import AnswerCache, CacheError, cache_key

CONTEXT = {"model": {"path": "/m", "files": "abc"}, "schema": "h1", "engine": {"dtype": "float32"}}


def test_every_part_of_the_key_matters():
    base = cache_key("generate_until", ["Q", {"until": ["\n"]}], CONTEXT)
    assert base == cache_key("generate_until", ["Q", {"until": ["\n"]}], dict(CONTEXT))
    changed = [
        cache_key("loglikelihood", ["Q", {"until": ["\n"]}], CONTEXT),
        cache_key("generate_until", ["Q ", {"until": ["\n"]}], CONTEXT),
        cache_key("generate_until", ["Q", {"until": ["\n"]}], {**CONTEXT, "schema": "h2"}),
        cache_key("generate_until", ["Q", {"until": ["\n"]}], {**CONTEXT, "engine": {"dtype": "bfloat16"}}),
        cache_key("generate_until", ["Q", {"until": ["\n"]}], {**CONTEXT, "model": {"path": "/m", "files": "abd"}}),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_answers_survive_reopening(tmp_path):
    path = tmp_path / "c.sqlite"
    with AnswerCache(path) as cache:
        cache.put_many({"a": [-1.25, False], "b": "text \u00e9", "c": 3.5})
    with AnswerCache(path) as cache:
        assert cache.get_many(["a", "b", "c", "zz"]) == {"a": [-1.25, False], "b": "text \u00e9", "c": 3.5}
        assert len(cache) == 3


def test_a_file_that_is_not_a_database_is_set_aside_and_rebuilt(tmp_path, caplog):
    path = tmp_path / "c.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    with AnswerCache(path) as cache:
        assert cache.get_many(["a"]) == {} and len(cache) == 0
        cache.put_many({"a": 1})
    assert any(p.name.startswith("c.sqlite.corrupt-") for p in tmp_path.iterdir())
    assert "not a usable SQLite database" in caplog.text


def test_a_locked_file_is_a_clear_error(tmp_path):
    path = tmp_path / "c.sqlite"
    AnswerCache(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        cache = AnswerCache(path, timeout_s=0.2)
        with pytest.raises(CacheError, match="locked by another process"):
            cache.put_many({"a": 1})
    except CacheError as err:  # opening itself may already hit the lock
        assert "locked by another process" in str(err)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


WRITER = """
import sys, time
from engine.lm_eval.cache import AnswerCache
cache = AnswerCache(sys.argv[1])
batch = 0
while True:
    cache.put_many({f"k{batch}-{i}": [batch, i, "x" * 200] for i in range(50)})
    batch += 1
    if batch == 5:
        print("ready", flush=True)
"""


def test_a_killed_writer_leaves_a_cache_that_opens_and_answers_correctly(tmp_path):
    path = tmp_path / "c.sqlite"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # mid-stream: it writes batch after batch
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    with AnswerCache(path) as cache:
        count = len(cache)
        assert count >= 250 and count % 50 == 0, "only whole batches are ever visible"
        rows = cache.get_many([f"k{b}-{i}" for b in range(count // 50) for i in range(50)])
        assert len(rows) == count
        assert all(value == [int(key[1:].split("-")[0]), int(key.split("-")[1]), "x" * 200]
                   for key, value in rows.items())
        cache.put_many({"after": True})
        assert cache.get_many(["after"]) == {"after": True}


def test_engine_model_arguments_are_checked_before_any_model_loads():
    pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed")
    from engine.errors import ConfigError
    from engine.lm_eval.model import EngineLM

    for kwargs, field in [({"temprature": 0.5}, "model_args"), ({"on_invalid": "ignore"}, "on_invalid"),
                          ({"retries": -1}, "retries"), ({"constrained": True}, "constrained"),
                          ({"max_gen_toks": 0}, "max_gen_toks"), ({}, "pretrained")]:
        with pytest.raises(ConfigError) as err:
            EngineLM(**kwargs)
        assert err.value.field == field, kwargs
