"""Batches of any nesting reach the device with their container types intact."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import torch

from dream_trainer.data.batch import move_to_device

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
