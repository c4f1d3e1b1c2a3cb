"""``--engine-shard K/N``: the split covers every check once, is the same on every runner, and keeps what a shard
loads to its own backends."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from conformance.kit.shards import group_of, parse, split

BACKENDS = ("hf", "vllm", "llamacpp")
IDS = st.lists(st.builds(lambda m, f, b, extra: f"conformance/test_{m}.py::test_{f}" + (
    f"[{b}{'-' + extra if extra else ''}]" if b else (f"[{extra}]" if extra else "")),
    st.sampled_from("abcde"), st.sampled_from("xyz"), st.sampled_from(("", *BACKENDS)),
    st.sampled_from(("", "served", "in-process"))), unique=True, max_size=60)


@given(IDS, st.integers(1, 5))
def test_every_check_lands_in_exactly_one_shard_in_its_collected_order(ids, n):
    shards = split(ids, BACKENDS, n)
    assert len(shards) == n
    assert sorted(i for s in shards for i in s) == sorted(ids)
    for shard in shards:
        assert shard == [i for i in ids if i in set(shard)]
    assert split(list(ids), BACKENDS, n) == shards  # every runner computes the same split


@given(IDS)
def test_a_backends_checks_share_one_shard_when_there_are_enough_units(ids):
    shards = split(ids, BACKENDS, 2)
    units = {group_of(i, BACKENDS).split("|")[0] if not group_of(i, BACKENDS).startswith("cross") else
             group_of(i, BACKENDS) for i in ids}
    if len(units) >= 2:
        for backend in BACKENDS:
            holding = [k for k, shard in enumerate(shards) if any(f"[{backend}" in i for i in shard)]
            assert len(holding) <= 1, (backend, shards)


def test_the_option_names_itself_and_the_value():
    assert parse("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "2", "a/b", "1/0"):
        try:
            parse(bad)
        except ValueError as err:
            assert "--engine-shard" in str(err) and repr(bad) in str(err)
        else:
            raise AssertionError(bad)
