"""The fixture cache: keyed by content, skipped when current, rebuilt when the key changes."""

from __future__ import annotations

from engine_fixtures import cache
from engine_fixtures.data import PROMPT_SETS, load_prompts


def test_publish_and_key(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "weights.bin").write_bytes(b"abc")
    target = tmp_path / "fx"
    key = cache.compute_key(["fx", "source v1"])
    assert not cache.is_current(target, key)
    cache.publish(staging, target, key)
    assert cache.is_current(target, key)
    assert not cache.is_current(target, cache.compute_key(["fx", "source v2"]))
    first = cache.sha256_tree(target)
    (target / "weights.bin").write_bytes(b"abd")
    assert cache.sha256_tree(target) != first


def test_manifest_records(tmp_path):
    cache.record(tmp_path, "fx", {"source_package": "pkg", "source_version": "1.0", "key": "k"})
    manifest = cache.read_manifest(tmp_path)
    assert manifest["fx"]["source_package"] == "pkg" and "recorded_at" in manifest["fx"]


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache.cache_dir() == (tmp_path / "elsewhere").resolve()


def test_prompt_sets_are_well_formed():
    for name in PROMPT_SETS:
        records = load_prompts(name)
        assert records, name
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)), f"{name}: duplicate ids"
        for r in records:
            assert r["messages"] and all({"role", "content"} <= set(m) for m in r["messages"])
    assert len(load_prompts("chat")) == 6


def test_large_fixtures_are_built_only_on_demand():
    from engine_fixtures.build import FIXTURES, default_fixtures

    assert "qwen2-0.5b-random" in FIXTURES and "qwen2-0.5b-random" not in default_fixtures()
    defaults = set(default_fixtures())
    assert {"smollm2-135m-instruct", "tiny-looper", "tiny-chat", "tiny-chat-gguf", "tiny-qwen2-vl"} <= defaults


def test_fixture_key_covers_the_shared_builder_module(monkeypatch):
    import inspect

    from engine_fixtures import seeded
    from engine_fixtures.build import FIXTURES

    before = FIXTURES["tiny-looper"].key()
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj) + ("# edited" if obj is seeded else ""))
    assert FIXTURES["tiny-looper"].key() != before  # editing fixtures/seeded.py rebuilds the looper


SYNTHETIC_BUILDER = """def build(out):
    (out / "weights.bin").write_bytes(b"synthetic")
"""


def synthetic_fixture(tmp_path, monkeypatch, name="synthetic"):
    """A fixture whose builder writes one file (registered for this test only): the cache's rules, without the
    20-s build of a real model."""
    import importlib.util

    from engine_fixtures import build as fixture_build

    source = tmp_path / "synthetic_builder.py"
    source.write_text(SYNTHETIC_BUILDER)
    spec = importlib.util.spec_from_file_location("engine_fixtures_synthetic_builder", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Synthetic(fixture_build.Fixture):
        def builder(self):
            return module

    monkeypatch.setitem(fixture_build.FIXTURES, name, Synthetic(name, "synthetic_builder"))
    return name


def test_as_built_uses_a_built_fixture_whatever_its_key(tmp_path, monkeypatch):
    """``ENGINE_FIXTURES_AS_BUILT=1`` (nox -s vllm-versions): a built fixture is not rebuilt under other package
    versions; one that was never built still is."""
    from engine_fixtures import build as fixture_build

    monkeypatch.setenv("ENGINE_FIXTURES_DIR", str(tmp_path / "cache"))
    name = synthetic_fixture(tmp_path, monkeypatch)
    monkeypatch.setenv(fixture_build.AS_BUILT, "1")
    target = fixture_build.ensure(name)  # never built: built, whatever AS_BUILT says
    assert (target / "weights.bin").read_bytes() == b"synthetic"
    (target / ".fixture-key").write_text("another venv's key\n")
    assert fixture_build.ensure(name) == target
    assert (target / ".fixture-key").read_text() == "another venv's key\n"
    monkeypatch.delenv(fixture_build.AS_BUILT)
    fixture_build.ensure(name)
    assert (target / ".fixture-key").read_text() != "another venv's key\n"
