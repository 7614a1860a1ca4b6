/* moe-cuda-flash-attention.cu: attention of many queries (prefill) for bf16
 * and f16 models as one kernel, FlashAttention-2's scheme: a block per
 * (sequence, head, 64 queries) walks the keys in tiles of 64 through shared
 * memory; the scores, the online softmax and the output stay in registers
 * and both products run on the tensor cores (mma.sync m16n8k16, float32
 * accumulation). No score matrix ever reaches memory.
 *
 * Numerics as torch's flash/efficient SDPA kernels: scores and softmax in
 * float32, the unnormalised probabilities rounded to the model dtype for the
 * product with the values, the output divided by the row sum and rounded
 * once. (Eager attention, which rounds the scores and the normalised
 * probabilities, and float32 models take the GEMM path instead.)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "moe-cuda-decoder.h"
#include "moe-cuda-elements.cuh"

#include <cfloat>

namespace {

constexpr int BQ = 64;     /* queries a block: 16 per warp */
constexpr int BK = 64;     /* keys a tile */
constexpr float LOG2E = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ unsigned
pack2 (float lo, float hi)
{
  T l = from_f<T> (lo), h = from_f<T> (hi);
  unsigned short ul, uh;
  memcpy (&ul, &l, 2);
  memcpy (&uh, &h, 2);
  return ul | (unsigned) uh << 16;
}

/* Elements d, d+1 of query t's head vector as one mma operand register
 * (zero past the query rows and the head's dims: padding to the tile). */
template <typename T>
__device__ __forceinline__ unsigned
query_pair (const MoeCudaAttention &a, int b, int h, int t, int d)
{
  if (t >= a.n_tokens)
    return 0;
  const T *q = (const T *) a.q + (size_t) (b * a.n_tokens + t) * a.q_row_stride + (size_t) h * a.dk;
  return pack2<T> (d < a.dk ? to_f (q[d]) : 0.0f, d + 1 < a.dk ? to_f (q[d + 1]) : 0.0f);
}

/* Rows j0…j0+BK-1 of a head's keys or values (rows of @d at @src) into
 * shared memory rows of D + 8 (the pad keeps ldmatrix and the fragment
 * loads free of bank conflicts), zero past @n rows and @d columns. */
template <typename T, int D>
__device__ __forceinline__ void
load_tile (T *dst, const T *src, int j0, int n, int d)
{
  constexpr int S = D + 8, C = D / 8;   /* 16-byte chunks a row */
  bool vec = d % 8 == 0 && (uintptr_t) src % 16 == 0;

  for (int i = threadIdx.x; i < BK * C; i += blockDim.x)
    {
      int r = i / C, c = i % C;
      uint4 v = make_uint4 (0, 0, 0, 0);
      if (r < n)
        {
          const T *row = src + (size_t) (j0 + r) * d + c * 8;
          if (vec)
            {
              if (c * 8 < d)
                v = __ldg ((const uint4 *) row);
            }
          else
            {
              T e[8];
#pragma unroll
              for (int q = 0; q < 8; q++)
                e[q] = c * 8 + q < d ? row[q] : from_f<T> (0.0f);
              memcpy (&v, e, sizeof v);
            }
        }
      *(uint4 *) (dst + r * S + c * 8) = v;
    }
}

template <typename T, int DK, int DV>
__global__ void __launch_bounds__ (128)
flash_attention_kernel (MoeCudaAttention a)
{
  constexpr int SK = DK + 8, SV = DV + 8;
  __shared__ __align__ (16) T ks[BK * SK];
  __shared__ __align__ (16) T vs[BK * SV];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int b = blockIdx.z, h = blockIdx.y;
  const int t0 = (gridDim.x - 1 - blockIdx.x) * BQ;   /* the longest rows start first */
  const int past = a.past_dev != nullptr ? *a.past_dev : a.past;
  const size_t valid_stride = a.key_valid_stride > 0 ? a.key_valid_stride : past + a.n_tokens;
  const uint8_t *valid = a.key_valid != nullptr ? a.key_valid + b * valid_stride : nullptr;
  const int kvh = h / (a.heads / a.kv_heads);
  const T *K = (const T *) a.k_cache + (size_t) (b * a.kv_heads + kvh) * a.capacity * a.dk;
  const T *V = (const T *) a.v_cache + (size_t) (b * a.kv_heads + kvh) * a.capacity * a.dv;
  const float scale = a.scaling * LOG2E;   /* scores in log2 units: exp2 below */
  /* the two query rows (tokens of this step) whose fragments this thread holds */
  const int row[2] = { t0 + warp * 16 + g, t0 + warp * 16 + g + 8 };
  /* keys after the block's last query are masked for all of its rows */
  const int kend = past + min (t0 + BQ, a.n_tokens);
  const int kbeg = a.window > 0 ? max (0, past + t0 - a.window + 1) / BK * BK : 0;

  unsigned qf[DK / 16][4];
#pragma unroll
  for (int kk = 0; kk < DK / 16; kk++)
    {
      qf[kk][0] = query_pair<T> (a, b, h, row[0], kk * 16 + 2 * c);
      qf[kk][1] = query_pair<T> (a, b, h, row[1], kk * 16 + 2 * c);
      qf[kk][2] = query_pair<T> (a, b, h, row[0], kk * 16 + 8 + 2 * c);
      qf[kk][3] = query_pair<T> (a, b, h, row[1], kk * 16 + 8 + 2 * c);
    }

  float o[DV / 8][4] = {};
  float m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };

  for (int j0 = kbeg; j0 < kend; j0 += BK)
    {
      __syncthreads ();
      load_tile<T, DK> (ks, K, j0, min (BK, kend - j0), a.dk);
      load_tile<T, DV> (vs, V, j0, min (BK, kend - j0), a.dv);
      __syncthreads ();

      /* s = q · kᵀ for this warp's 16 queries × the tile's 64 keys */
      float s[BK / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < DK / 16; kk++)
#pragma unroll
        for (int n = 0; n < BK / 8; n++)
          {
            const T *kr = ks + (n * 8 + g) * SK + kk * 16 + 2 * c;
            unsigned kb[2] = { *(const unsigned *) kr, *(const unsigned *) (kr + 8) };
            mma16816<T> (s[n], qf[kk], kb);
          }

      /* mask, scale, and the running row maxima (a row's 4 threads agree) */
      float mx[2] = { m[0], m[1] };
#pragma unroll
      for (int n = 0; n < BK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          {
            int j = j0 + n * 8 + 2 * c + (e & 1), qpos = past + row[e >> 1];
            bool ok = j < kend && j <= qpos && (valid == nullptr || valid[j]) &&
                      (a.window == 0 || qpos - j < a.window);
            s[n][e] = ok ? s[n][e] * scale : -INFINITY;
            mx[e >> 1] = fmaxf (mx[e >> 1], s[n][e]);
          }
      float base[2], alpha[2], sum[2] = { 0.0f, 0.0f };
#pragma unroll
      for (int r = 0; r < 2; r++)
        {
          mx[r] = fmaxf (mx[r], __shfl_xor_sync (0xffffffffu, mx[r], 1));
          mx[r] = fmaxf (mx[r], __shfl_xor_sync (0xffffffffu, mx[r], 2));
          base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];   /* all masked so far: nothing to rescale */
          alpha[r] = exp2f (m[r] - base[r]);
          m[r] = mx[r];
        }
#pragma unroll
      for (int n = 0; n < BK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          {
            s[n][e] = exp2f (s[n][e] - base[e >> 1]);
            sum[e >> 1] += s[n][e];
          }
#pragma unroll
      for (int r = 0; r < 2; r++)
        l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
      for (int n = 0; n < DV / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          o[n][e] *= alpha[e >> 1];

      /* o += p · v: the score fragments of two key octets are the A operand */
#pragma unroll
      for (int kk = 0; kk < BK / 16; kk++)
        {
          unsigned pa[4] = {
            pack2<T> (s[2 * kk][0], s[2 * kk][1]), pack2<T> (s[2 * kk][2], s[2 * kk][3]),
            pack2<T> (s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T> (s[2 * kk + 1][2], s[2 * kk + 1][3]),
          };
#pragma unroll
          for (int np = 0; np < DV / 16; np++)
            {
              unsigned vb[4];
              ldmatrix_x4 (vb, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SV + np * 16 + (lane >> 4) * 8,
                           true);
              mma16816<T> (o[2 * np], pa, vb);
              mma16816<T> (o[2 * np + 1], pa, vb + 2);
            }
        }
    }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; r++)
    {
      l[r] += __shfl_xor_sync (0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync (0xffffffffu, l[r], 2);
      if (a.sinks != nullptr)
        {
          /* gpt-oss: one more logit per head in the denominator only */
          float sink = a.sinks[h] * LOG2E, top = fmaxf (m[r], sink), f = exp2f (m[r] - top);
          l[r] = l[r] * f + exp2f (sink - top);
#pragma unroll
          for (int n = 0; n < DV / 8; n++)
            {
              o[n][2 * r] *= f;
              o[n][2 * r + 1] *= f;
            }
        }
      inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;   /* a padded query with nothing to attend to: 0 */
    }
#pragma unroll
  for (int n = 0; n < DV / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      {
        int t = row[e >> 1], d = n * 8 + 2 * c + (e & 1);
        if (t < a.n_tokens && d < a.dv)
          ((T *) a.out)[((size_t) (b * a.n_tokens + t) * a.heads + h) * a.dv + d] = from_f<T> (o[n][e] * inv[e >> 1]);
      }
}

template <typename T, int DK, int DV>
void
launch (const MoeCudaAttention *a, cudaStream_t s)
{
  dim3 grid ((a->n_tokens + BQ - 1) / BQ, a->heads, a->batch);
  flash_attention_kernel<T, DK, DV><<<grid, 128, 0, s>>> (*a);
}

template <typename T>
void
launch_dims (const MoeCudaAttention *a, cudaStream_t s)
{
  if (a->dk <= 32 && a->dv <= 32)
    launch<T, 32, 32> (a, s);
  else if (a->dk <= 64 && a->dv <= 64)
    launch<T, 64, 64> (a, s);
  else if (a->dk <= 128 && a->dv <= 128)
    launch<T, 128, 128> (a, s);
  else
    launch<T, 192, 128> (a, s);   /* DeepSeek-V3's MLA: 128 + 64 and 128 */
}

} /* namespace */

extern "C" int
moe_cuda_flash_attention_fits (const MoeCudaAttention *a)
{
  return (a->dtype == MOE_CUDA_BF16 || a->dtype == MOE_CUDA_F16) && !a->eager && a->dk <= 192 && a->dv <= 128;
}

extern "C" void
moe_cuda_flash_attention (const MoeCudaAttention *a, cudaStream_t s)
{
  if (a->dtype == MOE_CUDA_BF16)
    launch_dims<__nv_bfloat16> (a, s);
  else
    launch_dims<__half> (a, s);
}
