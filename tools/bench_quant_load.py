"""Peak memory of loading residents per `--resident-dtype`: quantized one tensor at a time.

    a fresh interpreter per dtype -> model.load.load_residents over a checkpoint stand-in whose
    tensor(name) hands out one random BF16 array at a time (bench_model's 2-layer K3 at real
    widths, 8.9 GB of residents in bf16) -> peak RSS (ru_maxrss) against what the model holds

A real checkpoint's tensor(name) is a view of the mapped file; the stand-in's array plays that
one tensor, so what the load adds beyond the interpreter is: the residents held so far, the
tensor being loaded, and the quantizer's temporaries (one row block of fp32). One line per
dtype: `held_gb` (the model's residents), `largest_bf16_gb` (the largest one tensor), `peak_gb`
(peak RSS less the interpreter's RSS before loading), and `over_gb` = peak - held - largest: the
transient beyond "the quantized total + one BF16 tensor" (FORMAT.md "Quantized residents").

    python tools/bench_quant_load.py [--resident-dtype bf16,int8,int4]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, math, resource, sys
import numpy as np
import torch
sys.path.insert(0, {tools!r})
from bench_model import K3_TWO_LAYERS
from mtplx_runtime.checkpoint import ModelConfig
from mtplx_runtime.checkpoint.residents import resident_tensor_specs
from mtplx_runtime.model.load import load_residents

class StandIn:
    path, resident_dtype = "stand-in", "bf16"  # a checkpoint of bf16 tensors

    def __init__(self, cfg):
        self.config, self.gen = cfg, torch.Generator().manual_seed(0)
        self.specs = resident_tensor_specs(cfg)
    def tensor(self, name):
        spec = self.specs[name]
        dtype = torch.bfloat16 if spec.dtype == "BF16" else torch.float32
        t = torch.empty(spec.shape, dtype=dtype).normal_(0.0, 0.02, generator=self.gen)
        return t.view(torch.int16).numpy() if spec.dtype == "BF16" else t.numpy()

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg = ModelConfig(**K3_TWO_LAYERS)
ckpt = StandIn(cfg)
largest = max(math.prod(s.shape) * (2 if s.dtype == "BF16" else 4) for s in ckpt.specs.values())
before = rss()
top, layers = load_residents(ckpt, torch.bfloat16, "cpu", {dtype!r})
held = sum(t.nbytes for t in top.values()) + sum(t.nbytes for w in layers for t in w.values())
print(json.dumps(dict(before=before, peak=rss(), held=held, largest=largest)))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--resident-dtype", default="bf16,int8,int4", help="comma list")
    a = p.parse_args(argv)
    tools = str(Path(__file__).resolve().parent)
    print(f"# bench_quant_load python={platform.python_version()} model=bench_model K3 2-layer",
          flush=True)
    for dtype in a.resident_dtype.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD.format(tools=tools, dtype=dtype)],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"bench_quant_load: {dtype}: {out.stderr.strip().splitlines()[-1]}",
                  file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        peak = r["peak"] - r["before"]
        print(f"resident_dtype={dtype} held_gb={r['held'] / 1e9:.2f} "
              f"largest_bf16_gb={r['largest'] / 1e9:.2f} peak_gb={peak / 1e9:.2f} "
              f"over_gb={(peak - r['held'] - r['largest']) / 1e9:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
