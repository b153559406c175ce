"""At run time the process stays inside its memory budget: a streamed generation over a
K3-geometry slice (real 3584/3072 t158 experts), sized by `plan.make_plan` for a budget far below
what the decoded experts would take resident, peaks (ru_maxrss of a fresh interpreter) at or
under the budget."""

import json
import subprocess
import sys
import textwrap

import pytest

from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.engine.plan import make_plan
from mtplx_runtime.fixtures.k3_slice import k3_slice_config, make_k3_slice

EXPERTS, TOP_K = 48, 16
PROMPT = [3, 17, 42, 99]
MAX_TOKENS = 6
BF16 = 2

# Runs in a fresh interpreter and reads VmHWM, the peak of this process's own address space.
# (ru_maxrss would not do: Linux carries it across fork + exec, so the child would report the
# pytest process's RSS at fork time whenever that is larger.)
CHILD = textwrap.dedent("""
    import json, sys
    from mtplx_runtime.engine.generate import GenerationStats, generate_step
    from mtplx_runtime import load_model
    from mtplx_runtime.engine.plan import make_plan
    from mtplx_runtime.offload.provider import StreamingExpertProvider

    art, budget, prompt, max_tokens = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), \\
        int(sys.argv[4])
    plan = make_plan(art, memory_budget=budget, dtype="bfloat16", context=256, prefill_chunk=1)
    model = load_model(art, dtype="bfloat16")
    provider = StreamingExpertProvider(
        art, model.cfg, model.dtype, compute_bytes=plan.compute_slots * plan.record_stride,
        host_bytes=plan.host_slots * plan.record_stride, lookahead=1)
    model.use_provider(provider)
    stats = GenerationStats()
    ids = list(generate_step(model, prompt, max_tokens=max_tokens,
                             prefill_chunk=plan.prefill_chunk, stats=stats))
    st = provider.stats()
    provider.close()
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_bytes": int(hwm.split()[1]) * 1024,
                      "ids": ids, "compute_slots": plan.compute_slots,
                      "misses": st["totals"]["compute"]["misses"],
                      "lookups": st["totals"]["compute"]["lookups"]}))
""")


@pytest.mark.slow
def test_streamed_run_stays_inside_budget(tmp_path):
    cfg = k3_slice_config(moe_layers=1, experts=EXPERTS, top_k=TOP_K)
    src, art = tmp_path / "src", tmp_path / "art"
    make_k3_slice(src, moe_layers=1, experts=EXPERTS, top_k=TOP_K)
    build_artifact(src, art, codec="keep", progress=False)
    floor = make_plan(art, memory_budget="64GiB", dtype="bfloat16", context=256,
                      prefill_chunk=1)
    # A cache of one token's worth of records above the minimum: a third of the bank.
    budget = floor.minimum_budget + TOP_K * floor.record_stride
    plan = make_plan(art, memory_budget=budget, dtype="bfloat16", context=256, prefill_chunk=1)
    assert TOP_K <= plan.compute_slots < EXPERTS
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
    print(f"peak_rss_bytes={res['peak_rss_bytes']} budget_bytes={budget} "
          f"plan_minimum_bytes={plan.minimum_budget} compute_slots={plan.compute_slots} "
          f"resident_experts_bytes={resident_experts_bytes} misses={res['misses']} "
          f"lookups={res['lookups']}")
    assert res["peak_rss_bytes"] <= budget, (
        f"peak RSS {res['peak_rss_bytes']:,} B exceeds the budget {budget:,} B "
        f"(plan minimum {plan.minimum_budget:,} B, {plan.compute_slots} slots)")
