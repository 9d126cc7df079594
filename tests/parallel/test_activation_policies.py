"""Activation checkpointing policies (``DeviceParameters.activation_checkpointing``): each
trains the weights of no checkpointing, on one process and on FSDP2, TP and cp layouts; each
keeps for backward what it says; bad values are refused naming the field.

Equality: every comparison of weights is bitwise. Recomputing a block on the CPU replays the
same kernels on the same inputs in the same order (torch restores the RNG state, and these
blocks have no dropout), so its activations, and so the gradients, are the same bits as
those kept from forward; each layout is compared with its own run without checkpointing,
whose reductions run in the same order.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.configs.activation_policy import ACCEPTED
from dream_trainer.configs.cli import apply_cli_overrides
from dream_trainer.parallel.checkpointing import (SELECTIVE_SAVE_OPS, checkpoint_blocks,
                                                  keep_products_and_attention)
from dream_trainer.parallel.parts import CheckpointingPart
from dream_trainer.world import ParallelDims
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.rotary_gpt import GPTConfig, RotaryGPT, sequences, summed_loss, targets_of
from tests.scripts.activation_policies_run import (BLOCKS, POLICIES, STEPS, PolicyTrainer,
                                                   keep_attention, run)

SCRIPT = REPO / "tests/scripts/activation_policies_run.py"
PERFORMANCE = REPO / "docs/performance.md"
CHECKPOINTED = {"none": [False] * 4, "full": [True] * 4, "every_2nd": [True, False, True, False],
                "selective": [True] * 4, "user": [True] * 4}


@pytest.fixture(scope="module")
def one() -> dict[str, dict[str, Any]]:
    return {policy: run("one", policy) for policy in POLICIES}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("policies") / "two.pt"
    check(torchrun(SCRIPT, [str(out), "fsdp2", "tp2", "cp2"], nproc=2, timeout=400))
    return torch.load(out)


def gpt_config(device_parameters: DeviceParameters, steps: int) -> GPTConfig:
    return GPTConfig(project="policies", group="tests", experiment="config", n_layers=2,
                     device_parameters=device_parameters,
                     training_parameters=TrainingParameters(n_epochs=1, train_batch_size=4,
                                                            max_steps=steps))


def assert_trains_as_without_checkpointing(runs: dict[str, dict[str, Any]], prefix: str) -> None:
    plain = runs["none"]["weights"]
    # Not vacuous: the steps moved the weights.
    assert (plain["head.weight"] - runs["none"]["initial"]["head.weight"]).abs().max() > 1e-3
    for policy, result in runs.items():
        assert result["steps"] == STEPS
        assert result["blocks"] == [prefix + ("CheckpointWrapper" if wrapped else "Block")
                                    for wrapped in CHECKPOINTED[policy]], policy
        assert result["weights"].keys() == plain.keys()
        for name, tensor in plain.items():
            assert torch.equal(result["weights"][name], tensor), (policy, name)
    # The user's policy chose for every operation of every block, the same ones each step.
    calls = runs["user"]["user_policy_calls"][False]
    assert calls > 0 and calls % (STEPS * BLOCKS) == 0


def test_every_policy_trains_the_weights_of_no_checkpointing(
        one: dict[str, dict[str, Any]]) -> None:
    assert_trains_as_without_checkpointing(one, prefix="")


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "prefix"), [("fsdp2", "FSDP"), ("tp2", ""), ("cp2", "FSDP")])
def test_every_policy_trains_the_weights_of_no_checkpointing_on_two_ranks(
        two: dict[tuple[str, str], dict[str, Any]], layout: str, prefix: str) -> None:
    # cp=2 shards the weights with FSDP2 over the context-parallel ranks.
    assert_trains_as_without_checkpointing(
        {policy: two[(layout, policy)] for policy in POLICIES}, prefix=prefix)


def documented_saved_bytes() -> dict[str, tuple[int, int]]:
    """docs/performance.md's table of saved bytes: policy -> (kept, seen by the hooks)."""
    section = PERFORMANCE.read_text().split("### Activation checkpointing policies", 1)[1]
    section = section.split("\n### ", 1)[0]  # this subsection's table only
    rows = re.findall(r"^\| (\w+) \| [^|]+ \| ([\d,]+) \| ([\d,]+) \|", section, re.MULTILINE)
    return {policy: (int(held.replace(",", "")), int(hooks.replace(",", "")))
            for policy, held, hooks in rows}


def test_each_policy_keeps_less_for_backward_and_the_docs_state_the_bytes(
        one: dict[str, dict[str, Any]]) -> None:
    held = {policy: result["saved"].held for policy, result in one.items()}
    assert held["none"] > held["selective"] > held["every_2nd"] > held["full"] > 0
    # The attention outputs alone are more than full recomputation keeps, less than the
    # products and attention.
    assert held["full"] < held["user"] < held["selective"]
    # Unchecked, everything kept goes through the saved-tensor hooks; checkpointed regions
    # keep theirs past them, which is why the hooks alone cannot tell selective from full.
    assert one["none"]["saved"].hooks == held["none"]
    assert one["selective"]["saved"].hooks == one["full"]["saved"].hooks
    assert documented_saved_bytes() == {policy: (result["saved"].held, result["saved"].hooks)
                                        for policy, result in one.items()}


class CountOps(TorchDispatchMode):
    """Counts the operations that run, by overload."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(policy: Any) -> Counter[Any]:
    """The operations one backward of the rotary GPT runs, its blocks checkpointed."""
    torch.manual_seed(0)
    model = RotaryGPT(BLOCKS)
    checkpoint_blocks(model, policy)
    tokens = sequences(2, 16, 0)
    loss = summed_loss(model(tokens[:, :-1]), targets_of(tokens))
    with CountOps() as counter:
        loss.backward()
    return counter.counts


def test_selective_recomputes_everything_but_products_and_attention() -> None:
    aten = torch.ops.aten
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    recomputed = (attention, aten.addmm.default, aten.native_layer_norm.default,
                  aten.gelu.default)
    plain, full, every_2nd, selective = (
        [counts[op] for op in recomputed]
        for counts in map(backward_ops, (None, "full", 2, "selective")))
    # Without checkpointing backward runs no forward operation (its products are aten.mm).
    assert plain == [0, 0, 0, 0]
    # Per block: attention, 5 of the 6 linear layers (torch stops recomputing a block once
    # it has what backward needs, before the last projection), 2 norms, 1 gelu.
    assert full == [BLOCKS, 5 * BLOCKS, 2 * BLOCKS, BLOCKS]
    assert every_2nd == [count // 2 for count in full]
    assert selective == [0, 0, 2 * BLOCKS, BLOCKS]
    assert {attention, aten.addmm.default} <= SELECTIVE_SAVE_OPS
    assert aten.gelu.default not in SELECTIVE_SAVE_OPS
    assert keep_products_and_attention(None, aten.addmm.default).name == "MUST_SAVE"
    assert keep_products_and_attention(None, aten.gelu.default).name == "PREFER_RECOMPUTE"


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_policy_is_torch_s_own_checkpoint_with_that_policy(policy: str) -> None:
    # The same blocks run through torch.utils.checkpoint by hand (no wrapper, no trainer),
    # with torch's create_selective_checkpoint_contexts for "selective": the same gradients,
    # bit for bit, and the same operations recomputed in backward.
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    ours = backward_ops(policy)
    torch.manual_seed(0)
    model = RotaryGPT(BLOCKS)
    context = {} if policy == "full" else {"context_fn": functools.partial(
        create_selective_checkpoint_contexts, keep_products_and_attention)}
    for index, block in enumerate(model.layers):
        model.layers[index] = _ByHand(block, lambda module, *args, **kwargs: checkpoint(
            module, *args, use_reentrant=False, **context, **kwargs))
    tokens = sequences(2, 16, 0)
    loss = summed_loss(model(tokens[:, :-1]), targets_of(tokens))
    with CountOps() as counter:
        loss.backward()
    assert counter.counts == ours
    torch.manual_seed(0)
    wrapped = RotaryGPT(BLOCKS)
    checkpoint_blocks(wrapped, policy)
    summed_loss(wrapped(tokens[:, :-1]), targets_of(tokens)).backward()
    by_name = dict(model.named_parameters())
    for name, param in wrapped.named_parameters():
        hand = by_name[name.replace("._checkpoint_wrapped_module", ".block")]
        assert torch.equal(param.grad, hand.grad), name


class _ByHand(nn.Module):
    """A block whose forward goes through ``run(block, *args)``."""

    def __init__(self, block: nn.Module, run: Any) -> None:
        super().__init__()
        self.block, self.run = block, run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.block, *args, **kwargs)


@pytest.mark.parametrize(("policy", "wrapped"), [
    (None, []), ("full", [0, 1, 2, 3, 4]), (1, [0, 1, 2, 3, 4]), (2, [0, 2, 4]), (3, [0, 3]),
    (7, [0]), ("selective", [0, 1, 2, 3, 4]), (keep_attention, [0, 1, 2, 3, 4])])
def test_an_int_policy_checkpoints_blocks_0_n_2n(policy: Any, wrapped: list[int]) -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))
    assert checkpoint_blocks(model, policy) == len(wrapped)
    assert [index for index, block in enumerate(model)
            if isinstance(block, CheckpointWrapper)] == wrapped
    if wrapped:
        model(torch.ones(1, 2)).sum().backward()  # the wrapped blocks run


@pytest.mark.parametrize(("value", "message"), [
    ("fulll", "activation_checkpointing='fulll' is not a policy name: use " + ACCEPTED),
    ("Full", "activation_checkpointing='Full' is not a policy name: use " + ACCEPTED),
    (0, "activation_checkpointing=0 recomputes every N-th block, which needs N >= 1: use "
        + ACCEPTED),
    (-2, "activation_checkpointing=-2 recomputes every N-th block, which needs N >= 1: use "
         + ACCEPTED),
    ([torch.ops.aten.mm.default], "activation_checkpointing is a list, which is not callable: "
                                  "use " + ACCEPTED),
    (1.5, "activation_checkpointing is a float, which is not callable: use " + ACCEPTED),
    (True, "activation_checkpointing=True is not a policy (for the boolean, set "
           "checkpoint_activations): use " + ACCEPTED),
])
def test_a_bad_policy_is_refused_naming_the_field(value: Any, message: str) -> None:
    with pytest.raises(ValidationError) as error:
        DeviceParameters(activation_checkpointing=value)
    (problem,) = error.value.errors()
    assert problem["loc"] == ("activation_checkpointing",)
    assert problem["msg"] == f"Value error, {message}"


def test_the_accepted_values_are_stated() -> None:
    assert ACCEPTED == (
        "None (keep every activation), 'full' (recompute every block), 'selective' (recompute "
        "every block but the outputs of its matrix products, attention and collectives), an "
        "int N >= 1 (recompute blocks 0, N, 2N, ...) or a policy function policy(ctx, op, "
        "*args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy")


def test_checkpoint_activations_is_a_synonym_for_full() -> None:
    synonym = DeviceParameters(checkpoint_activations=True)
    assert synonym.activation_checkpointing == "full"
    assert "activation_checkpointing" not in synonym.model_fields_set  # derived
    assert DeviceParameters(checkpoint_activations=True,
                            activation_checkpointing="full").activation_checkpointing == "full"
    again = DeviceParameters.model_validate_json(synonym.model_dump_json())
    assert (again.checkpoint_activations, again.activation_checkpointing) == (True, "full")
    assert DeviceParameters().activation_checkpointing is None
    for policy, shown in (("selective", "'selective'"), (2, "2"),
                          (keep_attention, "'tests.scripts.activation_policies_run."
                                           "keep_attention'")):
        with pytest.raises(ValidationError) as error:
            DeviceParameters(checkpoint_activations=True, activation_checkpointing=policy)
        assert error.value.errors()[0]["msg"] == (
            "Value error, checkpoint_activations=True means activation_checkpointing='full', "
            f"but activation_checkpointing={shown} was given too: drop checkpoint_activations "
            "or set it False (activation_checkpointing alone chooses the policy)")


def test_policies_dump_to_json_and_come_from_the_command_line() -> None:
    for policy in (None, "full", "selective", 3):
        params = DeviceParameters(activation_checkpointing=policy)
        assert json.loads(params.model_dump_json())["activation_checkpointing"] == policy
        assert DeviceParameters.model_validate_json(
            params.model_dump_json()).activation_checkpointing == policy
    # A function is given in code; JSON records its name.
    dumped = DeviceParameters(activation_checkpointing=keep_attention).model_dump_json()
    assert json.loads(dumped)["activation_checkpointing"] == \
        "tests.scripts.activation_policies_run.keep_attention"
    base = gpt_config(DeviceParameters(), steps=1)
    for argument, policy in (("selective", "selective"), ("2", 2), ("null", None)):
        overridden = apply_cli_overrides(
            base, ["--device_parameters.activation_checkpointing", argument], prog="train")
        assert overridden.device_parameters.activation_checkpointing == policy


@pytest.mark.parametrize(("policy", "described", "setting"), [
    ("full", "every block recomputed", "full"),
    (2, "every 2nd block recomputed (blocks 0, 2, 4, ...)", 2),
    (3, "every 3rd block recomputed (blocks 0, 3, 6, ...)", 3),
    (11, "every 11th block recomputed (blocks 0, 11, 22, ...)", 11),
    ("selective", "every block recomputed but the outputs of its matrix products, attention "
                  "and collectives", "selective"),
    (keep_attention, "every block recomputed op by op as "
                     "tests.scripts.activation_policies_run.keep_attention chooses",
     "tests.scripts.activation_policies_run.keep_attention"),
])
def test_the_part_describes_its_policy(policy: Any, described: str, setting: Any) -> None:
    params = DeviceParameters(activation_checkpointing=policy)
    dims = ParallelDims.resolve(params, 1)
    part = CheckpointingPart()
    assert part.active(params, dims)
    assert part.describe(params, dims) == f"activation checkpointing: {described}"
    assert part.settings(params, dims) == {"activation_checkpointing": setting}
    assert not part.active(DeviceParameters(), dims)


def test_the_hook_can_be_overridden_and_reads_the_policy() -> None:
    class Trainer(PolicyTrainer):
        def apply_activation_checkpointing(self) -> None:
            self.policy_seen = self.config.device_parameters.activation_checkpointing

    trainer = Trainer(gpt_config(DeviceParameters(activation_checkpointing="selective"),
                                 steps=1))
    trainer.fit()
    assert trainer.policy_seen == "selective"
    assert not any(isinstance(block, CheckpointWrapper) for block in trainer.model.layers)
    layout = trainer.layout.describe(trainer.config.device_parameters)
    assert layout.parts["activation checkpointing"] == (
        "activation checkpointing: every block recomputed but the outputs of its matrix "
        "products, attention and collectives")
    assert layout.settings["activation_checkpointing"] == "selective"
