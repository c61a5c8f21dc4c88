"""The report of ``funcopt bench zero`` (rank 0; see :mod:`funcopt.bench.zero`)."""
from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List

from ._report import ratio_row
from ._zero_parts import fmt_bytes, MiB

def report(args, world, n_params, n_tensors, peers, everyone, diffs, breakdown, floors, copy_s) -> List[Dict[str, Any]]:
    """Print the tables; the summary rows (ratios per timed step, with their spread)."""
    res: Dict[str, Any] = {}
    for peer in peers:
        k = peer.key
        fb = [max(everyone[r][k]["fb"][i] for r in range(world)) for i in range(args.iters)]
        st = [max(everyone[r][k]["st"][i] for r in range(world)) for i in range(args.iters)]
        tot = [max(everyone[r][k]["fb"][i] + everyone[r][k]["st"][i] for r in range(world)) for i in range(args.iters)]
        res[k] = dict(name=peer.name, fb=statistics.median(fb), st=statistics.median(st), total=statistics.median(tot),
                      st_list=st, total_list=tot,
                      st_min=min(st), st_max=max(st),
                      state=[everyone[r][k]["state"] for r in range(world)],
                      grad=[everyone[r][k]["grad"] for r in range(world)],
                      grad_pending=[everyone[r][k]["grad_pending"] for r in range(world)],
                      grad_peak=[everyone[r][k]["grad_peak"] for r in range(world)])
    ref = res.get("ddp_adam")
    tz = res.get("torch_zero")
    print()
    print(f"## Time per training step (ms; median over {args.iters} steps of the slowest rank)")
    print()
    hdr = "| peer | fwd+bwd | step+sync | step+sync min..max | total | step+sync / DDP+Adam | step+sync / torch ZeRO | total / DDP+Adam |"
    print(hdr)
    print("|" + "|".join(["---"] + ["--:"] * 7) + "|")
    for k, r in res.items():
        vs_ref = f"{r['st'] / ref['st']:.2f}x" if ref else "-"
        vs_tz = f"{r['st'] / tz['st']:.2f}x" if tz else "-"
        tot_ref = f"{r['total'] / ref['total']:.2f}x" if ref else "-"
        print(f"| {r['name']} | {r['fb'] * 1e3:.1f} | {r['st'] * 1e3:.1f} | {r['st_min'] * 1e3:.1f}..{r['st_max'] * 1e3:.1f} "
              f"| {r['total'] * 1e3:.1f} | {vs_ref} | {vs_tz} | {tot_ref} |")

    p_bytes = n_params * 4
    state_full = ref["state"][0] if ref else 2 * p_bytes + 4 * n_tensors
    grad_full = ref["grad"][0] if ref else p_bytes
    print()
    print(f"## Memory per rank (parameters: {fmt_bytes(p_bytes)}; unsharded Adam state {fmt_bytes(state_full)}, "
          f"1/W = {fmt_bytes(state_full / world)}; unsharded gradients {fmt_bytes(grad_full)}, 1/W = {fmt_bytes(grad_full / world)})")
    print()
    print("| peer | optimizer state per rank | state / unsharded | gradients held after backward | grads / unsharded "
          "| + pending reduce-scatter bucket | (grads + bucket) / unsharded | peak (grads + bucket) during backward |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for k, r in res.items():
        st = " / ".join(fmt_bytes(b) for b in r["state"])
        gr = " / ".join(fmt_bytes(b) for b in r["grad"])
        pend = " / ".join(fmt_bytes(b) for b in r["grad_pending"])
        both = max(g + b for g, b in zip(r["grad"], r["grad_pending"]))
        pk = " / ".join(fmt_bytes(b) for b in r["grad_peak"])
        print(f"| {r['name']} | {st} | {max(r['state']) / state_full:.3f} | {gr} | {max(r['grad']) / grad_full:.3f} "
              f"| {pend} | {both / grad_full:.3f} | {pk} |")
    print()
    print("(per-rank figures are rank 0 / rank 1 / ...; the ratio uses the largest rank; gradients: sum of p.grad, "
          "for funcopt ZeRO-2 opt.grad_shard_bytes(); the pending bucket is funcopt ZeRO-2's ReduceScatterBucketer "
          "buffer: the part filled with gradients still unreduced after backward, until step() flushes it; "
          "grad_shard_bytes() leaves it out; the buffer is allocated at the full bucket size)")
    if args.grad_as_bucket_view:
        print("(DDP gradient_as_bucket_view=True: p.grad are views into DDP's buckets)")
    else:
        print(f"(DDP peers also hold DDP's reducer buckets, another {fmt_bytes(p_bytes)} of gradient copies, "
              "not counted above: DDP's default gradient_as_bucket_view=False)")

    if diffs:
        print()
        print("## Agreement with DDP+Adam after the same steps (max |parameter difference|)")
        print()
        for k, v in diffs.items():
            if k != "ddp_adam":
                print(f"- {res[k]['name']}: {v:.1e}")

    if floors:
        print()
        print(f"## Floors on this machine (ms, median of 5): gloo collectives at this model's sizes; "
              f"one {fmt_bytes(p_bytes)} memcpy = {copy_s * 1e3:.1f} ms ({p_bytes / copy_s / 1e9:.1f} GB/s)")
        print()
        for k, (v, moved) in floors.items():
            print(f"- {k}: {v * 1e3:.1f} ms ({moved / v / 1e9:.2f} GB/s of result per rank)")

    if breakdown:
        print()
        print("## Where step() spends its time (rank 0, torch.profiler, ms per step: total incl. children / self)")
        for k, rows in breakdown.items():
            if k not in res:
                continue
            print()
            print(f"{res[k]['name']}:")
            top = [(n, v) for n, v in rows.items() if n.startswith(("funcopt::", "Optimizer.step", "gloo:"))]
            other = sorted(((n, v) for n, v in rows.items() if not n.startswith(("funcopt::", "Optimizer.step", "gloo:"))),
                           key=lambda nv: -nv[1][1])[:6]
            for n, (tot, slf, cnt) in sorted(top, key=lambda nv: -nv[1][0]) + other:
                print(f"    {n:<45} {tot:9.2f} {slf:9.2f}   x{cnt:g}")

    verdicts = []
    if ref:
        for k in ("f_flat", "f_greedy", "f_flat_bv"):
            if k in res:
                ratio = res[k]["st"] / ref["st"]
                verdicts.append(f"{res[k]['name']} step+sync <= 1.1x DDP+Adam(fused): {ratio:.2f}x -> "
                                f"{'MET' if ratio <= 1.1 else 'MISSED'}")
    if tz:
        for k in ("f_flat", "f_greedy", "f_flat_bv"):
            if k in res:
                ratio = res[k]["st"] / tz["st"]
                verdicts.append(f"{res[k]['name']} step+sync faster than torch ZeRO: {ratio:.2f}x -> "
                                f"{'MET' if ratio < 1.0 else 'MISSED'}")
    bucket = args.bucket_size_mb * MiB
    for k in ("f_flat", "f_greedy", "f_flat_bv", "f_z2", "f_z2_bv"):
        if k in res:
            worst = max(res[k]["state"])
            ok = worst <= state_full / world + bucket
            verdicts.append(f"{res[k]['name']} state per rank <= 1/W + one bucket: {fmt_bytes(worst)} vs "
                            f"{fmt_bytes(state_full / world)} + {fmt_bytes(bucket)} -> {'MET' if ok else 'MISSED'} "
                            f"(excess over 1/W: {fmt_bytes(worst - state_full / world)})")
    if "f_z2" in res:
        worst = max(res["f_z2"]["grad"])
        ratio = worst / grad_full
        both = max(g + b for g, b in zip(res["f_z2"]["grad"], res["f_z2"]["grad_pending"])) / grad_full
        verdicts.append(f"funcopt ZeRO-2 gradient bytes per rank about 1/W: grad_shard_bytes() {ratio:.3f} of unsharded "
                        f"(1/W = {1 / world:.3f}) -> {'MET' if ratio <= 1 / world * 1.02 + 1e-9 else 'MISSED'}; "
                        f"counting the pending bucket {both:.3f} -> {'MET' if both <= 1 / world * 1.02 + 1e-9 else 'MISSED'}; "
                        f"peak during backward {max(res['f_z2']['grad_peak']) / grad_full:.3f}")
    print()
    print(f"# load average at the end: {os.getloadavg()[0]:.1f}; peak RSS per process (all peers together): "
          + " / ".join(fmt_bytes(everyone[r]["_rss"]) for r in range(world)))
    print()
    print("## Targets")
    print()
    for v in verdicts:
        print(f"- {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), world=world, n_params=n_params, results=res, floors=floors,
                           memcpy_s=copy_s, diffs=diffs), f, indent=1)


    rows: List[Dict[str, Any]] = []
    for k in ("f_flat", "f_greedy", "f_flat_bv", "f_z2", "f_z2_bv"):
        if k in res and ref:
            rows.append(ratio_row("zero", f"W={world} {res[k]['name']}: step+sync / DDP+Adam(fused)",
                                  [a / b for a, b in zip(res[k]["st_list"], ref["st_list"])],
                                  1.1 if k in ("f_flat", "f_greedy", "f_flat_bv") else None, "lower"))
        if k in res and tz and k in ("f_flat", "f_greedy", "f_flat_bv"):
            rows.append(ratio_row("zero", f"W={world} {res[k]['name']}: step+sync / torch ZeRO",
                                  [a / b for a, b in zip(res[k]["st_list"], tz["st_list"])], 1.0, "lower"))
    return rows
