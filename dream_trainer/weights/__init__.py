"""The Hugging Face safetensors layout: recognizing and checking it, reading a rank's slices
of it (``hf_reader``), and writing it from a live run of any parallel layout (``hf``); and
what a key map may answer besides a name (``TransformedKey``). Training checkpoints, their
export and ``init_weights_from`` are ``dream_trainer.checkpoint``, which builds on this
package."""

from dream_trainer.weights.keys import TransformedKey
from dream_trainer.weights.torchtitan import torchtitan_moe_key

__all__ = ["TransformedKey", "torchtitan_moe_key"]
