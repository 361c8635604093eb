"""The SASS lines with the most warp-stall samples in an Nsight Compute source page (CSV), with each line's
largest stall reasons: `ncu --import rep --page source --csv --print-source sass --kernel-name regex:K
> f.csv`, then `python3 tools/gpu/ncu_top.py f.csv [N]`. Column names are matched loosely (ncu versions
vary)."""

from __future__ import annotations

import csv
import sys


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def top(path: str, n: int = 30) -> list[str]:
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # the CSV rows (ncu prints ==PROF== lines too)
    head = next((i for i, ln in enumerate(lines) if '"Source"' in ln or '"Address"' in ln), 0)
    rows = list(csv.DictReader(lines[head:]))
    if not rows:
        return [f"{path}: no rows"]
    cols = [c for c in rows[0] if c is not None]
    total = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    src = next((c for c in cols if c.lower() == "source"), cols[1] if len(cols) > 1 else cols[0])
    reasons = [c for c in cols if c.lower().startswith("stall_") or c.startswith("smsp__pcsamp")]
    if total is None:
        return [f"{path}: no stall-sampling column in {cols[:12]}"]
    whole = sum(_num(r[total]) for r in rows) or 1.0
    out = [f"{path}: {len(rows)} SASS lines, {whole:.0f} stall samples"]
    for r in sorted(rows, key=lambda r: -_num(r[total]))[:n]:
        why = sorted(((_num(r[c]), c) for c in reasons), reverse=True)[:3]
        tag = ", ".join(f"{c.split('stall_')[-1]} {v:.0f}" for v, c in why if v > 0)
        out.append(f"{100 * _num(r[total]) / whole:5.1f} %  {r[src][:70]:70s} {tag}")
    return out


if __name__ == "__main__":
    print("\n".join(top(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)))
