// mxfp4 routed-expert kernels (FORMAT.md "mxfp4"), on records as stored:
// mxfp4_{gate_up,down}_{bf16x1,bf16x4,f32} (experts.cuh, codecs.cuh MXFP4).
// Validate on a GPU: python tools/gpu_check.py; without one: tools/check_cuda.py and
// tests/test_cuda_host.py.
#include "experts.cuh"

MTPLX_EXPERT_KERNELS(mxfp4, MXFP4)
