"""The outputs record and the release comparison (``conformance/kit/outputs.py``, ``layers.py``, ``history.py``):
rows written and read back as Parquet, every layer named where it first differs, acceptance as a snapshot update,
the command's exit status, and the served twin that records each call. Synthetic rows and a stand-in engine: the
real backends record in every conformance run (``conformance/test_history.py`` seeds each layer's change in a copy of
a fixture)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.kit import history, outputs
from conformance.kit.layers import LAYERS, first_layer
from engine.types import GenerationResult

ROW = {"check": "conformance/test_x.py::test_a[hf]", "subject": "hf tiny-chat", "case": "abc-0/0",
       "request": "[]", "call": "{}", "sampling": "greedy", "error": "", "prompt_text": "<u>hi</u>",
       "prompt_ids": [1, 7, 2],
       "ids": [5, 6, 2], "top_ids": [[5, 9], [6, 9], [2, 9]],
       "top_logprobs": [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]],
       "finish_reason": "stop", "stop_reason": "2", "text": "ab", "raw_text": "ab</s>",
       "meta": '{"repeat_terminate_index": null}'}

CHANGES = {
    "refusal": {"error": "RequestError requests[0].messages"},
    "template": {"prompt_text": "<u>hi</u>\n", "prompt_ids": [1, 7, 8, 2]},
    "tokenizer": {"prompt_ids": [1, 70, 2]},
    "ids": {"ids": [5, 7, 2], "text": "ac", "raw_text": "ac</s>"},
    "logprobs": {"top_logprobs": [[-0.1, -2.0], [-0.25, -3.0], [-0.3, -4.0]]},
    "ending": {"ids": [5, 6], "finish_reason": "length", "stop_reason": "null", "raw_text": "ab"},
    "text": {"text": "a b"},
    "meta": {"meta": '{"repeat_terminate_index": 3}'},
}
"""One change per layer, each also moving what comes after it where a real change would."""


def test_every_layer_is_named_where_it_first_differs_and_at_no_earlier_one():
    assert list(CHANGES) == list(LAYERS)
    for layer, change in CHANGES.items():
        found = first_layer(ROW, {**ROW, **change})
        assert found is not None and found[0] == layer, (layer, found)
    assert first_layer(ROW, dict(ROW)) is None


def test_logprobs_within_the_float32_bound_are_equal_and_a_token_new_to_the_top_k_is_judged_by_the_edge():
    assert first_layer(ROW, {**ROW, "top_logprobs": [[-0.1005, -2.0], [-0.2, -3.0], [-0.3, -4.0]]}) is None
    near_tie = {**ROW, "top_ids": [[5, 11], [6, 9], [2, 9]]}  # another token at the edge, at the same value
    assert first_layer(ROW, near_tie) is None
    moved = {**ROW, "top_ids": [[5, 11], [6, 9], [2, 9]], "top_logprobs": [[-0.1, -1.0], [-0.2, -3.0], [-0.3, -4.0]]}
    assert first_layer(ROW, moved)[0] == "logprobs"
    assert first_layer(ROW, moved, bound=2.0) is None


def test_an_unseeded_row_is_held_to_its_prompt_only_and_minus_infinity_equals_itself():
    unseeded = {**ROW, "sampling": "unseeded"}
    assert first_layer(unseeded, {**unseeded, **CHANGES["ids"]}) is None
    assert first_layer(unseeded, {**unseeded, **CHANGES["tokenizer"]})[0] == "tokenizer"
    support = {**ROW, "top_logprobs": [[-0.1, float("-inf")], [-0.2, -3.0], [-0.3, -4.0]]}
    assert first_layer(support, dict(support)) is None
    assert first_layer(support, {**support, "top_logprobs": ROW["top_logprobs"]})[0] == "logprobs"


def test_a_divergence_says_the_position_both_tokens_and_their_top_k():
    layer, detail = first_layer(ROW, {**ROW, **CHANGES["ids"]})
    assert layer == "ids" and detail.startswith("position 1: 6 -> 7") and "top-k old {6: -0.2, 9: -3.0}" in detail


def rows(*changes, check=ROW["check"]):
    return [{**ROW, "check": check, "case": f"c{i}-0/0", **change} for i, change in enumerate(changes)]


def test_compare_counts_equal_changed_new_gone_and_cases_of_checks_not_run():
    old = rows({}, {}, {}) + rows({}, check="conformance/test_x.py::test_b[hf]")
    new = [*rows({}, CHANGES["ids"]), {**ROW, "case": "c9-0/0"}]
    result = history.compare(old, new)
    assert result.counts == {"equal": 1, "changed": 1, "new": 1, "gone": 1, "not run": 1}
    assert [(c.status, c.case) for c in result.changes] == [("changed", "c1-0/0"), ("new", "c9-0/0"),
                                                             ("gone", "c2-0/0")]
    assert result.failing() == 1


def test_an_accepted_change_passes_until_its_answer_changes_again(tmp_path):
    file = tmp_path / "accepted.json"
    old, new = rows({}, {}), rows({}, CHANGES["template"])
    result = history.compare(old, new, accepted=history.read_accepted(file))
    with pytest.raises(ValueError, match="--reason is empty"):
        history.accept(result, file, " ")
    assert history.accept(result, file, "the template gained a trailing newline") == 1
    entry = json.loads(file.read_text())["accepted"][0]
    assert entry["layer"] == "template" and entry["reason"] == "the template gained a trailing newline"
    again = history.compare(old, new, accepted=history.read_accepted(file))
    assert again.failing() == 0 and again.changes[0].accepted == entry["reason"]
    moved = history.compare(old, rows({}, {**CHANGES["template"], "prompt_text": "<u>hi</u>\n\n"}),
                            accepted=history.read_accepted(file))
    assert moved.failing() == 1


def test_the_stack_differences_name_each_package_fixture_and_isa_that_moved():
    result = history.Comparison(old_run={"versions": {"transformers": "5.9.0", "torch": "2.13"}, "isa": "avx512",
                                         "fixtures": {"tiny-chat": "aa"}},
                                new_run={"versions": {"transformers": "5.19.0", "torch": "2.13"}, "isa": "avx2",
                                         "fixtures": {"tiny-chat": "bb"}})
    assert result.stack_differences() == ["version transformers: 5.9.0 -> 5.19.0", "fixture tiny-chat: aa -> bb",
                                          "isa: avx512 -> avx2"]


def write_record(folder: Path, row_list, **run):
    record = outputs.OutputRecord(rows=list(row_list))
    return record.write(folder / outputs.FILE, {"dtype": "float32", **run})


def test_a_record_reads_back_as_written_with_its_run(tmp_path):
    write_record(tmp_path, rows({}, CHANGES["ids"]), isa="avx512")
    run, back = outputs.read(tmp_path)
    assert run["isa"] == "avx512" and back == rows({}, CHANGES["ids"])


def test_a_file_that_is_not_a_record_or_is_newer_fails_by_name_with_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(outputs.OutputsError, match=r"no outputs record there\. Fix"):
        outputs.read(tmp_path)
    pq.write_table(pa.table({"x": [1]}), tmp_path / outputs.FILE)
    with pytest.raises(outputs.OutputsError, match="not a conformance outputs record"):
        outputs.read(tmp_path)
    table = pa.Table.from_pylist([], schema=outputs.arrow_schema()).replace_schema_metadata(
        {b"xbackend-engine": json.dumps({"schema": outputs.SCHEMA, "schema_version": 99}).encode()})
    pq.write_table(table, tmp_path / outputs.FILE)
    with pytest.raises(outputs.OutputsError, match="newer than this tool's"):
        outputs.read(tmp_path)


def test_the_command_fails_on_an_unaccepted_change_and_passes_once_it_is_accepted(tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    write_record(old, rows({}, {}))
    write_record(new, rows({}, CHANGES["ending"]))
    accepted = tmp_path / "accepted.json"
    args = ["compare", str(old), str(new), "--accepted", str(accepted)]
    assert history.main(args) == 1
    assert "outputs: 1 equal, 1 changed (1 not accepted)" in capsys.readouterr().out
    assert "at **ending**" in (new / "outputs-compared.md").read_text()
    assert "<td>ending</td>" in (new / "outputs-compared.html").read_text()
    assert history.main([*args, "--accept", "--reason", "an extra EOS id"]) == 0
    assert history.main(args) == 0
    assert history.main(["compare", str(old), str(old), "--accepted", str(accepted)]) == 0


def test_the_schema_in_the_docs_is_the_code():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "history.md").read_text()
    table = dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", doc, flags=re.M))
    assert list(table) == list(outputs.FIELDS)


class Engine:
    """What a twin reads of an engine: its backend's name, ``prepare`` (rendered prompts) and ``generate``."""

    backend = SimpleNamespace(name="hf")
    def __init__(self):
        from engine.config import GenerationOptions

        self.config = SimpleNamespace(repeat_terminate=None, generation=GenerationOptions())

    def prepare(self, requests, **_):
        return [SimpleNamespace(text=f"<u>{r[0]['content']}</u>", seed=None) for r in requests], None

    def generate(self, requests, *, options=None, stop=None, plugins=None):
        from engine.errors import RequestError

        if (options or {}).get("max_new_tokens") == 0:
            raise RequestError("generation.max_new_tokens", 0, "must be at least 1", fix="ask for 1 or more")
        return [GenerationResult(text="ok", raw_text="ok</s>", token_ids=(5, 2), prompt_token_ids=(1,),
                                 finish_reason="stop", stop_reason=2, meta={"backend": "hf", "fallback": None})
                for _ in requests]


def test_a_twin_records_each_call_and_each_refusal_under_the_running_check():
    from conformance.subjects.served import Reach, ServedTwin
    from engine.errors import RequestError

    reach = Reach()
    reach.record.enabled, reach.record.check = True, "conformance/test_x.py::test_a[hf]"
    twin = ServedTwin(Engine(), None, reach, subject="hf tiny-chat")
    asked = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    twin.generate(asked, options={"max_new_tokens": 4})
    twin.generate(asked[:1], options={"max_new_tokens": 4, "temperature": 0.7})
    twin.generate(asked[:1], options={"max_new_tokens": 4, "temperature": 0.7, "seed": 3})
    assert [r["sampling"] for r in reach.record.rows] == ["greedy", "greedy", "unseeded", "seeded"]
    del reach.record.rows[2:]
    with pytest.raises(RequestError):
        twin.generate(asked[:1], options={"max_new_tokens": 0})
    got = reach.record.rows
    assert [(r["subject"], r["case"][-4:], r["prompt_text"], r["ids"], r["error"]) for r in got] == [
        ("hf tiny-chat", "-0/0", "<u>hi</u>", [5, 2], ""), ("hf tiny-chat", "-0/1", "<u>yo</u>", [5, 2], ""),
        ("hf tiny-chat", "-0/0", "", [], "RequestError generation.max_new_tokens")]
    assert json.loads(got[0]["meta"]) == {"backend": "hf"}  # volatile meta left out
    twin.generate(asked, options={"max_new_tokens": 4})  # a reference repeats its answer: recorded again, counted
    assert reach.record.rows[-1]["case"][-4:] == "-1/1"


def test_rebase_takes_only_a_quick_float32_record_of_the_fixtures_and_clears_what_it_now_holds(tmp_path):
    good = write_record(tmp_path / "good", rows({}), tier="quick", model=history.FIXTURE_MODEL)
    other = write_record(tmp_path / "other", rows({}), tier="full", model=history.FIXTURE_MODEL)
    baseline, accepted = tmp_path / "base" / "outputs-quick.parquet", tmp_path / "base" / "accepted.json"
    baseline.parent.mkdir()
    accepted.write_text(json.dumps({"accepted": [{"check": "c"}]}))
    with pytest.raises(ValueError, match=r"not a quick-tier float32 record.*'tier': 'full'"):
        history.rebase(other, baseline, accepted)
    assert "1 cases from 1 checks" in history.rebase(good, baseline, accepted)
    assert outputs.read(baseline)[1] == rows({}) and history.read_accepted(accepted) == []


def test_the_options_that_keep_a_run_from_the_baseline_are_the_plugins_own():
    root = Path(__file__).resolve().parents[1]
    noxfile, plugin = (root / "noxfile.py").read_text(), (root / "conformance" / "kit" / "plugin.py").read_text()
    names = re.search(r"OWN_MODELS = \(([^)]*)\)", noxfile).group(1)
    for name in re.findall(r'"(--[\w-]+)"', names):
        assert f'addoption("{name}"' in plugin, name


def test_the_release_page_holds_both_comparisons_and_fails_on_either(tmp_path, capsys):
    from conformance.kit import release
    from engine.report.writer import read as read_benchmarks
    from tests.test_report import make_report

    old, new = tmp_path / "old", tmp_path / "new"
    write_record(old, rows({}, {}))
    write_record(new, rows({}, {}))
    before = make_report(tmp_path / "b1", "r1", engine_over_raw=0.95)
    same, slower = make_report(tmp_path / "b2", "r2"), make_report(tmp_path / "b3", "r3", scale=1.3)
    page = tmp_path / "release.html"
    args = ["--outputs", str(old), str(new), "--accepted", str(tmp_path / "none.json"), "--out", str(page)]
    assert release.main([*args, "--benchmarks", str(before), str(same)]) == 0
    html = page.read_text()
    assert "outputs: 2 equal; speed: 0 benchmark(s) regressed" in html and html.count("data:image/png") == 2
    assert release.main([*args, "--benchmarks", str(before), str(slower), "--history", str(before), str(same),
                         str(slower)]) == 1
    assert "speed: 4 regressed" in capsys.readouterr().out  # both variants of both batches, 30 % slower
    write_record(new, rows({}, CHANGES["tokenizer"]))
    assert release.main([*args, "--benchmarks", str(before), str(same)]) == 1
    frames = [read_benchmarks(p) for p in (before, same, slower, same)]
    assert release.ratio_history(frames)["engine_over_raw"] == [("r1", 0.95), ("r2", 0.97), ("r3", 0.97)]


def test_an_image_is_keyed_by_its_content_not_by_the_run_s_path_or_object(tmp_path):
    from PIL import Image

    one, two = tmp_path / "a.png", tmp_path / "b.png"
    Image.new("RGB", (3, 2), "red").save(one)
    two.write_bytes(one.read_bytes())
    request = [{"role": "user", "content": [{"type": "image", "image": str(one)}]}]
    moved = [{"role": "user", "content": [{"type": "image", "image": str(two)}]}]
    assert outputs.stable(request) == outputs.stable(moved) != request
    assert outputs.stable(Image.open(one)) == outputs.stable(Image.open(two))
    assert outputs.stable(one.read_bytes()) == {"bytes": hashlib.sha256(one.read_bytes()).hexdigest()[:12]}


class _TextOnly:
    def __init__(self, cap: int) -> None:
        self.cap, self._seen = cap, []


def test_a_plugin_instance_in_a_call_keys_the_case_by_its_class_and_settings_not_its_address():
    """A plugin object's repr holds its address, another in every run: two runs of one check must ask one case
    (CI at 735a533 showed test_plugins_on_image_requests as 4 new and 4 gone against the baseline for that)."""
    requests = [[{"role": "user", "content": "hi"}]]
    one, two = ({"plugins": [_TextOnly(3)]} for _ in range(2))
    assert repr(one["plugins"][0]) != repr(two["plugins"][0])
    key = outputs.case_rows("c", "hf", requests, one, 0, error=ValueError("x"))[0]["case"]
    assert key == outputs.case_rows("c", "hf", requests, two, 0, error=ValueError("x"))[0]["case"]
    other = outputs.case_rows("c", "hf", requests, {"plugins": [_TextOnly(4)]}, 0, error=ValueError("x"))[0]["case"]
    assert other != key
    assert outputs.stable(one)["plugins"] == [{"object": "test_history._TextOnly", "cap": 3}]
