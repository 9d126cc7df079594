"""``python -m dream_trainer``."""

import sys

from dream_trainer.cli import main

sys.exit(main())
