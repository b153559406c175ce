// fp8-block routed-expert kernels (FORMAT.md "fp8-block": DeepSeek-V3/R1 e4m3 weights, one fp32
// scale per 128 x 128 block), on records as stored: fp8block_{gate_up,down}_{bf16x1,bf16x4,f32}
// (experts.cuh, codecs.cuh Fp8Block).
// Validate on a GPU: python tools/gpu_check.py; without one: tools/check_cuda.py and
// tests/test_cuda_host.py.
#include "experts.cuh"

MTPLX_EXPERT_KERNELS(fp8block, Fp8Block)
