"""Post hoc, not registered: the registered draws of runs 23, 25 and 26 judged against
one set of bounds (each idle figure the median over the draws' probes, the same factors)
instead of each draw's own probe. Run from the repository root:
PYTHONPATH=. python benchmarks/multiturn/results/20261205T083725Z-load-l2-registered-seed49/fixed_bounds.py
"""
import statistics
from pathlib import Path

from benchmarks.multiturn import goodput, pool

ROOT = Path("benchmarks/multiturn/results")
reports = [(f.name, pool.read_report(f)) for f in sorted(ROOT.glob("20261205T0*-load-l2-registered-seed*"))]
slos = [r.slo for _, r in reports if r.slo is not None]
fixed = {k: statistics.median(getattr(s, k) for s in slos)
         for k in ("idle_ttft_first_p90_s", "idle_ttft_later_p90_s", "idle_decode_step_s")}
print("median idle figures:", {k: round(v, 4) for k, v in fixed.items()})
draws = []
for name, rep in reports:
    assert rep.slo is not None
    slo = rep.slo.model_copy(update=fixed)
    turns, limit = int(rep.load["turns"]), float(rep.load["max_error_rate"])
    configs = [c.model_copy(update={"levels": [
        goodput.rescore_level(lv, slo, turns=turns, max_error_rate=limit) for lv in c.levels]})
        for c in rep.configs]
    draws.append(pool.draw_of(rep.model_copy(update={"configs": configs}), name))
print(pool.markdown(pool.pool(draws)), end="")
