"""A blob's tensor references read under the name ``TensorRef`` is pickled by now and under
the one checkpoints written before it left ``checkpoint.state`` hold."""

from __future__ import annotations

import pytest
import torch

from dream_trainer.checkpoint.state import join_tensors, pack, unpack
from dream_trainer.checkpoint.tensor_ref import TensorRef


@pytest.mark.parametrize("module", ["dream_trainer.checkpoint.tensor_ref",
                                    "dream_trainer.checkpoint.state"])
def test_a_tensor_ref_reads_under_its_name_and_its_earlier_one(
        module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The earlier name pickles as it did: checkpoint.state still holds the class by that name.
    monkeypatch.setattr(TensorRef, "__module__", module)
    blob = pack({"w": [TensorRef("w")]})
    assert f"{module}\nTensorRef".encode() in blob  # the global the reader is given
    value = unpack(blob, torch.device("cpu"), "blob")
    assert value == {"w": [TensorRef("w")]}
    assert type(value["w"][0]) is TensorRef
    joined = join_tensors(value, {"w": torch.arange(3.0)})
    assert torch.equal(joined["w"][0], torch.arange(3.0))
