"""The Hugging Face safetensors layout: recognizing and checking it, reading a rank's slices
of it (``hf_reader``), and writing it from a live run of any parallel layout (``hf``).
Training checkpoints, their export and ``init_weights_from`` are ``dream_trainer.checkpoint``,
which builds on this package."""
