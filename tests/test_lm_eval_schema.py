"""JSON extraction and schema validation of lm-eval answers (pure code; property-tested)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.errors import ConfigError
from engine.lm_eval.schema import InvalidAnswer, ResponseSchema, canonical_json, extract_json

scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
containers = st.lists(values, max_size=4) | st.dictionaries(st.text(max_size=8), values, max_size=4)
prose = st.text(alphabet=st.characters(blacklist_characters="{}[]`"), max_size=40)


@given(containers, st.booleans())
def test_bare_json_round_trips(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only, indent=2 if ascii_only else None)
    assert extract_json(text) == (value, "bare")


@given(containers, prose, prose, st.sampled_from(["json", "JSON", ""]))
def test_fenced_json_round_trips(value, before, after, language):
    text = f"{before}\n```{language}\n{json.dumps(value, indent=1)}\n```\n{after}"
    assert extract_json(text)[0] == value


@given(containers, prose, prose)
def test_json_in_prose_round_trips(value, before, after):
    text = f"{before} {json.dumps(value)} {after}"
    assert extract_json(text)[0] == value


@given(st.dictionaries(st.text(max_size=6), st.text(alphabet='"\\{}[]\n\t\u00e9', max_size=8), min_size=1, max_size=3))
def test_brackets_and_escapes_inside_strings_do_not_end_the_value(value):
    text = f"Result: {json.dumps(value)} -- end"
    assert extract_json(text)[0] == value


def test_a_bracketed_aside_before_the_json_is_skipped():
    assert extract_json('As noted [sic], the answer is {"a": [1, 2]}.') == ({"a": [1, 2]}, "prose")


@pytest.mark.parametrize(("text", "kind"), [
    ("no json at all", "no_json"),
    ('```json\n{"a": 1,\n', "unclosed_json"),
    ("{'a': 1}", "parse_error"),
])
def test_failures_name_their_kind(text, kind):
    with pytest.raises(InvalidAnswer) as err:
        extract_json(text)
    assert err.value.kind == kind


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array"}},
          "required": ["n"], "additionalProperties": False}


@given(st.integers(), st.lists(st.text(max_size=5), max_size=3), prose)
def test_valid_answers_come_back_as_canonical_json(n, tags, before):
    schema = ResponseSchema.load(SCHEMA)
    answer = schema.answer(f"{before} {json.dumps({'tags': tags, 'n': n}, indent=2)}")
    assert answer == canonical_json({"n": n, "tags": tags})
    assert json.loads(answer) == {"n": n, "tags": tags}


@pytest.mark.parametrize(("value", "where"), [({"n": "3"}, "$.n"), ({}, "$"), ({"n": 1, "x": 2}, "$")])
def test_schema_violations_say_where(value, where):
    with pytest.raises(InvalidAnswer) as err:
        ResponseSchema.load(SCHEMA).answer(json.dumps(value))
    assert err.value.kind == "schema_violation" and f"at {where}" in err.value.reason


def test_a_pydantic_model_validates_and_agrees_with_its_schema_file():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval_tasks"
    model = "engine_fixtures.lm_eval_tasks.city_model.CityAnswer"
    both = ResponseSchema.load(str(root / "city_schema.json"), model)
    assert both.hash == ResponseSchema.load(schema_model=model).hash
    assert both.answer('{"country": "France", "city": "Paris"}') == '{"city":"Paris","country":"France"}'
    with pytest.raises(InvalidAnswer, match=r"at \$.city"):
        both.answer('{"city": 3, "country": "France"}')
    with pytest.raises(ConfigError, match="disagrees with schema_model"):
        ResponseSchema.load({"type": "object"}, model)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"response_schema": "{not json"}, "response_schema"),
    ({"response_schema": "/no/such/schema.json"}, "response_schema"),
    ({"response_schema": {"type": "no-such-type"}}, "response_schema"),
    ({"schema_model": "engine_fixtures.no_such_module.Model"}, "schema_model"),
    ({"schema_model": "json.JSONDecoder"}, "schema_model"),
    ({}, "response_schema"),
])
def test_bad_schema_options_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ResponseSchema.load(**kwargs)
    assert err.value.field == field and err.value.fix


def test_schema_hash_changes_with_the_schema():
    a = ResponseSchema.load(SCHEMA)
    b = ResponseSchema.load({**SCHEMA, "required": ["n", "tags"]})
    assert a.hash != b.hash and a.hash == ResponseSchema.load(json.dumps(SCHEMA, indent=4)).hash
