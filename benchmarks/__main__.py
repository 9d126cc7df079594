"""Every benchmark in one run: ``python -m benchmarks`` (``make bench``).

Writes ``<out>/results.json`` (every figure, with its spread) and ``<out>/results.md`` (the
tables of docs/performance.md). ``--quick`` runs each benchmark for a few steps with tiny
sizes, to check that the harness works, not to measure anything. The GPU benchmark runs
when CUDA is available; otherwise the last recorded GPU result
(``benchmarks/results/gpu_*.json``) is reported with its device name.

    python -m benchmarks [--quick] [--out benchmarks/results] [--lightning-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import (checkpoint_speed, context_parallel, dpo_memory, expert_steps,
                        hf_load_memory, lora_checkpoint, lora_memory, meta_init_memory,
                        metadata_decode, object_store, pipeline_steps, plan_scale,
                        resume_time, sft_packing, startup, step_overhead, stream_index,
                        stream_resume, training_memory)

RESULTS = Path(__file__).resolve().parent / "results"


def sections(quick: bool, lightning_python: str | None) -> dict[str, Callable[[], Any]]:
    """Name -> zero-argument function returning that benchmark's result."""
    steps, trials = (40, 1) if quick else (300, 5)
    overhead = {
        f"step_overhead/{model}/{ranks}": (
            lambda model=model, ranks=ranks: step_overhead.measure(
                model, steps, trials, ranks, lightning_python))
        # Quick mode checks the harness: the other models run the same code as the MLP.
        for model in (("mlp",) if quick else ("mlp", "mlp512", "transformer"))
        for ranks in (1, 2)
    }
    return {
        **overhead,
        "startup": lambda: startup.measure(1 if quick else 7, lightning_python),
        "training_memory": lambda: (training_memory.measure(8, 2, 1) if quick
                                    else training_memory.measure()),
        "meta_init_memory": lambda: meta_init_memory.measure(32 if quick else 1024),
        "hf_load_memory": lambda: hf_load_memory.measure(16 if quick else 1100),
        "checkpoint_speed": lambda: checkpoint_speed.measure(8 if quick else 256,
                                                             1 if quick else 5),
        "stream_resume": lambda: stream_resume.measure(800 if quick else 40_000,
                                                       1 if quick else 5),
        "resume_time": lambda: resume_time.measure(0.01 if quick else 1.0,
                                                   trials=1 if quick else 3),
        "pipeline_steps": lambda: pipeline_steps.measure(8 if quick else 60,
                                                         1 if quick else 3),
        "expert_steps": lambda: expert_steps.measure(8 if quick else 40, 1 if quick else 3),
        "context_parallel": lambda: context_parallel.measure(
            context_parallel.QUICK_SHAPE if quick else context_parallel.CPU_SHAPE,
            7 if quick else 12, 1 if quick else 3),
        "gpu_throughput": lambda: gpu_result(quick),
        "plan_scale": lambda: plan_scale.measure(quick),
        "stream_index": lambda: stream_index.measure(20_000 if quick else 1_000_000,
                                                     2_000 if quick else 100_000),
        "object_store": lambda: object_store.measure(4 if quick else 64, 1 if quick else 3),
        "metadata_decode": lambda: metadata_decode.measure(20 if quick else 2000,
                                                           4 if quick else 64,
                                                           1 if quick else 3),
        "sft_packing": lambda: (sft_packing.measure(24, 1, sft_packing.QUICK) if quick
                                else sft_packing.measure()),
        "lora_memory": lambda: lora_memory.measure(lora_memory.QUICK if quick
                                                   else lora_memory.Shape()),
        "lora_checkpoint": lambda: lora_checkpoint.measure(
            lora_memory.QUICK if quick else lora_memory.Shape(), 2 if quick else 5),
        "dpo_memory": lambda: dpo_memory.measure(lora_memory.QUICK if quick
                                                 else lora_memory.Shape()),
    }


def gpu_result(quick: bool) -> dict[str, Any] | None:
    if torch.cuda.is_available():
        from benchmarks import gpu_throughput
        from benchmarks.gpt import GPTShape

        shape = GPTShape(d_model=256, n_layers=2, n_heads=4, seq_len=256) if quick else GPTShape()
        return gpu_throughput.measure(shape, 8, 3 if quick else 30, 2 if quick else 10,
                                      1 if quick else 3)
    recorded = sorted(RESULTS.glob("gpu_*.json"))
    return {**json.loads(recorded[-1].read_text()), "recorded": recorded[-1].name} \
        if recorded else None


def markdown(results: dict[str, Any]) -> str:
    lines = ["| Benchmark | Figure |", "|---|---|"]
    for name, result in results["sections"].items():
        if result is None:
            continue
        kind = name.split("/")[0]
        if kind == "gpu_throughput":
            lines += gpu_markdown(result)
        else:
            module = {"step_overhead": step_overhead, "startup": startup,
                      "training_memory": training_memory, "meta_init_memory": meta_init_memory,
                      "hf_load_memory": hf_load_memory, "checkpoint_speed": checkpoint_speed,
                      "stream_resume": stream_resume, "resume_time": resume_time,
                      "plan_scale": plan_scale, "metadata_decode": metadata_decode,
                      "stream_index": stream_index, "object_store": object_store,
                      "pipeline_steps": pipeline_steps, "expert_steps": expert_steps,
                      "context_parallel": context_parallel,
                      "sft_packing": sft_packing, "lora_memory": lora_memory,
                      "lora_checkpoint": lora_checkpoint, "dpo_memory": dpo_memory}[kind]
            lines += module.markdown(result)
    return "\n".join(lines) + "\n"


def gpu_markdown(result: dict[str, Any]) -> list[str]:
    where = f"GPU ({result['device']}{', recorded' if 'recorded' in result else ''})"
    rows = []
    for name, label in (("hand", "hand-written loop"), ("dream", "DreamTrainer")):
        run = result[name]
        mfu = "" if run["mfu"] is None else f", MFU {run['mfu']:.1%}"
        rows.append(f"| {where}: {label} | {run['tokens_per_second']:,.0f} tokens/s{mfu} |")
    rows.append(f"| {where}: DreamTrainer / hand-written throughput | "
                f"{result['dream_over_hand_throughput']:.3f} |")
    if result.get("planned_gib") and result["dream"]["peak_memory_gib"]:
        rows.append(f"| {where}: `dream-trainer plan`'s total / measured peak, DreamTrainer "
                    f"bf16 | {result['planned_gib'] / result['dream']['peak_memory_gib']:.3f} |")
    for recipe in result.get("float8_recipes", []):  # absent from runs recorded before float8
        run = result[f"dream_float8_{recipe}"]
        mfu = "" if run["mfu"] is None else f", MFU {run['mfu']:.1%} of the bf16 peak"
        rows.append(f"| {where}: DreamTrainer, float8 {recipe} | "
                    f"{run['tokens_per_second']:,.0f} tokens/s{mfu}, "
                    f"{result[f'dream_float8_{recipe}_over_dream_throughput']:.3f} x bf16 |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of each, tiny sizes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where results.* go")
    parser.add_argument("--lightning-python", help="interpreter of a venv with lightning")
    parser.add_argument("--only", nargs="*", help="run only the sections starting with these")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "quick": args.quick, "sections": {}, "seconds": {},
    }
    for name, run in sections(args.quick, args.lightning_python).items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        print(f"benchmark {name} ...", flush=True)
        start = time.perf_counter()
        results["sections"][name] = run()
        results["seconds"][name] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    print(table)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")


if __name__ == "__main__":
    main()
