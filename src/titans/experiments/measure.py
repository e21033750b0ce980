"""The experiments that measure instead of training: `capacity` (the memory alone at test time) and `efficiency`
(training and generation speed, peak memory).

capacity — how many random key→value associations one streaming pass writes into the memory so that they can be
read back. The memory alone, without a model around it: each token of a capacity sequence (`tasks.recall.Capacity`)
is a fixed random unit vector, the pairs (k_i, v_i) are written once, in order, by the default update rule with
constant gates (θ from the grid, η and α at the layer's initialisation), and each key is then read with the final
weights, the answer being the value token whose vector is nearest (cosine) to M(k). `measure_capacity` turns that
into the most pairs recalled at ≥ threshold. θ is the one thing the model would learn, so every θ of the grid is
tried and the best kept (the runs record which).

efficiency — one training step (forward, backward) of a batch of `length` tokens, and generation one token at a
time after a prompt of `length` tokens, for every variant at the experiment's model config, each point in its own
process under an address-space cap (`machine.run_isolated`) so that its peak resident memory is its own.
titans-pytorch's MemoryAsContextTransformer at its README configuration runs beside them where it is installed.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..tasks.recall import Capacity, CapacityOptions, measure_capacity
from .runs import Measuring
from .spec import Experiment, merge

# ------------------------------------------------------------------------------------------------------- capacity


def memory_reader(dim: int, memory_depth: int, expansion: int, chunk_size: int, theta: float, vocab: int,
                  residual: bool = False):
    """predict(inputs [B, 4n + 1]) -> predicted tokens [B, 4n + 1]: the pairs written into a fresh memory, every
    queried key read back (other positions predict -1)."""
    from ..memory import Gates, NeuralMemory, memory_apply, parallel_memory

    generator = torch.Generator().manual_seed(0)
    rule = capacity_rule(residual)
    layer = NeuralMemory(dim, heads=1, depth=memory_depth, expansion=expansion, chunk_size=chunk_size, rule=rule)
    vectors = torch.nn.functional.normalize(torch.randn(vocab, dim, generator=generator, dtype=torch.float64), dim=-1)
    weights = tuple(w.detach().double() for w in layer.initial_weights)
    value_low, value_high = Capacity(CapacityOptions(vocab=vocab, num_pairs=1)).value_range

    def predict(inputs: torch.Tensor) -> torch.Tensor:
        batch, length = inputs.shape
        n = (length - 1) // 4
        keys, values = vectors[inputs[:, 0:2 * n:2]][:, None], vectors[inputs[:, 1:2 * n:2]][:, None]
        gate = torch.ones(batch, 1, n, dtype=torch.float64)
        _, final, _ = parallel_memory(
            keys, keys, values, Gates(theta * gate, layer_gate(layer, 1) * gate, layer_gate(layer, 2) * gate),
            tuple(w.unsqueeze(0).expand(batch, -1, -1, -1) for w in weights), rule=rule, chunk_size=chunk_size)
        start = length - 2 * n
        read = memory_apply(vectors[inputs[:, start::2]][:, None], final, rule)[:, 0]
        scores = torch.nn.functional.normalize(read, dim=-1) @ vectors[value_low:value_high].T
        preds = torch.full_like(inputs, -1)
        preds[:, start::2] = scores.argmax(-1) + value_low
        return preds

    return predict


def capacity_rule(residual: bool = False):
    """The rule capacity writes with: the default rule but for the residual; the gates are given here, so κ is off
    (θ is the capacity grid's choice)."""
    from ..memory import MemoryRule

    return MemoryRule(residual=residual, max_momentum_step=None)


def layer_gate(layer: Any, which: int) -> float:
    """The layer's gate `which` (0 θ/θ_max, 1 η, 2 α) at initialisation, from its bias."""
    return float(torch.sigmoid(layer.to_gates.bias.detach().view(3, layer.heads)[which, 0]))


def capacity_point(grid: dict[str, Any], memory_depth: int, expansion: int, chunk_size: int) -> dict[str, Any]:
    """The best θ's capacity for one memory shape, and the accuracy at every pair count for every θ."""
    by_theta = {}
    vocab = 2 + 2 * max(512, 2 * max(grid["pair_counts"]))  # enough distinct keys for the most pairs
    for theta in grid["thetas"]:
        predict = memory_reader(grid["dim"], memory_depth, expansion, chunk_size, theta, vocab,
                                grid["memory_residual"])
        result = measure_capacity(predict, grid["pair_counts"], threshold=grid["threshold"], vocab=vocab,
                                  batch_size=grid["batch_size"])
        by_theta[str(theta)] = {"capacity": result.capacity,
                                "accuracy": {str(n): round(a, 4) for n, a in result.accuracy.items()}}
    best = max(by_theta, key=lambda t: (by_theta[t]["capacity"], sum(by_theta[t]["accuracy"].values())))
    return {"capacity": by_theta[best]["capacity"], "theta": float(best), "by_theta": by_theta}


# What a capacity point depends on beyond its shape: the grid's settings but its axes, and the memory's rule.
CAPACITY_SETTINGS = ("dim", "pair_counts", "thetas", "threshold", "batch_size")
CAPACITY_KEYS = ("capacity", "theta", "by_theta")


def capacity_spec(grid: dict[str, Any], shape: tuple[int, int, int], rule: dict[str, Any] | None) -> dict[str, Any]:
    depth, expansion, chunk = shape
    return {"grid": {key: grid.get(key) for key in CAPACITY_SETTINGS}, "memory_depth": depth, "expansion": expansion,
            "chunk_size": chunk, "rule": rule}


def capacity_results(exp: Experiment, points_dir: Path, how: Measuring) -> dict[str, Any]:
    """The capacity JSON body: one row per memory depth, one panel per chunk size, x the expansion. A shape's point
    is read back from the results JSON (`how.recorded`) where measured under exactly its spec (`capacity_spec`: the
    grid's settings and the memory's rule, so that a changed default of the rule marks it stale), else measured and
    kept in `points_dir` (or shown stale from its record: `runs.measure_points`)."""
    from .runs import Point, add_setting, json_data, measure_points

    grid = exp.capacity
    settings = grid.to_dict()
    shapes = [(d, e, c) for c in grid.chunk_sizes for d in grid.memory_depths for e in grid.expansions]
    rule = capacity_rule(grid.memory_residual).to_dict()
    points = [Point(f"depth{d}-expansion{e}-chunk{c}", capacity_spec(settings, (d, e, c), rule),
                    (points_dir / f"depth{d}-expansion{e}-chunk{c}.json", capacity_point, settings, d, e, c))
              for d, e, c in shapes]
    data = json_data(how.recorded)

    def recorded_spec(record: dict[str, Any]) -> dict[str, Any]:
        # a record from before records kept their spec: the JSON's grid, the rule not recorded
        shape = (record["memory_depth"], record["expansion"], record["chunk_size"])
        return record.get("spec") or capacity_spec(data.get("grid", {}), shape, None)

    found, stale = measure_points(points, data.get("runs", {}), recorded_spec, CAPACITY_KEYS,
                                  lambda p: f"capacity {p['capacity']} at theta {p['theta']}", how)
    panels: dict[str, dict[str, list]] = {}
    results: dict[str, dict[str, float]] = {}
    runs = {}
    for point, (depth, expansion, chunk) in zip(points, shapes):
        panel = f"chunk {chunk}"
        setting = f"{panel}/{expansion}"
        add_setting(panels, panel, setting, float(expansion))
        if point.run_id not in found:
            continue
        result = found[point.run_id]
        results.setdefault(f"memory depth {depth}", {})[setting] = result["capacity"]
        spec = point.spec if point.run_id not in stale else recorded_spec(data["runs"][point.run_id])
        runs[point.run_id] = {"model": f"memory depth {depth}", "panel": panel, "values": {setting: result["capacity"]},
                              "memory_depth": depth, "expansion": expansion, "chunk_size": chunk, **result,
                              "spec": spec}
    return {"panels": panels, "results": results, "runs": runs, "grid": settings,
            **ledger([point.run_id for point in points], runs, stale)}


def ledger(run_ids: list[str], runs: dict[str, Any], stale: dict[str, list[str]]) -> dict[str, Any]:
    """The JSON's "pending" (the points not measured under the grid's spec, stale ones among them) and "stale"
    ({run id: what changed since}), as a training grid writes them; nothing once every point is current."""
    pending = [run_id for run_id in run_ids if run_id not in runs or run_id in stale]
    return {**({"pending": pending} if pending else {}), **({"stale": stale} if stale else {})}


# ----------------------------------------------------------------------------------------------------- efficiency

REFERENCE = "titans-pytorch mac"
# titans-pytorch's README example: MemoryAsContextTransformer(num_tokens=256, dim=256, depth=2, segment_len=128,
# num_persist_mem_tokens=4, num_longterm_mem_tokens=16)
REFERENCE_CONFIG = {"num_tokens": 256, "dim": 256, "depth": 2, "segment_len": 128, "num_persist_mem_tokens": 4,
                    "num_longterm_mem_tokens": 16}


def _build(spec: dict[str, Any]) -> torch.nn.Module:
    if spec["impl"] == REFERENCE:
        from titans_pytorch import MemoryAsContextTransformer

        return MemoryAsContextTransformer(**REFERENCE_CONFIG)
    from ..models import TitansConfig, TitansLM

    return TitansLM(TitansConfig.from_dict(spec["model"]))


def _logits(model: torch.nn.Module, tokens: torch.Tensor, reference: bool) -> torch.Tensor:
    return model(tokens) if reference else model(tokens)[0]


def _decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds for our model to generate `new_tokens` tokens (greedy) after reading `prompt` into its state: the
    prompt is read first, untimed, so this is the decoding alone, one token at a time through the state."""
    _, state = model(prompt[:, :-1])
    start = time.perf_counter()
    model.generate(prompt[:, -1:], new_tokens, temperature=0, state=state)
    return time.perf_counter() - start


def _reference_decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """The same for titans-pytorch, whose sampler takes no state: the time to sample 1 + new_tokens tokens less the
    time to sample 1, each the best of two (its sampler with its cache; the prompt's pass cancels)."""
    def sample(n: int) -> float:
        start = time.perf_counter()
        model.sample(prompt, prompt.shape[1] + n, use_cache=True, show_progress=False)
        return time.perf_counter() - start

    return max(min(sample(1 + new_tokens) for _ in range(2)) - min(sample(1) for _ in range(2)), 1e-9)


def efficiency_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in the isolated process: training tokens/s and peak memory, then generation tokens/s."""
    from ..machine import rss_mib

    torch.manual_seed(0)
    reference = spec["impl"] == REFERENCE
    model = _build(spec)
    vocab = REFERENCE_CONFIG["num_tokens"] if reference else spec["model"]["vocab_size"]
    tokens = torch.randint(0, vocab, (spec["batch_size"], spec["length"]))
    base = rss_mib()
    times = []
    for i in range(1 + spec["repeats"]):  # the first step warms the allocator and any lazily built kernels
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _logits(model, tokens, reference).float().logsumexp(-1).mean().backward()
        if i:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    model.eval()
    with torch.no_grad():
        prompt, n = tokens[:1], spec["generate_tokens"]
        seconds = (_reference_decode_seconds(model, prompt, n) if reference
                   else min(_decode_seconds(model, prompt, n) for _ in range(2)))
    return {"train_tokens_per_s": spec["batch_size"] * spec["length"] / min(times), "peak_mib": peak,
            "generate_tokens_per_s": n / seconds,
            "num_parameters": sum(p.numel() for p in model.parameters())}


def efficiency_point(spec: dict[str, Any], memory_cap_gib: float, timeout_s: float, machine: str) -> dict[str, Any]:
    """One point in its own process; `machine` (unused here) keys the cached result to the machine that measured it."""
    from ..machine import run_isolated

    status, point = run_isolated("titans.experiments.measure", spec, memory_cap_gib, timeout_s)
    return {"status": status, **(point or {})}


# What an efficiency point's timings depend on beyond the model and the length: the grid's settings, and the machine.
EFFICIENCY_SETTINGS = ("batch_size", "repeats", "generate_tokens", "threads")
EFFICIENCY_KEYS = ("status", "train_tokens_per_s", "peak_mib", "generate_tokens_per_s", "num_parameters")


def model_identity(impl: str, config: dict[str, Any], version: str | None) -> dict[str, Any]:
    """The model an efficiency point times: ours as its config with every default spelled out (a record from before a
    default changed read with the earlier one) less the fields its variant never reads; titans-pytorch's config and
    version."""
    if impl == REFERENCE:
        return {"config": config, "version": version}
    from ..models import TitansConfig
    from ..models.config import unread_fields, with_earlier_defaults, without_fields

    cfg = TitansConfig.from_dict(with_earlier_defaults(config))
    return without_fields(cfg.to_dict(), unread_fields(cfg))


def efficiency_spec(impl: str, model: dict[str, Any], length: int, grid: dict[str, Any],
                    machine: str | None) -> dict[str, Any]:
    return {"impl": impl, "model": model, "length": length, **{key: grid.get(key) for key in EFFICIENCY_SETTINGS},
            "machine": machine}


def efficiency_results(exp: Experiment, points_dir: Path, how: Measuring) -> dict[str, Any]:
    """The efficiency JSON body: one row per variant (and the reference), panels for training tokens/s, peak memory
    and generation tokens/s, x the sequence length. Points run one at a time (`how.jobs` is not read): timings taken
    side by side would measure each other. A point is read back from the results JSON (`how.recorded`) where
    measured under exactly its spec (`efficiency_spec`: the model's config, the grid's settings and the machine, so
    that a changed default marks the points of every model it changes stale), else measured and kept in
    `points_dir` (or shown stale from its record: `runs.measure_points`)."""
    from ..machine import describe_machine, reference_available
    from ..models.peer import installed_version
    from ..train.config import load_train_config
    from .runs import Point, json_data, measure_points

    grid = exp.efficiency
    settings = grid.to_dict()
    data = json_data(how.recorded)
    models = dict(exp.models)
    installed = reference_available()
    if grid.reference:  # where titans-pytorch is not installed, its recorded points are kept as measured
        models[REFERENCE] = {}
        if not installed and not how.quiet:
            print("titans-pytorch is not installed (pip install -c constraints.txt '.[compare]'): its points are "
                  "not measured here", flush=True)
    machine = describe_machine()
    points, jobs = [], []
    for impl, changes in models.items():
        model, version = REFERENCE_CONFIG, installed_version() if installed else None
        if impl != REFERENCE:
            model = load_train_config(data=merge(exp.base, {"model": changes})).model.to_dict()
        for length in grid.lengths:
            run_id = f"{impl} {length}".replace(" ", "-")
            if impl == REFERENCE and not installed:  # its points as recorded, with the version they name
                record = data.get("runs", {}).get(run_id, {})
                if "spec" not in record:
                    continue
                version = record["spec"]["model"].get("version")
            job = {"impl": impl, "model": {} if impl == REFERENCE else model, "length": length,
                   "batch_size": grid.batch_size, "repeats": grid.repeats, "generate_tokens": grid.generate_tokens,
                   "threads": grid.threads}
            jobs.append(job)
            points.append(Point(run_id, efficiency_spec(impl, model_identity(impl, model, version), length, settings,
                                                        machine),
                                (points_dir / f"{run_id}.json", efficiency_point, job, grid.memory_cap_gib,
                                 grid.timeout_s, machine), measurable=impl != REFERENCE or installed))

    def recorded_spec(record: dict[str, Any]) -> dict[str, Any]:
        # a record from before records kept their spec: its config, the JSON's grid and machine
        return record.get("spec") or efficiency_spec(
            record["model"], model_identity(record["model"], record["config"], None), record["length"],
            data.get("grid", {}), data.get("machine"))

    found, stale = measure_points(
        points, data.get("runs", {}), recorded_spec, EFFICIENCY_KEYS,
        lambda p: p["status"] if p["status"] != "ok" else
        f"train {p['train_tokens_per_s']:.0f} tok/s, peak {p['peak_mib']:.0f} MiB, "
        f"generate {p['generate_tokens_per_s']:.0f} tok/s", replace(how, jobs=1))
    measures = {"training tokens/s": ("train_tokens_per_s", True), "peak memory (MiB)": ("peak_mib", False),
                "generation tokens/s": ("generate_tokens_per_s", True)}
    panels = {name: {"settings": [f"{name}/{n}" for n in grid.lengths], "x": [float(n) for n in grid.lengths],
                     "higher_is_better": better} for name, (_, better) in measures.items()}
    results: dict[str, dict[str, float | None]] = {}
    runs = {}
    for point, job in zip(points, jobs):
        if point.run_id not in found:
            continue
        result = found[point.run_id]
        values = {f"{name}/{job['length']}": result.get(key) for name, (key, _) in measures.items()}
        results.setdefault(job["impl"], {}).update(values)
        record = data["runs"][point.run_id] if point.run_id in stale else None
        runs[point.run_id] = {"model": job["impl"], "length": job["length"], "values": values,
                              "config": record["config"] if record else job["model"] or REFERENCE_CONFIG,
                              **result, "spec": recorded_spec(record) if record else point.spec}
    return {"panels": panels, "results": results, "runs": runs, "grid": settings,
            **ledger([point.run_id for point in points], runs, stale)}


if __name__ == "__main__":
    from ..machine import limit_address_space

    print(json.dumps(efficiency_worker(limit_address_space(json.loads(sys.argv[1])))))
