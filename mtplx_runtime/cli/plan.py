"""`mtplx plan --model DIR [--memory-budget 8GiB]`: print the memory plan and what its minimum is
made of (largest part first, with the flag that lowers each), or refuse (exit 2) when the budget
cannot hold the minimum working set. Without a budget: MemAvailable; without --kernels: the
backend `generate` would pick, as `generate` plans a streaming artifact. Plans only; reads the
manifest and config."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..engine.presets import add_config_arg
from .common import add_dtype, add_resident_dtype
from .model_dir import add_model_dir


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_dir(parser, "streaming artifact (expert-manifest.json) or plain checkpoint",
                  path=True)
    parser.add_argument("--memory-budget", default=None, metavar="SIZE",
                        help="bytes the process may use, e.g. 8GiB, 512MiB, 1.5GB (default: the "
                             "memory the OS reports available, MemAvailable, as generate uses)")
    parser.add_argument("--host-budget", default="0", metavar="SIZE",
                        help="host RAM for a host-tier expert cache (default 0)")
    parser.add_argument("--context", type=int, default=4096, metavar="N",
                        help="tokens the MLA cache holds (default 4096)")
    add_dtype(parser)
    add_resident_dtype(parser)
    parser.add_argument("--batch", type=int, default=1, metavar="N", help="sequences (default 1)")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="tokens per prefill step (default: the largest that fits)")
    parser.add_argument("--kernels", default=None, choices=("auto", "reference", "cpu", "cuda"),
                        help="expert kernels to plan for: the reference kernels decode experts, "
                             "the packed-byte ones do not (default: $MTPLX_KERNELS, else what "
                             "generate picks here)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_config_arg(parser)


def main(args: argparse.Namespace) -> int:
    from ..engine.plan import PlanError, format_plan, make_plan, mem_available_bytes
    from ..kernels import ENV, name_of, select_backend

    # A named backend is planned for as is (a GPU plan on a machine without one); auto is what
    # generate would load here.
    kernels = args.kernels or os.environ.get(ENV) or "auto"
    try:
        if kernels == "auto":
            kernels = name_of(select_backend("auto"))
        budget = args.memory_budget or mem_available_bytes()
        plan = make_plan(args.model, memory_budget=budget,
                         host_budget=args.host_budget, context=args.context, dtype=args.dtype,
                         resident_dtype=args.resident_dtype, batch=args.batch,
                         prefill_chunk=args.prefill_chunk, kernels=kernels)
    except PlanError as e:
        print(f"mtplx plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
