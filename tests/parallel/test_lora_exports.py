"""LoRA beyond test_lora.py: the merged export (``export_weights(format="hf",
merge_adapters=True)``) from one process, DDP, FSDP2, TP, a pipeline and expert parallelism
loads with ``from_pretrained`` as the trained model; a Qwen3-MoE whose blocks are ``MoE``
layers trains adapters on its attention under FSDP2 and expert_parallel=2 as one process
does, its experts left alone; what the merge cannot write, and LoRA on experts under expert
parallelism, are refused by name."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale

SCRIPT = REPO / "tests/scripts/lora_extra_run.py"
LAUNCHED = ["llama_ddp", "llama_fsdp", "llama_tp", "llama_pp", "moe_fsdp", "moe_ep2",
            "experts_ep2"]
# SGD steps of one computation with the batch mean (and, under expert parallelism, the
# experts' outputs) summed in another order: adapters of scale ~0.1 agree to float32
# rounding, the bound.
TOLERANCE = 1e-6
# The merged model computes x @ (W + s * B @ A).T, rounding the sum once into the weight;
# the peft model computes x @ W.T + s * (x @ A.T) @ B.T, rounding each product on its own.
# Through 2 layers that differs by ~1e-7 at logits of scale ~0.4: the 1e-5 is ~200
# float32 ulps there, far above any CPU's reordering and far below what the adapters change
# (1.5e-2 in the Llama's logits, 0.24 in the MoE's).
LOGITS = 1e-5


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_merged")


@pytest.fixture(scope="module")
def runs(exports: Path) -> dict[str, dict[str, Any]]:
    """Every run: the one-process ones here, the others in one 2-rank launch."""
    from tests.scripts.lora_extra_run import run

    out = exports / "runs.pt"
    check(torchrun(SCRIPT, [str(out), str(exports), *LAUNCHED], nproc=2, timeout=400))
    launched = torch.load(out, weights_only=False)
    return {**launched, **{name: run(name, str(exports)) for name in ("llama_single",
                                                                       "moe_single")}}


def peft_model(family: str) -> Any:
    """The run's model, eager: a peft Llama (attention and MLP) or Qwen3-MoE (attention)."""
    from peft import get_peft_model

    from dream_trainer.nn import replace_hf_moe_blocks
    from tests.helpers.hf import build
    from tests.scripts.lora_extra_run import attention_lora_config
    from tests.scripts.lora_run import lora_config

    if family == "llama":
        return get_peft_model(build("llama"), lora_config())
    model = build("qwen3_moe")
    replace_hf_moe_blocks(model)
    return get_peft_model(model, attention_lora_config())


def file_keys(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        return set(file.keys())


@pytest.mark.parametrize("name", ["llama_single", "llama_ddp", "llama_fsdp", "llama_tp",
                                  "llama_pp", "moe_single", "moe_fsdp", "moe_ep2"])
def test_the_merged_export_loads_with_from_pretrained_as_the_trained_model(
        name: str, runs: dict[str, dict[str, Any]], exports: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf import build, fixed_batch, logits

    family = name.partition("_")[0]
    directory = exports / name
    assert sorted(path.name for path in directory.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    # The keys save_pretrained writes for the base model (the MoE's experts one tensor
    # each): no adapter, no base_layer.
    build("llama" if family == "llama" else "qwen3_moe").save_pretrained(tmp_path)
    assert file_keys(directory) == file_keys(tmp_path)
    final = runs[name]["final"]
    # Each adapted weight is W + scaling * B @ A of the trained tensors (lora_alpha / r = 2),
    # products of 4 terms and a sum, rounded in another process: a few ulps of the scale.
    prefix = "base_model.model.model.layers.1.self_attn.o_proj"
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        written = file.get_tensor("model.layers.1.self_attn.o_proj.weight")
    expected = final[f"{prefix}.base_layer.weight"] + (
        final[f"{prefix}.lora_B.default.weight"] @ final[f"{prefix}.lora_A.default.weight"]) * 2
    assert_close_to_scale(written, expected, ulps=4)
    assert not torch.equal(written, final[f"{prefix}.base_layer.weight"])
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    assert type(loaded).__name__ == ("LlamaForCausalLM" if family == "llama"
                                     else "Qwen3MoeForCausalLM")
    trained = peft_model(family)
    trained.load_state_dict(final)
    tokens = fixed_batch()
    assert (logits(loaded, tokens) - logits(trained, tokens)).abs().max() <= LOGITS


def test_the_merged_export_to_an_object_store_in_bfloat16_is_the_local_one_rounded(
        runs: dict[str, dict[str, Any]], exports: Path, tmp_path: Path) -> None:
    # The same run again, exported to s3:// (rank 0 joins the slices there) with
    # dtype=bfloat16: the same computation, each float32 sum rounded once to bfloat16, so
    # the local float32 files cast, bit for bit.
    from safetensors.torch import load_file

    from dream_trainer.configs import TrainingParameters
    from tests.helpers.hf import hf_config
    from tests.helpers.s3 import s3_server
    from tests.scripts.lora_extra_run import MergingLoraTrainer
    from tests.scripts.lora_run import GLOBAL_BATCH, STEPS

    with s3_server() as s3:
        trainer = MergingLoraTrainer(hf_config(training_parameters=TrainingParameters(
            n_epochs=1, max_steps=STEPS, train_batch_size=GLOBAL_BATCH)))
        trainer.merged_dir, trainer.merged_dtype = s3.url("merged"), torch.bfloat16
        trainer.fit()
        for name in ("model.safetensors", "config.json"):
            s3.client().download_file(s3.bucket, f"merged/{name}", str(tmp_path / name))
    for key, value in runs["llama_single"]["final"].items():
        assert torch.equal(trainer.final[key], value), key
    local = load_file(exports / "llama_single" / "model.safetensors")
    remote = load_file(tmp_path / "model.safetensors")
    assert remote.keys() == local.keys()
    for key, value in local.items():
        assert torch.equal(remote[key], value.to(torch.bfloat16)), key
    assert (tmp_path / "config.json").read_text() == \
        (exports / "llama_single" / "config.json").read_text()


def adapters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in weights.items() if ".lora_" in name}


@pytest.mark.parametrize("name", ["moe_fsdp", "moe_ep2", "llama_ddp", "llama_fsdp",
                                  "llama_tp", "llama_pp"])
def test_every_layout_trains_the_adapters_one_process_trains(
        name: str, runs: dict[str, dict[str, Any]]) -> None:
    run, single = runs[name], runs[name.partition("_")[0] + "_single"]
    assert run["steps"] == single["steps"] == 3
    assert run["trainable"] == single["trainable"]
    if name.startswith("moe"):
        # r=4 on q/k/v/o of 2 layers, an A and a B each: the experts and router are left alone.
        assert len(single["trainable"]) == 2 * 4 * 2
        assert all(".self_attn." in key and ".lora_" in key for key in single["trainable"])
    for key, value in single["initial"].items():
        assert torch.equal(run["initial"][key], value), key
        if key not in single["trainable"]:  # the base, experts included, bit for bit
            assert torch.equal(run["final"][key], value), key
            assert torch.equal(single["final"][key], value), key
    moved = max(float((single["final"][key] - value).abs().max())
                for key, value in adapters(single["initial"]).items())
    assert moved > 1e-3
    for key, value in adapters(single["final"]).items():
        assert (run["final"][key] - value).abs().max() <= TOLERANCE, key


def test_the_merge_is_peft_s_merge_and_unload() -> None:
    # The same products and sums as peft's merge (transposed for GPT-2's Conv1D layers,
    # rank-stabilized scaling for the Llama): bit for bit.
    from peft import LoraConfig, get_peft_model

    from dream_trainer.weights.peft_merge import merged_models, merged_state
    from tests.helpers.hf import build

    torch.manual_seed(0)
    for architecture, config in (
            ("gpt2", LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                fan_in_fan_out=True)),
            ("llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                 use_rslora=True))):
        model = get_peft_model(build(architecture), config)  # type: ignore[arg-type]
        with torch.no_grad():
            for key, param in model.named_parameters():
                if ".lora_B." in key:
                    param.normal_()  # B starts at zero: nothing would be merged
        mine = merged_state(merged_models({"model": model}, "hf")["model"])
        theirs = copy.deepcopy(model).merge_and_unload().state_dict()
        assert mine.keys() == theirs.keys(), architecture
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), (architecture, key)


def test_lora_on_the_experts_is_refused_by_name(runs: dict[str, dict[str, Any]]) -> None:
    from peft import LoraConfig, get_peft_model

    from dream_trainer.nn import replace_hf_moe_blocks
    from tests.helpers.hf import build

    # Expert parallelism splits GroupedExperts' weights; peft's target_parameters wraps them.
    assert runs["experts_ep2"]["error"] == (
        "MoE layer 'base_model.model.model.layers.0.mlp' holds its experts in a ParamWrapper "
        "(peft's target_parameters puts LoRA on them so): expert parallelism splits "
        "GroupedExperts' stacked weights only; leave the experts out of the LoRA config "
        "(adapt the attention projections), or set expert_parallel=1")
    # As a module, peft itself refuses them in configure_models.
    with torch.device("meta"):
        model = build("qwen3_moe")
        replace_hf_moe_blocks(model)
        with pytest.raises(ValueError, match=r"^Target module GroupedExperts\(\) is not "
                                             r"supported\. Currently, only the following"):
            get_peft_model(model, LoraConfig(r=4, target_modules=["experts"]))


def refusal(architecture: str, config: Any, second: Any = None) -> str:
    """The message with which the merge refuses a peft model built on the meta device."""
    from peft import get_peft_model

    from dream_trainer.nn import replace_hf_moe_blocks
    from dream_trainer.weights.peft_merge import merged_models
    from tests.helpers.hf import build

    with torch.device("meta"):
        model = build(architecture)  # type: ignore[arg-type]
        replace_hf_moe_blocks(model)
        model = get_peft_model(model, config)
        if second is not None:
            model.add_adapter("other", second)
    with pytest.raises(ValueError) as error:
        merged_models({"model": model}, "hf")
    return str(error.value)


@pytest.mark.filterwarnings("ignore::UserWarning")  # peft's own warnings on these configs
def test_what_the_merge_cannot_write_is_refused_by_name(tmp_path: Path) -> None:
    from peft import IA3Config, LoraConfig

    from tests.helpers.toy import ToyTrainer, toy_config

    targets = ["q_proj", "v_proj"]
    fix = "merge it with peft's merge_and_unload() on a copy of the trained model in one process"
    assert refusal("llama", LoraConfig(r=4, target_modules=targets, use_dora=True)) == (
        "merge_adapters=True merges plain LoRA (W + scaling * B @ A), but the adapter "
        f"'default' of the model 'model' uses use_dora=True, which it does not merge: {fix}, "
        "or train without them")
    assert refusal("llama", LoraConfig(r=4, target_modules=targets, lora_bias=True,
                                       modules_to_save=["lm_head"])) == (
        "merge_adapters=True merges plain LoRA (W + scaling * B @ A), but the adapter "
        "'default' of the model 'model' uses lora_bias=True, modules_to_save=['lm_head'], "
        f"which it does not merge: {fix}, or train without them")
    assert "uses target_parameters=['experts.w1'], which it does not merge" in refusal(
        "qwen3_moe", LoraConfig(r=4, target_modules=targets, target_parameters=["experts.w1"]))
    assert refusal("llama", IA3Config(target_modules=["q_proj", "down_proj"],
                                      feedforward_modules=["down_proj"])) == (
        "merge_adapters=True merges LoRA adapters, but the adapter 'default' of the model "
        f"'model' is a peft IA3 adapter: {fix}")
    assert refusal("llama_tied", LoraConfig(r=4, target_modules=["lm_head"])) == (
        "the LoRA layer lm_head of the model 'model' adapts a weight tied to "
        "model.embed_tokens.weight: merged, the two would differ, and the export keeps one. "
        "Leave lm_head out of target_modules, or untie them (tie_word_embeddings=False)")
    assert refusal("llama", LoraConfig(r=4, target_modules=["embed_tokens"])) == (
        "the LoRA layer model.embed_tokens of the model 'model' adapts a nn.Embedding: "
        "merge_adapters=True merges LoRA on linear layers' weights only; leave "
        "model.embed_tokens out of the LoRA config, or export the adapter with format='peft'")
    assert refusal("llama", LoraConfig(r=4, target_modules=targets),
                   LoraConfig(r=2, target_modules=targets)) == (
        "merge_adapters=True merges one adapter, but the model 'model' holds ['default', "
        "'other']: delete the others (model.delete_adapter) before exporting")
    # Through export_weights, before anything is written: a model without adapters, and a
    # format that is not the Hugging Face layout.
    trainer = ToyTrainer(toy_config(n_samples=16))
    trainer.fit()
    with pytest.raises(ValueError) as error:
        trainer.export_weights(tmp_path / "merged", merge_adapters=True)
    assert str(error.value) == (
        "merge_adapters=True merges the LoRA adapters of a peft model into its base, but the "
        "model 'model' is a Sequential: wrap it with peft.get_peft_model in configure_models, "
        "or export without merge_adapters")
    for format in ("peft", "safetensors"):
        with pytest.raises(ValueError) as error:
            trainer.export_weights(tmp_path / "merged", format=format,  # type: ignore[arg-type]
                                   merge_adapters=True)
        assert str(error.value) == (
            "merge_adapters=True writes the merged model in the Hugging Face layout, not "
            f"format={format!r}: export format='hf' with it, or format='peft' without it for "
            "the adapters alone")
    assert not (tmp_path / "merged").exists()
