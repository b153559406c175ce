"""At run time the process stays inside its memory budget, and the plan is close to what it
uses: a streamed generation over a K3-geometry slice (real 3584/3072 t158 experts), loaded
through `load` (the plan's own path, default prefill chunk) at a budget far below what the
decoded experts would take resident, peaks (VmHWM of a fresh interpreter) at or under the budget
and at no less than 3/4 of the planned peak."""

import json
import subprocess
import sys
import textwrap

import pytest

from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.engine.plan import make_plan
from mtplx_runtime.fixtures.k3_slice import k3_slice_config, make_k3_slice
from mtplx_runtime.kernels import cpu_native

# 64 experts: one token's records above the minimum leave the tier two windows short of the
# bank, so the plan still gives a prefill pool (a tier within a window of the bank has none).
EXPERTS, TOP_K = 64, 16
PROMPT = [3, 17, 42, 99]
MAX_TOKENS = 6
BF16 = 2

# Runs in a fresh interpreter and reads VmHWM, the peak of this process's own address space.
# (ru_maxrss would not do: Linux carries it across fork + exec, so the child would report the
# pytest process's RSS at fork time whenever that is larger.)
CHILD = textwrap.dedent("""
    import json, sys
    import mtplx_runtime
    from mtplx_runtime.engine.generate import generate_step

    art, budget, prompt, max_tokens = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), \\
        int(sys.argv[4])
    with mtplx_runtime.load(art, memory_budget=budget, context=256, kernels="cpu",
                            tokenizer=False) as rt:
        ids = list(generate_step(rt.model, prompt, max_tokens=max_tokens))
        st = rt.provider.stats()
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_bytes": int(hwm.split()[1]) * 1024, "ids": ids,
                      "misses": st["totals"]["compute"]["misses"],
                      "lookups": st["totals"]["compute"]["lookups"]}))
""")


@pytest.mark.slow
@pytest.mark.skipif(cpu_native.unavailable_reason() is not None,
                    reason=f"native cpu kernels: {cpu_native.unavailable_reason()}")
def test_streamed_run_stays_inside_budget(tmp_path):
    cfg = k3_slice_config(moe_layers=1, experts=EXPERTS, top_k=TOP_K)
    src, art = tmp_path / "src", tmp_path / "art"
    make_k3_slice(src, moe_layers=1, experts=EXPERTS, top_k=TOP_K)
    build_artifact(src, art, codec="keep", progress=False)
    kw = dict(dtype="bfloat16", context=256, prefill_chunk=64, kernels="cpu")  # load's defaults
    floor = make_plan(art, memory_budget="64GiB", **kw)
    # One token's worth of records above the minimum: the prefill pool, so the prompt's
    # windows and the decode slots are both in use.
    budget = floor.minimum_budget + TOP_K * floor.record_stride
    plan = make_plan(art, memory_budget=budget, **kw)
    assert plan.compute_slots == plan.transient_slots == TOP_K
    # Resident, the same experts decoded to bf16 alone take more than the whole budget.
    rows, cols = cfg.expert_shapes["gate"]
    resident_experts_bytes = EXPERTS * 3 * rows * cols * BF16
    assert resident_experts_bytes > budget

    out = subprocess.run([sys.executable, "-c", CHILD, str(art), str(budget), json.dumps(PROMPT),
                          str(MAX_TOKENS)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res["ids"]) == MAX_TOKENS
    assert 0 < res["misses"] <= res["lookups"]
    peak, planned = res["peak_rss_bytes"], plan.planned_peak_bytes
    print(f"peak_rss_bytes={peak} budget_bytes={budget} planned_peak_bytes={planned} "
          f"plan_minimum_bytes={plan.minimum_budget} compute_slots={plan.compute_slots} "
          f"resident_experts_bytes={resident_experts_bytes} misses={res['misses']} "
          f"lookups={res['lookups']}")
    assert peak <= budget, (
        f"peak RSS {peak:,} B exceeds the budget {budget:,} B "
        f"(plan minimum {plan.minimum_budget:,} B, {plan.compute_slots} slots)")
    # The plan's runtime baseline is measured (engine/plan.py), not a generous floor: a run far
    # below its planned peak means the plan refuses budgets that would run.
    assert peak >= 0.75 * planned, (
        f"peak RSS {peak:,} B is under 3/4 of the planned {planned:,} B: the plan overestimates")
