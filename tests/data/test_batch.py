"""Batches of any nesting reach the device with their container types intact."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import torch

from dream_trainer.data.batch import batch_size_of, move_to_device

Pair = namedtuple("Pair", ["x", "y"])


def test_nested_containers_keep_their_types_and_values() -> None:
    counts: defaultdict[str, list[torch.Tensor]] = defaultdict(list)
    counts["a"].append(torch.ones(2))
    batch = {"pair": Pair(torch.zeros(1), [torch.ones(1), (torch.full((1,), 2.0), "id")]),
             "ordered": OrderedDict(z=torch.ones(3)), "counts": counts, "n": 3, "none": None}
    moved = move_to_device(batch, torch.device("meta"))
    assert isinstance(moved["pair"], Pair) and moved["pair"].x.is_meta
    assert moved["pair"].y[1][1] == "id" and moved["pair"].y[1][0].is_meta
    assert isinstance(moved["ordered"], OrderedDict) and moved["ordered"]["z"].is_meta
    assert isinstance(moved["counts"], defaultdict) and moved["counts"].default_factory is list
    assert moved["counts"]["a"][0].is_meta
    assert moved["n"] == 3 and moved["none"] is None
    # The input is not modified.
    assert not batch["pair"].x.is_meta and not counts["a"][0].is_meta


def test_tensors_already_on_the_device_are_not_copied() -> None:
    tensor = torch.ones(4)
    assert move_to_device((tensor,), torch.device("cpu"))[0] is tensor


def test_batch_size_is_the_first_tensors_length_or_a_list_of_plain_values() -> None:
    x = torch.zeros(5, 2)
    assert batch_size_of((x, torch.zeros(7))) == 5
    assert batch_size_of(["id", ("a", "b", "c"), {"x": x}]) == 3  # depth first, in order
    assert batch_size_of({"meta": {"ids": ["a", "b"]}, "x": x}) == 2
    assert batch_size_of(["a", "b", "c", "d"]) == 4  # what default_collate makes of strings
    assert batch_size_of(["a", [], x]) == 5 and batch_size_of(("a", [])) is None
    assert batch_size_of({"n": 3, "name": "x"}) is None  # plain values in a mapping: unknown
    assert batch_size_of([]) is None and batch_size_of(object()) is None
    assert batch_size_of(torch.tensor(1.0)) == 1
