"""Script: HangWatchdog, in one of two modes given as the first argument.

``hang`` (4 ranks, flight recorder on): rank 1 sleeps for an hour in training_step at global
step 2 while the others wait for it in the step's gradient all-reduce. The others' watchdogs
(4 s) end them while rank 1 still sleeps, so they are ended by their own watchdogs, not by a
broken connection; rank 1's (6 s) ends rank 1. Every rank dumps its flight recorder and
writes its record to the directory given as the second argument, and rank 0 prints the
verdict.

``orders`` (4 ranks under torchrun with ``--max-restarts=2``, the default trace_dir): the
same hang once per attempt, the ranks' watchdogs firing in the order ``ORDERS`` gives for it
(``TORCHELASTIC_RESTART_COUNT``), each into the default trace_dir of its own experiment
``attempt<N>``: rank 0 first and rank 1 last; rank 3 first and rank 0 last;
ranks 1-3 together while rank 0's would fire only after torchrun has ended it.

``progress`` (1 process): setup, and every step, are slow but each within the timeout or before
the watchdog arms; StopTraining then ends fit() without post_fit, and the process lives on
past the timeout. It must print "survived" and exit 0.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.hang_watchdog import HangWatchdog
from dream_trainer.configs import DeviceParameters
from dream_trainer.trainer import StopTraining
from tests.helpers.toy import ToyTrainer, toy_config


class SleepsOnRankOne(ToyTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.world.rank == 1 and self.global_step == 2:
            print(f"rank 1 hangs from {time.time():.3f}", flush=True)
            time.sleep(3600)  # the hang
        return super().training_step(batch, batch_idx)


class SlowButProgressing(ToyTrainer):
    # Generous against a loaded machine: a step is 1/8 of the timeout.
    TIMEOUT = 2.0

    def configure_models(self) -> None:
        time.sleep(1.5 * self.TIMEOUT)  # before the watchdog arms: not timed
        super().configure_models()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        time.sleep(self.TIMEOUT / 8)
        return super().training_step(batch, batch_idx)


class StopAfterFirstEpoch(Callback):
    def post_epoch(self) -> None:
        raise StopTraining("first epoch done")


def hang() -> None:
    timeout = 6.0 if os.environ["RANK"] == "1" else 4.0
    watchdog = HangWatchdog(timeout=timeout, trace_dir=sys.argv[2], report_wait=60.0)
    config = toy_config(callbacks=[watchdog], n_epochs=5, n_samples=320,
                        device_parameters=DeviceParameters(flight_recorder_entries=200))
    SleepsOnRankOne(config).fit()
    print("finished without hanging")


# Per attempt: each rank's timeout, and report_wait. A rank's watchdog checks every
# min(1, timeout / 4) s, so the first (2 s) fires by 2.5 s and the last (5 s) from 5 s on.
ORDERS = {0: ((2.0, 5.0, 3.0, 3.0), 30.0),
          1: ((5.0, 3.0, 3.0, 2.0), 30.0),
          2: ((600.0, 2.0, 2.0, 2.0), 3.0)}


def orders() -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    timeouts, report_wait = ORDERS[attempt]
    print(f"attempt {attempt} starts", file=sys.stderr, flush=True)
    watchdog = HangWatchdog(timeout=timeouts[int(os.environ["RANK"])], report_wait=report_wait)
    # An experiment per attempt, so each attempt's records keep a directory of their own.
    config = toy_config(callbacks=[watchdog], n_epochs=5, n_samples=320,
                        device_parameters=DeviceParameters(flight_recorder_entries=200)
                        ).model_copy(update={"experiment": f"attempt{attempt}"})
    SleepsOnRankOne(config).fit()
    print("finished without hanging")


def progress() -> None:
    watchdog = HangWatchdog(timeout=SlowButProgressing.TIMEOUT)
    trainer = SlowButProgressing(toy_config(callbacks=[watchdog, StopAfterFirstEpoch()],
                                            n_epochs=3, n_samples=64))
    trainer.fit()
    time.sleep(2 * SlowButProgressing.TIMEOUT)
    print(f"survived; watching={watchdog.watching}")


if __name__ == "__main__":
    {"hang": hang, "orders": orders, "progress": progress}[sys.argv[1]]()
