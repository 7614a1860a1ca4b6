/* moe-cuda-elements.cuh: element types and activations, shared by the
 * experts kernels and the decoder's (and compiled just in time with the
 * deepgemm source)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef MOE_JIT
# include "moe-cuda-experts.h"   /* MOE_CUDA_* */
#endif

namespace {

/* ---- element types ---------------------------------------------------- */

__device__ __forceinline__ float to_f (float v) { return v; }
__device__ __forceinline__ float to_f (__nv_bfloat16 v) { return __bfloat162float (v); }
__device__ __forceinline__ float to_f (__half v) { return __half2float (v); }

template <typename T> __device__ __forceinline__ T from_f (float v);
template <> __device__ __forceinline__ float from_f<float> (float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16> (float v) { return __float2bfloat16_rn (v); }
template <> __device__ __forceinline__ __half from_f<__half> (float v) { return __float2half_rn (v); }

template <typename T> __device__ __forceinline__ float rnd (float v) { return to_f (from_f<T> (v)); }

__device__ __forceinline__ float
load_any (const void *p, int dtype, size_t i)
{
  switch (dtype)
    {
    case MOE_CUDA_BF16: return __bfloat162float (((const __nv_bfloat16 *) p)[i]);
    case MOE_CUDA_F16: return __half2float (((const __half *) p)[i]);
    default: return ((const float *) p)[i];
    }
}

__device__ __forceinline__ float
activate (int act, float v)
{
  switch (act)
    {
    case MOE_CUDA_ACT_SILU: return v / (1.0f + expf (-v));
    case MOE_CUDA_ACT_GELU: return 0.5f * v * (1.0f + erff (v * 0.70710678118654752f));
    case MOE_CUDA_ACT_GELU_TANH:
      return 0.5f * v * (1.0f + tanhf (0.7978845608028654f * (v + 0.044715f * v * v * v)));
    default: return v > 0.0f ? v : 0.0f;
    }
}

} /* namespace */
