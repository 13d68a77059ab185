"""What writing whole tensors costs: this checkout's builds against another checkout's, one run.

Since the drop-in fix, ``flexmask.create_block_mask`` writes every index tensor whole — the
unlisted tail in torch's order, which ``BlockMask._adjust`` reads — and returns contiguous
``(B, H, ...)`` tensors with a storage each. Before, the closed form filled the tail with one
value and masks that ignore the row were expanded views. This benchmark times the same builds
in both checkouts, alternating fresh processes, so both sides see the same machine:

    git worktree add /tmp/flexmask-before 6d62b95      # the release before the fix
    python benchmarks/bench_tails.py --baseline /tmp/flexmask-before

It also times the floor: allocating torch's eight tensors of that shape and writing every
entry once (``torch.empty`` + ``fill_``), the least any writer of whole tensors does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import fmt_time, machine, markdown_table, ratio, save_json

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, {bench!r})
import flexmask
from common import documents
S, B, kind, repeat = {S}, {B}, {kind!r}, {repeat}
if kind == "causal":
    mask = flexmask.causal()
elif kind == "document-causal":
    docs = [documents(S, s) for s in range(B)] if B > 1 else documents(S, 0)
    mask = flexmask.causal() & flexmask.document(docs)
else:
    lengths = [S - 37 * (s + 1) for s in range(B)] if B > 1 else S - 37
    mask = flexmask.causal() & flexmask.padding(lengths)
flexmask.create_block_mask(mask, B, 1, S, S, device="cpu")
times = []
for _ in range(repeat):
    t0 = time.perf_counter()
    flexmask.create_block_mask(mask, B, 1, S, S, device="cpu")
    times.append(time.perf_counter() - t0)
n = -(-S // 128)
floor = []
for _ in range(repeat):
    t0 = time.perf_counter()
    for shape in ((B, 1, n), (B, 1, n, n)) * 4:
        torch.empty(shape, dtype=torch.int32).fill_(1)
    floor.append(time.perf_counter() - t0)
print(json.dumps({{"build": min(times), "floor": min(floor)}}))
"""


def measure(checkout: Path, S: int, B: int, kind: str, repeat: int) -> dict[str, float]:
    code = SNIPPET.format(bench=str(ROOT / "benchmarks"), S=S, B=B, kind=kind, repeat=repeat)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--masks", nargs="+", default=["causal", "document-causal", "padding"])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2, help="alternations per row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows, payload = [], {"machine": machine(), "cases": []}
    for B in args.batches:
        for S in args.sizes:
            if B * S > 8 * 32768:
                continue
            for kind in args.masks:
                now, before, floor = [], [], []
                for _ in range(args.rounds):  # alternate: both sides see the same load
                    a = measure(ROOT, S, B, kind, args.repeat)
                    b = measure(args.baseline, S, B, kind, args.repeat)
                    now.append(a["build"])
                    before.append(b["build"])
                    floor.append(a["floor"])
                case = {"mask": kind, "B": B, "S": S}
                case.update(whole=min(now), before=min(before), floor=min(floor))
                payload["cases"].append(case)
                rows.append(
                    [
                        kind,
                        B,
                        f"{S:,}",
                        fmt_time(case["before"]),
                        fmt_time(case["whole"]),
                        ratio(case["whole"], case["before"]),
                        fmt_time(case["floor"]),
                        ratio(case["whole"], case["floor"]),
                    ]
                )
                print(rows[-1], flush=True)
    header = ["mask", "B", "S", "before", "whole tensors", "whole / before", "floor", "/ floor"]
    print(f"\n{payload['machine']}; load average {os.getloadavg()[0]:.1f} at the end\n")
    print(markdown_table(header, rows))
    save_json(args.json, payload)


if __name__ == "__main__":
    main()
