/* moe-cuda-elements.cuh: element types and activations, shared by the
 * experts kernels and the decoder's (and compiled just in time with the
 * deepgemm source)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#ifndef MOE_JIT
# include <cstdlib>
# include <cstring>
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

/* ---- tensor-core primitives (sm_80+): the grouped GEMMs' and flash
 * attention's ------------------------------------------------------------ */

/* 16 bytes global → shared without registers; zeros where !valid */
__device__ __forceinline__ void
cp_async16 (void *smem, const void *gmem, bool valid)
{
  unsigned s = (unsigned) __cvta_generic_to_shared (smem);
  int n = valid ? 16 : 0;
  asm volatile ("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(gmem), "r"(n));
}

__device__ __forceinline__ void
ldmatrix_x4 (unsigned r[4], const void *smem, bool trans)
{
  unsigned s = (unsigned) __cvta_generic_to_shared (smem);
  if (trans)
    asm volatile ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                  : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
  else
    asm volatile ("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                  : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

template <typename T>
__device__ __forceinline__ void
mma16816 (float c[4], const unsigned a[4], const unsigned b[2])
{
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                  "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                  : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                  "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                  : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* c += a·b over one m16n8k32 step of e4m3 values, float accumulation
 * (sm_89+; a no-op elsewhere, where callers never launch it) */
__device__ __forceinline__ void
mma_e4m3 (float c[4], const unsigned a[4], const unsigned b[2])
{
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile ("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

/* A hint: the 128-byte line at @p on its way into L2 (no register waits
 * for it) */
__device__ __forceinline__ void
prefetch_l2 (const void *p)
{
  asm volatile ("prefetch.global.L2 [%0];\n" :: "l"(p));
}

/* ---- programmatic dependent launch (sm_90+) ----------------------------
 *
 * A decode step is a chain of short kernels, each of which would otherwise
 * start only once the one before it has drained. A kernel started by
 * launch_overlapped () may begin while the one before it on the stream
 * still runs, so it calls pdl_begin () before it touches memory: that lets
 * the next kernel begin as soon as all of this one's blocks run, then waits
 * for the kernels before to finish. A no-op before sm_90 and in kernels
 * launched the plain way. */
__device__ __forceinline__ void
pdl_release ()
{
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile ("griddepcontrol.launch_dependents;\n");
#endif
}

__device__ __forceinline__ void
pdl_wait ()
{
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile ("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/* (a kernel whose first loads do not depend on the kernels before may
 * issue them between the two) */
__device__ __forceinline__ void
pdl_begin ()
{
  pdl_release ();
  pdl_wait ();
}

#ifndef MOE_JIT
/* The current device's compute capability as 10·major + minor (0 where it
 * cannot be read); read once. */
inline int
device_cc ()
{
  static int cc = -1;
  if (cc < 0)
    {
      int dev = 0, major = 0, minor = 0;
      if (cudaGetDevice (&dev) != cudaSuccess ||
          cudaDeviceGetAttribute (&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
          cudaDeviceGetAttribute (&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
        major = minor = 0;
      cc = 10 * major + minor;
    }
  return cc;
}

/* Whether the measuring switch @name is on: unless it is set to "0" */
inline bool
env_switch_on (const char *name)
{
  const char *env = getenv (name);
  return env == nullptr || strcmp (env, "0") != 0;
}

/* on a GPU of compute capability 9.0 or more, unless MOE_CUDA_PDL=0 */
inline bool
pdl_enabled ()
{
  static int on = -1;
  if (on < 0)
    on = device_cc () >= 90 && env_switch_on ("MOE_CUDA_PDL");
  return on;
}

/* Whether the current device is a Hopper (compute capability 9.0), which the
 * sm_90a code needs */
inline bool
device_is_sm90 ()
{
  return device_cc () == 90;
}

/* Whether the current device's tensor cores take e4m3 (compute capability
 * 8.9 or more) */
inline bool
device_has_fp8_mma ()
{
  return device_cc () >= 89;
}

/* The measuring switch MOE_CUDA_REPEAT=TEXT: whether @kernel's (mangled)
 * name holds TEXT, so that launch_overlapped_clusters () launches it twice
 * in a row — a decode step's time with and without tells what the kernel
 * costs where it stands in the graph, which Nsight Compute's kernels timed
 * alone (at whatever clock the idle GPU has) do not. The results are wrong
 * where the kernel adds into its output; the work is the same. */
inline bool
repeat_requested (const void *kernel)
{
  static const char *text = getenv ("MOE_CUDA_REPEAT");
  const char *name = nullptr;

  if (text == nullptr || *text == '\0')
    return false;
#if CUDART_VERSION >= 12030   /* cudaFuncGetName's first release */
  if (cudaFuncGetName (&name, kernel) != cudaSuccess || name == nullptr)
    {
      cudaGetLastError ();
      return false;
    }
  return strstr (name, text) != nullptr;
#else
  (void) kernel;
  (void) name;
  return false;
#endif
}

/* @kernel on @grid blocks in clusters of @cluster consecutive blocks
 * (sm_90+; 1: no clusters), overlapped as above */
template <typename... Params, typename... Args>
void
launch_overlapped_clusters (void (*kernel) (Params...), dim3 grid, dim3 block, unsigned cluster, size_t smem,
                            cudaStream_t s, Args... args)
{
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = {};

  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  if (pdl_enabled ())
    {
      attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
  if (cluster > 1)
    {
      attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
      attr[cfg.numAttrs++].val.clusterDim = { cluster, 1, 1 };
    }
  cudaLaunchKernelEx (&cfg, kernel, args...);
  if (repeat_requested ((const void *) kernel))
    cudaLaunchKernelEx (&cfg, kernel, args...);
}

template <typename... Params, typename... Args>
void
launch_overlapped (void (*kernel) (Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args... args)
{
  launch_overlapped_clusters (kernel, grid, block, 1, smem, s, args...);
}
#endif

} /* namespace */
