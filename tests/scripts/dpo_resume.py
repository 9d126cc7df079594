"""Script: the DPO run of ``dpo_run`` (policy and frozen reference read from BASE), checkpointed
every 2 steps with ``resume="latest"`` as ``lora_resume`` runs LoRA: FSDP2 on 2 ranks under
torchrun, one process otherwise, optionally SIGKILLed after a step.

    [torchrun --nproc_per_node=2] dpo_resume.py BASE ROOT OUT [--kill step:N --markers DIR]
        [--precompute]

``--precompute``: the reference's log-probs computed once before the first step
(``ReferenceLogProbs``, kept beside the checkpoints) and its storage freed.
"""

from __future__ import annotations

from pathlib import Path

from dream_trainer.mixins import CheckpointMixin
from tests.scripts.dpo_run import DPOTrainer, attach_precomputed
from tests.scripts.lora_resume import WeightSnapshots, main


class DPOResume(WeightSnapshots, DPOTrainer, CheckpointMixin):
    pass


if __name__ == "__main__":
    main(DPOResume, lambda base: {"model": Path(base), "reference": Path(base)},
         attach_precomputed)
