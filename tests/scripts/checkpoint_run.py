"""Script: train the checkpointed toy (resume="latest"), optionally SIGKILLing itself.

Usage: checkpoint_run.py ROOT OUT [--kill POINT ...] [--markers DIR] [--samples FILE]
       [--parallel ddp|fsdp] [--kill-rank R] [--signal SIGKILL|SIGTERM] [--no-rank-state]
       [--accumulation N] [--preemption-poll-seconds S]
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import torch

from dream_trainer.configs import DeviceParameters
from tests.helpers.checkpointing import (CheckpointedTrainer, Killer, SampleLog,
                                         checkpointed_config, final_state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--signal", choices=["SIGKILL", "SIGTERM"], default="SIGKILL")
    parser.add_argument("--markers", type=Path)
    parser.add_argument("--samples", type=Path)
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--no-rank-state", action="store_true")
    parser.add_argument("--preemption-poll-seconds", type=float,
                        help="checkpoint_parameters.preemption_poll_seconds (default: its own)")
    parser.add_argument("--accumulation", type=int, help="micro-batches per optimizer step "
                        "(default 2): to keep the global batch on another number of ranks")
    args = parser.parse_args()
    params = DeviceParameters.FSDP() if args.parallel == "fsdp" else DeviceParameters()
    config = checkpointed_config(args.root, params).model_copy(
        update={"rank_state": not args.no_rank_state})
    if args.preemption_poll_seconds is not None:
        config = config.model_copy(update={"checkpoint_parameters": config.checkpoint_parameters
                                           .model_copy(update={"preemption_poll_seconds":
                                                               args.preemption_poll_seconds})})
    if args.accumulation is not None:
        config = config.model_copy(update={"training_parameters": config.training_parameters
                                           .model_copy(update={"gradient_accumulation_steps":
                                                               args.accumulation})})
    trainer = CheckpointedTrainer(config)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers, args.kill_rank,
                                        signal.Signals[args.signal]))
    if args.samples:
        trainer.callbacks.append(SampleLog(args.samples))
    trainer.callbacks.attach(trainer)
    trainer.fit()
    print(f"rank={trainer.world.rank} preempted={trainer.preempted} step={trainer.global_step}")
    if trainer.world.rank == 0 and args.parallel == "ddp":
        torch.save(final_state(trainer), args.out)


if __name__ == "__main__":
    main()
