"""Generation speed per variant, all in one process and interleaved (`titans bench generate`).

A shared or loaded machine drifts by more than the differences between variants, so every round times each model
once, in turn, and each model keeps its best round: the variants see the same phases of the machine, and the ratio
to the transformer measured in the same run is the number to read. Beside the wall-clock rate, the rate per second of
CPU time the process used (`time.process_time`): on a machine where other work takes the cores away, that one
counts only this process's work. The ATen operations one token dispatches are counted too: unlike a time, that
count does not depend on the machine at all.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..models import TitansConfig, TitansLM


class _OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it (after autograd: what actually runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _prompt_state(model: TitansLM, prompt: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(prompt[:, :-1])[1]


def ops_per_token(model: TitansLM, prompt: torch.Tensor, new_tokens: int) -> tuple[float, Counter[str]]:
    """ATen operations per generated token (the mean over `new_tokens`), and their counts by name."""
    state = _prompt_state(model, prompt)
    with _OpCounter() as counter:
        model.generate(prompt[:, -1:], new_tokens, temperature=0, state=state)
    return sum(counter.ops.values()) / new_tokens, counter.ops


def measure_generation(model_config: dict[str, Any], variants: list[str], prompt_len: int, new_tokens: int,
                       rounds: int, seed: int = 0, compile: bool = False) -> list[dict[str, Any]]:
    """Greedy generation of `new_tokens` after a `prompt_len`-token prompt (read first, untimed, as the efficiency
    experiment does) for each variant at `model_config`: tokens per second of wall-clock and of CPU time (best
    round each), their ratios to the transformer's when the transformer is among the variants, ATen ops per token
    and the parameter count. With `compile`, each variant is measured a second time with `generate(decode="compiled")`
    (its row's `compiled` true, the seconds its graphs took to build in `compile_s`; ratios are to the eager
    transformer), interleaved with the rest."""
    torch.manual_seed(seed)
    models = {name: TitansLM(TitansConfig.from_dict({**model_config, "variant": name})).eval() for name in variants}
    prompt = torch.randint(0, models[variants[0]].config.vocab_size, (1, prompt_len))
    states = {name: _prompt_state(model, prompt) for name, model in models.items()}
    runs = [(name, False) for name in variants] + ([(name, True) for name in variants] if compile else [])
    wall, cpu = dict.fromkeys(runs, float("inf")), dict.fromkeys(runs, float("inf"))
    compile_s = {}
    with torch.no_grad():
        decode = {False: "dynamic", True: "compiled"}
        for name, compiled in runs:  # warm-up: lazily built kernels, the allocator, and every graph a timed run needs
            start = time.perf_counter()
            models[name].generate(prompt[:, -1:], new_tokens if compiled else 2, temperature=0, state=states[name],
                                  decode=decode[compiled])
            if compiled:
                compile_s[name] = time.perf_counter() - start
        for _ in range(rounds):
            for name, compiled in runs:
                start, start_cpu = time.perf_counter(), time.process_time()
                models[name].generate(prompt[:, -1:], new_tokens, temperature=0, state=states[name],
                                      decode=decode[compiled])
                wall[name, compiled] = min(wall[name, compiled], time.perf_counter() - start)
                cpu[name, compiled] = min(cpu[name, compiled], time.process_time() - start_cpu)
    ops = {name: ops_per_token(model, prompt, min(new_tokens, 32))[0] for name, model in models.items()}
    rows = []
    for name, compiled in runs:
        model = models[name]
        row = {"variant": name, "compiled": compiled, "tokens_per_s": new_tokens / wall[name, compiled],
               "tokens_per_cpu_s": new_tokens / cpu[name, compiled],
               # a compiled step runs inductor's kernels, not ATen operators one by one
               "ops_per_token": None if compiled else ops[name], "num_parameters": model.num_parameters()}
        if compiled:
            row["compile_s"] = compile_s[name]
        if "transformer" in variants:
            row["vs_transformer"] = wall["transformer", False] / wall[name, compiled]
            row["cpu_vs_transformer"] = cpu["transformer", False] / cpu[name, compiled]
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<16}{'step':>9}{'tokens/s':>10}{'vs transformer':>16}{'tokens/CPU-s':>14}"
             f"{'vs transformer':>16}{'ATen ops/token':>16}{'parameters':>12}"]
    for row in rows:
        ratios = [f"{row[key]:.2f}" if key in row else "-" for key in ("vs_transformer", "cpu_vs_transformer")]
        ops = "-" if row["ops_per_token"] is None else f"{row['ops_per_token']:.0f}"
        step = "compiled" if row.get("compiled") else "eager"
        lines.append(f"{row['variant']:<16}{step:>9}{row['tokens_per_s']:>10.1f}{ratios[0]:>16}"
                     f"{row['tokens_per_cpu_s']:>14.1f}{ratios[1]:>16}{ops:>16}{row['num_parameters']:>12,}")
    return "\n".join(lines)
