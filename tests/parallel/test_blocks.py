"""The default sharding/compile/checkpointing unit: children of the outermost containers."""

from __future__ import annotations

from torch import nn

from dream_trainer.parallel.blocks import find_blocks
from tests.helpers.transformer import TinyTransformer


def test_blocks_of_a_transformer_are_its_layers() -> None:
    model = TinyTransformer()
    blocks = find_blocks(model)
    assert [block for _, _, block in blocks] == list(model.layers)
    container, name, block = blocks[1]
    assert container is model.layers and getattr(container, name) is block


def test_a_container_model_yields_its_children_with_parameters() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert [name for _, name, _ in find_blocks(model)] == ["0", "2"]


def test_containers_inside_blocks_are_not_split() -> None:
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model = nn.Sequential(nn.Sequential(inner, nn.Linear(2, 2)), nn.Linear(2, 2))
    assert [block for _, _, block in find_blocks(model)] == [model[0], model[1]]
    assert find_blocks(nn.Linear(2, 2)) == []


def test_blocks_held_in_a_module_dict_are_found() -> None:
    """torchtitan keeps its layers in a ``ModuleDict`` keyed by index: each is a block, so
    FSDP2, recomputation and compilation wrap them one by one by default."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(3)})

    net = Net()
    assert [(container, name, block) for container, name, block in find_blocks(net)] == [
        (net.layers, str(i), net.layers[str(i)]) for i in range(3)]
