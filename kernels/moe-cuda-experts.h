/* moe-cuda-experts.h: the experts kernels of the CUDA device (C ABI)
 *
 * Everything here runs on one stream and never waits for the device,
 * except the per-expert schedule, which reads the routing on the host as
 * transformers' eager loop does.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The numbering of MoeDType and MoeCpuActivation. */
enum { MOE_CUDA_F32 = 0, MOE_CUDA_F16 = 1, MOE_CUDA_BF16 = 2, MOE_CUDA_E8M0 = 5 };
enum { MOE_CUDA_WEIGHTS_PLAIN, MOE_CUDA_WEIGHTS_FP8, MOE_CUDA_WEIGHTS_FP4 };
enum { MOE_CUDA_ACT_SILU, MOE_CUDA_ACT_GELU, MOE_CUDA_ACT_GELU_TANH, MOE_CUDA_ACT_RELU };
/* The numbering of MoeExpertsSchedule. */
enum { MOE_CUDA_PER_EXPERT, MOE_CUDA_PER_ROW, MOE_CUDA_GROUPED, MOE_CUDA_DEEPGEMM, MOE_CUDA_FUSED };

typedef struct {
  int dtype;            /* hidden states, weights, biases and output */
  int routing_dtype;    /* top_k_weights */
  int num_experts, hidden, inter, tokens, top_k;
  int has_gate, interleaved, transposed, activation;
  float alpha, limit;
  const void *up, *down;              /* [E, 2I, H] and [E, H, I], or transposed */
  const void *up_bias, *down_bias;    /* [E, 2I] and [E, H], or NULL */
  const void *x;                      /* [T, H] */
  const int64_t *ids;                 /* [T, K] on the device; ids outside [0, E] are
                                         skipped and reported through bad_id */
  const void *routing;                /* [T, K] */
  void *out;                          /* [T, H] */
  long long *bad_id;                  /* mapped host memory: {t * K + k + 1, id} of a bad id */
  /* quantized weights (see MoeExperts): FP8 e4m3 with per-128×128-block
   * scales, or FP4 e2m1 packed two per byte with per-32 UE8M0 scales; the
   * activations are then quantized dynamically as on the CPU */
  int weight_format;                  /* MOE_CUDA_WEIGHTS_* */
  int scale_dtype;                    /* MOE_CUDA_F32 or MOE_CUDA_E8M0 */
  int up_scale_rows, up_scale_split;  /* FP8: scale rows of up; I when gate and up were scaled apart */
  const void *up_scale, *down_scale;
  /* the deepgemm schedule: its GEMMs compiled just in time for these shapes
   * (cudaKernel_t; see moe_cuda_experts_jit_source) */
  const void *jit_gate_up, *jit_down;           /* cp.async + wgmma (8-byte aligned rows) */
  const void *jit_tma_gate_up, *jit_tma_down;   /* bulk tensor copies + wgmma, the wide tile */
  const void *jit_tall_gate_up, *jit_tall_down; /* the same, the tall tile (route picks one) */
  const void *jit_large_gate_up, *jit_large_down; /* the same, the wide tile for many rows an expert */
} MoeCudaExperts;

/* Bytes of scratch device memory a schedule needs. */
size_t      moe_cuda_experts_workspace_size (const MoeCudaExperts *e,
                                             int                   schedule);

/* Queues the experts on @stream. @host_ids (the ids, in host memory) is
 * used by the per-expert schedule only; @cublas is a cublasHandle_t bound
 * to @stream. Returns NULL, or a static message saying what failed. */
const char *moe_cuda_experts_run            (const MoeCudaExperts *e,
                                             int                   schedule,
                                             const int64_t        *host_ids,
                                             void                 *workspace,
                                             void                 *cublas,
                                             cudaStream_t          stream);

/* The dynamic activation scheme as the FP8 grouped GEMMs read it: each of
 * @rows rows of @K values (@dtype; K a multiple of 8, @in 16-byte and @q
 * 8-byte aligned) as e4m3 bytes of v / s in @q [rows, K], s = amax / 448
 * of its 128-wide group (1 for an all-zero group) in @scale [⌈K/128⌉,
 * rows]. Returns NULL, or what the rows lack. */
const char *moe_cuda_quantize_fp8           (int                   dtype,
                                             const void           *in,
                                             int                   rows,
                                             int                   K,
                                             unsigned char        *q,
                                             float                *scale,
                                             cudaStream_t          stream);

#ifdef __cplusplus
}
#endif
