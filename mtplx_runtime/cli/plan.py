"""`mtplx plan DIR [--memory-budget 8GiB]`: size a machine for a model, from its config.json
alone if need be (no shard needs to be downloaded): the memory plan and what its minimum is made
of (largest part first, with the flag that lowers each), the artifact's bytes on NVMe, and an
estimated decode rate with its inputs; or refuse (exit 2) when the budget cannot hold the
minimum working set. Without a budget: MemAvailable; without --kernels: the backend `generate`
would pick here (found without loading it); without --context: the longest the plan affords,
as generate and serve pick it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import asdict

from ..engine.options import KERNELS, LoadOptions, OptionError
from ..engine.presets import add_config_arg
from .common import add_dtype, add_resident_dtype, flag_of
from .model_dir import add_model_dir

PROG = "mtplx plan"
EXAMPLES = """\
examples:
  mtplx plan ~/models/Kimi-K3                      the plan for this machine (MemAvailable)
  mtplx plan ./k3-config --memory-budget 256GiB    config.json (+ its index) alone: size a
                                                   machine before downloading the model
  mtplx plan ./k3-config --memory-budget 128GiB --host-budget 64GiB --kernels cuda
  mtplx plan ./k3-config --bank-codec t158 --resident-dtype int4 --measure-disk /mnt/nvme
  mtplx plan --config k3-t158-h200 ./k3-artifact   a shipped preset's budget and context
"""


def add_args(parser: argparse.ArgumentParser) -> None:
    from ..profile.estimate import DEFAULT_DISK_GBPS

    parser.epilog = EXAMPLES
    add_model_dir(parser, "streaming artifact, checkpoint, or a directory with a checkpoint's "
                          "config.json (and its model.safetensors.index.json when the config "
                          "has no quantization_config)", path=True)
    parser.add_argument("--memory-budget", default=None, metavar="SIZE",
                        help="bytes the process may use, e.g. 8GiB, 512MiB, 1.5GB (default: the "
                             "memory the OS reports available, MemAvailable, as generate uses)")
    parser.add_argument("--host-budget", default="0", metavar="SIZE",
                        help="host RAM for a host-tier expert cache")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="tokens the MLA cache holds (default: the longest the plan affords, "
                             "4,096 to 32,768, as generate and serve pick it)")
    add_dtype(parser)
    add_resident_dtype(parser)
    parser.add_argument("--batch", type=int, default=1, metavar="N", help="sequences")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="tokens per prefill step (default: the largest that fits)")
    parser.add_argument("--kernels", default=None, choices=KERNELS,
                        help="expert kernels to plan for: the reference kernels decode experts, "
                             "the packed-byte ones do not (default: $MTPLX_KERNELS, else what "
                             "generate picks here)")
    parser.add_argument("--bank-codec", choices=("keep", "t158"), default="keep",
                        help="a checkpoint's bank as build-manifest would write it: its own "
                             "codec, or re-encoded to t158")
    parser.add_argument("--disk-gbps", type=float, default=None, metavar="G",
                        help="the drive's random-read rate for the decode estimate (default: "
                             f"{DEFAULT_DISK_GBPS:g} GB/s, a PCIe 4.0 NVMe drive's rated read)")
    parser.add_argument("--measure-disk", default=None, metavar="DIR",
                        help="measure the drive's rate instead: write a 256 MiB scratch file in "
                             "DIR (on that drive), read it back in random records, delete it")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_config_arg(parser)


def planned_backend() -> str:
    """The backend `auto` would load here, found without loading it: cuda when cupy is
    installed and sees a GPU, else cpu when a C compiler can build the native kernels (no
    compile now), else reference."""
    from ..kernels import cpu_build

    if importlib.util.find_spec("cupy") is not None:
        from ..kernels import cuda

        if cuda.unavailable_reason() is None:
            return "cuda"
    try:
        cpu_build.compiler()
    except cpu_build.BuildError:
        return "reference"
    return "cpu"


def _disk_rate(args, record_bytes: int) -> tuple[float, str]:
    """(GB/s, where it comes from) for the estimate."""
    from ..profile.estimate import DEFAULT_DISK_GBPS, measure_disk

    if args.measure_disk is None:
        if args.disk_gbps is None:
            return DEFAULT_DISK_GBPS, ("default: a PCIe 4.0 NVMe drive's rated read; "
                                       "--measure-disk DIR measures yours")
        return args.disk_gbps, "--disk-gbps"
    print(f"{PROG}: measuring the drive under {args.measure_disk}: random reads of "
          f"{record_bytes:,}-B records from a 256 MiB scratch file...", file=sys.stderr,
          flush=True)
    nbytes, secs = measure_disk(args.measure_disk, record_bytes)
    return nbytes / secs / 1e9, (f"measured under {args.measure_disk}: {nbytes:,} B in "
                                 f"{secs:.2f} s, 16 reads in flight")


def main(args: argparse.Namespace) -> int:
    from ..engine.plan import (
        PlanError,
        afforded_context,
        artifact_size,
        facts_from_dir,
        format_artifact_size,
        format_plan,
        mem_available_bytes,
        plan_for,
    )
    from ..formats.modes import cuda_gap
    from ..kernels import ENV
    from ..profile.estimate import estimate_decode, format_estimate

    if args.disk_gbps is not None and not 0 < args.disk_gbps < float("inf"):
        print(f"{PROG}: error: --disk-gbps must be a rate > 0, got {args.disk_gbps}",
              file=sys.stderr)
        return 2
    if args.measure_disk is not None and args.disk_gbps is not None:
        print(f"{PROG}: error: give --disk-gbps or --measure-disk, not both", file=sys.stderr)
        return 2
    try:  # the flags load() shares, checked as load() checks them
        LoadOptions(dtype=args.dtype, resident_dtype=args.resident_dtype,
                    memory_budget=args.memory_budget, host_budget=args.host_budget,
                    context=args.context, kernels=args.kernels,
                    **({} if args.prefill_chunk is None else
                       {"prefill_chunk": args.prefill_chunk}))
    except OptionError as e:
        print(f"{PROG}: error: {e.named(flag_of)}", file=sys.stderr)
        return 2
    # A named backend is planned for as is (a GPU plan on a machine without one); auto is what
    # generate would load here.
    kernels = args.kernels or os.environ.get(ENV) or "auto"
    try:
        if kernels == "auto":
            kernels = planned_backend()
        facts = facts_from_dir(args.model, bank_codec=args.bank_codec)
        budget = args.memory_budget or mem_available_bytes()
        kw = dict(host_budget=args.host_budget, dtype=args.dtype,
                  resident_dtype=args.resident_dtype, batch=args.batch,
                  prefill_chunk=args.prefill_chunk, kernels=kernels)
        context = args.context or afforded_context(facts, memory_budget=budget, **kw)
        plan = plan_for(facts, memory_budget=budget, context=context, **kw)
        size = artifact_size(facts, plan.resident_dtype)
        gbps, disk_source = _disk_rate(args, facts.record_bytes)
        est = estimate_decode(plan, facts, gbps, disk_source)
    except (PlanError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        d = plan.to_dict()
        d.update(artifact={**asdict(size), "total_bytes": size.total_bytes},
                 estimate=est.to_dict())
        print(json.dumps(d, indent=2))
        return 0
    if args.context is None:
        print(f"context {context:,} tokens: the longest this plan affords while keeping its "
              "expert cache, as generate and serve pick it (--context sets it)")
    print(format_plan(plan))
    print(format_artifact_size(size))
    print(format_estimate(est))
    gap = cuda_gap(facts.mode, facts.bits, facts.group_size) if kernels == "cuda" else None
    if gap is not None:  # load refuses the bank on these kernels: the plan says so
        print(f"note: loading this bank with the cuda kernels is refused today: {gap}")
    return 0
