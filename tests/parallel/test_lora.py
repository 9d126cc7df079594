"""LoRA adapters (peft) on a base built on the meta device: peft's initialization, only the
adapters trained, peft's own numbers; DDP, FSDP2 (float32, and a bfloat16 base with float32
adapters), HSDP, TP, cp and pp (also with the head tied to the embedding across the stages)
equal to one process with the base unchanged bit for bit; the peft export loads with
PeftModel.from_pretrained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import REPO, check, torchrun

SCRIPT = REPO / "tests/scripts/lora_run.py"
# SGD steps of one computation with the batch mean taken in another order (the data-parallel
# average): adapters of scale ~0.1 agree to float32 rounding.
TOLERANCE = 1e-6
TIED = ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_exports")


@pytest.fixture(scope="module")
def single(exports: Path) -> dict[str, Any]:
    from tests.scripts.lora_run import run

    return run("single", str(exports))


def adapters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in weights.items() if ".lora_" in name}


def test_only_the_adapters_train_and_start_as_peft_starts_them(single: dict[str, Any]) -> None:
    # r=4 on 7 projections of 2 layers: an A and a B each.
    assert len(single["trainable"]) == 2 * 7 * 2
    assert all(".lora_A." in name or ".lora_B." in name for name in single["trainable"])
    initial = adapters(single["initial"])
    assert all(not bool(value.any()) for name, value in initial.items() if ".lora_B." in name)
    assert all(bool(value.any()) for name, value in initial.items() if ".lora_A." in name)
    for name, value in single["initial"].items():
        if name not in single["trainable"]:
            assert torch.equal(single["final"][name], value), name  # the base is frozen
    moved = max(float((single["final"][name] - value).abs().max())
                for name, value in initial.items())
    assert moved > 1e-3


def test_the_fine_tune_is_peft_s_own_trained_by_hand(single: dict[str, Any]) -> None:
    from peft import get_peft_model

    from tests.helpers.hf import SEQ, VOCAB, build
    from tests.scripts.lora_run import GLOBAL_BATCH, STEPS, lora_config

    model = get_peft_model(build("llama"), lora_config())
    model.load_state_dict(single["initial"])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                lr=single["lr"])
    tokens = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(2))
    model.train()
    for step in range(STEPS):
        batch = tokens[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    hand = dict(model.named_parameters())
    for name, value in adapters(single["final"]).items():
        assert (hand[name].detach() - value).abs().max() <= TOLERANCE, name


def test_a_peft_model_splits_into_stages_of_itself() -> None:
    import copy

    from peft import PromptTuningConfig, get_peft_model

    from dream_trainer.parallel.hf_pipeline import is_hf_decoder, split_pipeline
    from tests.helpers.hf import build, fixed_batch
    from tests.scripts.lora_run import lora_config

    torch.manual_seed(0)
    model = get_peft_model(build("llama", layers=4), lora_config()).eval()
    with torch.no_grad():  # B away from zero, so that the adapters change the logits
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_()
    assert is_hf_decoder(model)
    stages = split_pipeline(copy.deepcopy(model), [0, 1], 2)
    with torch.no_grad():
        expected = model(input_ids=fixed_batch()).logits
        carried = stages[1](stages[0](fixed_batch()))
    # The same kernels on the same values, layer after layer: bit-identical.
    assert torch.equal(carried, expected)
    # Every parameter on one stage under peft's name, each layer's adapters with it.
    held = [{name for name, _ in stage.named_parameters()} for stage in stages]
    assert sorted(held[0] | held[1]) == sorted(name for name, _ in model.named_parameters())
    assert not held[0] & held[1]
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight" in held[0]
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.default.weight" in held[1]
    # Prompt tuning adds its tokens in PeftModel.forward, which no stage runs.
    prompted = get_peft_model(build("llama"), PromptTuningConfig(task_type="CAUSAL_LM",
                                                                 num_virtual_tokens=2))
    with pytest.raises(ValueError, match=r"^the peft adapters \['default'\] of "
                       "PeftModelForCausalLM learn prompt tokens"):
        split_pipeline(prompted, [0, 1], 2)


def assert_equal_runs(run: dict[str, Any], single: dict[str, Any], layout: str) -> None:
    """The same initial weights, the base unchanged, the adapters within the tolerance."""
    assert run["steps"] == single["steps"] == 3, layout
    assert run["trainable"] == single["trainable"], layout
    assert run["frozen_with_gradients"] == [], layout  # the frozen base gets no gradient
    for name, value in single["initial"].items():
        assert torch.equal(run["initial"][name], value), (layout, name)
        if name not in single["trainable"]:
            assert torch.equal(run["final"][name], value), (layout, name)
    for name, value in adapters(single["final"]).items():
        assert (run["final"][name] - value).abs().max() <= TOLERANCE, (layout, name)


def test_every_layout_trains_what_one_process_trains(tmp_path: Path, exports: Path,
                                                     single: dict[str, Any]) -> None:
    from tests.scripts.lora_run import run

    two, four = tmp_path / "two.pt", tmp_path / "four.pt"
    check(torchrun(SCRIPT, [str(two), str(exports), "ddp", "fsdp", "fsdp_bf16", "tp", "cp",
                            "pp", "pp_tied"], nproc=2, timeout=400))
    check(torchrun(SCRIPT, [str(four), str(exports), "hsdp"], nproc=4, timeout=400))
    runs = {**torch.load(two, weights_only=False), **torch.load(four, weights_only=False)}
    for layout in ("ddp", "fsdp", "hsdp", "tp", "cp", "pp"):
        assert_equal_runs(runs[layout], single, layout)
    # The head tied to the embedding, adapters on the attention only, under pp=2: the first
    # stage holds the embedding, the last the head, each a copy of the one frozen weight.
    single_tied = run("single_tied")
    assert len(single_tied["trainable"]) == 2 * 4 * 2
    assert TIED[1] not in single_tied["final"]  # one process: one parameter, one name
    assert_equal_runs(runs["pp_tied"], single_tied, "pp_tied")
    final = runs["pp_tied"]["final"]
    assert torch.equal(final[TIED[1]], final[TIED[0]])
    assert torch.equal(final[TIED[0]], single_tied["initial"][TIED[0]])
    # A bfloat16 base with float32 adapters (param_dtype left at float32, so FSDP2 casts
    # nothing): each block's unit holds both dtypes (all-gathered as bytes; only the float32
    # adapters have gradients to reduce) and trains what one process trains.
    single_bf16 = run("single_bf16")
    assert {value.dtype for name, value in single_bf16["final"].items()
            if ".lora_" in name} == {torch.float32}
    assert {value.dtype for name, value in single_bf16["final"].items()
            if ".lora_" not in name} == {torch.bfloat16}
    assert_equal_runs(runs["fsdp_bf16"], single_bf16, "fsdp_bf16")


@pytest.mark.parametrize("layout", ["single", "fsdp", "pp"])
def test_the_peft_export_loads_with_peft_from_pretrained(layout: str, exports: Path,
                                                         single: dict[str, Any]) -> None:
    # The fsdp and pp exports are written by the launch of the test above (module order);
    # the pp one gathers each stage's adapters.
    from peft import PeftModel, get_peft_model

    from tests.helpers.hf import build, fixed_batch
    from tests.scripts.lora_run import lora_config

    directory = exports / layout
    assert sorted(path.name for path in directory.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    base_weights = {name.removeprefix("base_model.model.").replace(".base_layer.", "."): value
                    for name, value in single["initial"].items() if ".lora_" not in name}
    base = build("llama")
    base.load_state_dict(base_weights)
    loaded = PeftModel.from_pretrained(base, str(directory)).eval()
    trained = get_peft_model(build("llama"), lora_config()).eval()
    trained.load_state_dict(single["final"])
    for name, value in dict(loaded.named_parameters()).items():
        if ".lora_" in name:  # every adapter came back, as the run trained it
            assert (value - single["final"][name]).abs().max() <= TOLERANCE, name
    with torch.no_grad():
        tokens = fixed_batch()
        difference = (loaded(input_ids=tokens).logits - trained(input_ids=tokens).logits)
    assert difference.abs().max() <= 1e-5


def test_bad_lora_inputs_are_refused_by_name(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from dream_trainer.parallel.lora import init_peft_adapters
    from tests.helpers.hf import build
    from tests.helpers.toy import ToyTrainer, toy_config

    # Target modules that match nothing: peft refuses while configure_models runs.
    with torch.device("meta"), pytest.raises(ValueError, match="not found in the base model"):
        get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["query"]))
    # An initialization computed from the base's weights cannot run on the meta device.
    with torch.device("meta"):
        model = get_peft_model(build("llama"), LoraConfig(
            r=4, target_modules=["q_proj"], init_lora_weights="olora"))
    model.to_empty(device="cpu")
    with pytest.raises(ValueError) as error:
        init_peft_adapters(model)
    assert str(error.value).startswith(
        "the LoRA adapter 'default' of base_model.model.model.layers.0.self_attn.q_proj is "
        "initialized with init_lora_weights='olora', which computes it from the base's "
        "weights: a model built on the meta device has none then.")
    # A model that is not a peft model has no adapter to export.
    trainer = ToyTrainer(toy_config(n_samples=16))
    trainer.fit()
    with pytest.raises(ValueError) as error:
        trainer.export_weights(tmp_path / "adapter", format="peft")
    assert str(error.value) == (
        "format='peft' writes the LoRA adapters of a peft model, but the model 'model' is a "
        "Sequential: wrap it with peft.get_peft_model in configure_models, or export "
        "format='hf'")
    assert not (tmp_path / "adapter").exists()
