"""torchrun script (2 ranks, DDP, accumulation 2): the logged step loss and the progress bar's
value, with token-weighted losses (num_items) and with plain mean losses."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

from dream_trainer.callbacks import ProgressBar
from dream_trainer.configs import DeviceParameters, LoggingParameters
from dream_trainer.mixins import JSONLoggerConfigMixin, JSONLoggerMixin
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.tokens import TokenConfig, TokenTrainer, token_config
from tests.helpers.toy import ToyConfig, ToyTrainer, toy_config

BATCH, ACCUMULATION = 2, 2


class LoggedTokens(TokenTrainer, JSONLoggerMixin):
    pass


class LoggedTokenConfig(TokenConfig, JSONLoggerConfigMixin):
    pass


class LoggedToy(ToyTrainer, JSONLoggerMixin):
    pass


class LoggedToyConfig(ToyConfig, JSONLoggerConfigMixin):
    pass


def run(trainer_class: type, config: Any, out: Path) -> dict[str, Any]:
    stream = io.StringIO()
    bar = ProgressBar(refresh_every_n_steps=1, smoothing=1.0, stream=stream)
    logging = LoggingParameters(log_dir=out, log_every_n_steps=1)
    trainer = trainer_class(config.model_copy(update={"callbacks": [bar],
                                                      "logging_parameters": logging}))
    trainer.fit()
    if not trainer.world.is_rank_zero:
        return {}
    rows = [json.loads(line) for line in (trainer.log_dir / "metrics.jsonl").read_text()
            .splitlines()]
    logged = [row["loss"] for row in rows if "trainer/global_step" in row]
    printed = [float(line.split(" loss ")[1].split()[0]) for line in
               stream.getvalue().splitlines() if " loss " in line and line.startswith("epoch")]
    return {"logged": logged, "printed": printed}


def main(out: str) -> None:
    directory = Path(out).parent
    tokens = token_config(DeviceParameters.DDP(), train_batch_size=BATCH,
                          gradient_accumulation_steps=ACCUMULATION)
    toy = toy_config(device_parameters=DeviceParameters.DDP(), train_batch_size=BATCH,
                     gradient_accumulation_steps=ACCUMULATION, optimizer="sgd", n_samples=32)
    results = {
        "weighted": run(LoggedTokens, LoggedTokenConfig(**dict(tokens)), directory / "tokens"),
        "mean": run(LoggedToy, LoggedToyConfig(**dict(toy)), directory / "toy"),
    }
    save_on_rank_zero(results, out, "step_loss")


if __name__ == "__main__":
    main(sys.argv[1])
