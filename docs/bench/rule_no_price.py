"""No price for the default (issue 45): `titans bench memory`'s forward+backward of the squared loss, the library as it
was before the rule was defined once (a checkout of that commit) against the library after it, in one run.

    git worktree add --detach /tmp/titans-before 851c969
    python docs/bench/rule_no_price.py --before /tmp/titans-before --after . --out docs/bench/rule_no_price.json

Each point is `titans bench memory`'s own worker (`python -m titans.bench.memory SPEC`: a fresh process, its warm-up,
the best of its repeats) run with one tree's `src` first on the path; the two trees alternate within every round, the
order flipped from round to round, so that both see the same phases of a shared machine; each tree's best of the
rounds is kept. Both trees build their own C++ chunk loop (the extension's name hashes its headers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def point(tree: Path, spec: dict, threads: int | None, timeout_s: float) -> dict:
    """One bench point of `tree`'s library: its worker's JSON line, or the failure."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    if threads is not None:  # torch reads them at start-up: intra-op threads, and MKL's
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-m", "titans.bench.memory", json.dumps(spec)], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        return {"status": f"error: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the commit before the change")
    parser.add_argument("--after", type=Path, required=True, help="checkout with the change")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per point (default: torch's)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    commits = {name: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                    text=True).stdout.strip() for name, tree in trees.items()}
    lengths = [int(x) for x in args.lengths.split(",")]
    # titans bench memory's defaults but for what the arguments set: one head, depth 2, expansion 4, chunk 16
    spec = dict(impl="titans", batch=args.batch, dim=args.dim, heads=1, depth=2, expansion=4, chunk_size=16,
                repeats=args.repeats, warmup=args.warmup, device="cpu", implementation=None, memory_cap_gib=20.0)
    runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in lengths} for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for seq in lengths:
            for name in order:
                result = point(trees[name], {**spec, "seq_len": seq}, args.threads, timeout_s=1800)
                runs[name][seq].append(result)
                print(f"round {r + 1} seq {seq} {name}: {result.get('status')} fwd+bwd "
                      f"{result.get('fwd_bwd_tok_s') or 0:.0f} tok/s", file=sys.stderr, flush=True)
    best = {name: {seq: max((p["fwd_bwd_tok_s"] for p in pts if p.get("status") == "ok"), default=None)
                   for seq, pts in by_len.items()} for name, by_len in runs.items()}
    ratios = {seq: best["after"][seq] / best["before"][seq] if best["after"][seq] and best["before"][seq] else None
              for seq in lengths}
    # each round's pair (run back to back) as a ratio, and their median: less exposed to one lucky point than the best
    paired = {seq: sorted(a["fwd_bwd_tok_s"] / b["fwd_bwd_tok_s"]
                          for a, b in zip(runs["after"][seq], runs["before"][seq])
                          if a.get("status") == b.get("status") == "ok") for seq in lengths}
    medians = {seq: (r[len(r) // 2] + r[(len(r) - 1) // 2]) / 2 if r else None for seq, r in paired.items()}
    sys.path.insert(0, str(trees["after"] / "src"))
    try:  # where the tree under test keeps it (bench/__init__.py before issue 46)
        from titans.machine import describe_machine
    except ImportError:
        from titans.bench import describe_machine

    result = {"what": "NeuralMemory forward+backward tokens/s of the squared loss (the default rule), the library "
                      "before issue 45 against after it, one run, trees alternating; best of the rounds",
              "command": "python docs/bench/rule_no_price.py " + " ".join(sys.argv[1:]),
              "machine": describe_machine(),
              "torch_threads": args.threads or "torch's default (every core)",
              "commits": commits, "spec": spec, "rounds": args.rounds,
              "best_fwd_bwd_tok_s": best, "after_over_before": ratios,
              "after_over_before_per_round": paired, "after_over_before_median_of_rounds": medians, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1))
    for seq in lengths:
        print(f"seq {seq}: best of the rounds before {best['before'][seq]:.0f}, after {best['after'][seq]:.0f} tok/s "
              f"fwd+bwd, after / before {ratios[seq]:.3f}; median of the rounds' ratios {medians[seq]:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
