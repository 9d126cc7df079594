"""Fine-tune the character-level GPT of ``char_gpt.py`` on other text: start from its weights.

    torchrun --standalone --nproc_per_node=2 examples/char_gpt.py     # pretrain first
    torchrun --standalone --nproc_per_node=2 examples/finetune.py
    torchrun --standalone --nproc_per_node=2 examples/finetune.py \\
        --checkpoint_parameters.resume outputs/examples/char_gpt/gpt/checkpoints/step_200

The model, trainer and data pipeline are imported from ``char_gpt.py``; only the config
differs. The text is now the ``asyncio`` package's source, and the run starts from the newest
complete checkpoint of the default ``char_gpt.py`` run (or the ``step_<N>`` directory given as
``checkpoint_parameters.resume``).

What it shows:

- ``CheckpointParameters(resume=<step directory>, load_weights_only=True)`` loads only the
  model weights, resharded to this run's ranks: the optimizer, the learning-rate schedule,
  the step counter and the data position start fresh. The model shape (``--gpt.*``) must
  match the pretraining run's; a mismatch is an error naming each differing parameter.
- The first validation line (step 0) is the pretrained model's loss on the new text, far
  below the ln(256) = 5.55 of an untrained model; the lines after it show the adaptation.
  Rank 0 prints the loss before and after fine-tuning, a sample, and where the logs and
  checkpoints went (a separate experiment, ``examples/char_gpt/finetune``).
"""

from __future__ import annotations

from pathlib import Path

# Run as a script, this file's directory is sys.path[0], so its sibling imports as a module.
from char_gpt import CharGPTConfig, CharGPTTrainer, default_config as pretraining_config, report

from dream_trainer.configs import CheckpointParameters, TrainingParameters, apply_cli_overrides


def newest_checkpoint(checkpoints: Path) -> Path | None:
    """The newest complete ``step_<N>`` directory under ``checkpoints``, if there is one.

    A checkpoint is complete once DCP has written its ``.metadata`` (the last file it writes).
    """
    complete = [path for path in checkpoints.glob("step_*") if (path / ".metadata").is_file()]
    return max(complete, key=lambda path: int(path.name.removeprefix("step_")), default=None)


def pretrained_checkpoints() -> Path:
    """Where the default ``char_gpt.py`` run keeps its checkpoints."""
    config = pretraining_config()
    return (config.checkpoint_parameters.root_dir / config.project / config.group
            / config.experiment / "checkpoints")


def default_config() -> CharGPTConfig:
    """``char_gpt.py``'s config with other text, a gentler schedule and its weights to load."""
    pretrained = pretraining_config()
    # Without a pretrained checkpoint the directory itself stands in; make_trainer then says
    # what to run (unless the command line names a checkpoint).
    start_from = newest_checkpoint(pretrained_checkpoints()) or pretrained_checkpoints()
    return CharGPTConfig(
        project=pretrained.project, group=pretrained.group, experiment="finetune",
        device_parameters=pretrained.device_parameters,
        gpt=pretrained.gpt,
        files="asyncio/*.py",
        learning_rate=1e-3,
        warmup_steps=10,
        sample_prompt="async def ",
        training_parameters=TrainingParameters(
            n_epochs=3, train_steps_per_epoch=40, train_batch_size=16, val_batch_size=32,
            val_steps_per_epoch=8, gradient_clip_val=1.0),
        checkpoint_parameters=CheckpointParameters(
            root_dir=pretrained.checkpoint_parameters.root_dir, resume=start_from,
            load_weights_only=True),
        logging_parameters=pretrained.logging_parameters,
        callbacks=pretrained.callbacks,
    )


def make_trainer(args: list[str] | None = None) -> CharGPTTrainer:
    """The fine-tuning trainer, with ``args`` (default: the command line) as config overrides.

    Raises:
        SystemExit: if ``checkpoint_parameters.resume`` is not a complete checkpoint.
    """
    config = apply_cli_overrides(default_config(), args, description=__doc__)
    start_from = config.checkpoint_parameters.resume
    if not isinstance(start_from, Path) or not (start_from / ".metadata").is_file():
        raise SystemExit(
            f"no pretrained checkpoint at {start_from}: run examples/char_gpt.py first, or "
            "pass --checkpoint_parameters.resume <its checkpoints/step_N directory>")
    return CharGPTTrainer(config)


def main() -> None:
    trainer = make_trainer()
    trainer.fit()
    if trainer.world.is_rank_zero:
        (_, before), (step, after) = trainer.val_losses[0], trainer.val_losses[-1]
        print(f"started from {Path(trainer.config.checkpoint_parameters.resume).resolve()}")
        print(f"val_loss before fine-tuning={before:.4f}, after {step} steps={after:.4f}")
    report(trainer)


if __name__ == "__main__":
    main()
