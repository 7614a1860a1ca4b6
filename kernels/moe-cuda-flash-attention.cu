/* moe-cuda-flash-attention.cu: attention of many queries (prefill) for bf16
 * and f16 models as one kernel, FlashAttention-2's scheme: a block per
 * (sequence, head, 64 queries) walks the keys in tiles of 64 through shared
 * memory; the scores, the online softmax and the output stay in registers
 * and both products run on the tensor cores (mma.sync m16n8k16, float32
 * accumulation). No score matrix ever reaches memory.
 *
 * Numerics: scores and softmax in float32 as SDPA's; the probabilities
 * enter the product with the values as two terms of the model dtype (p =
 * hi + lo), about as exact as float32 — rounding them to bf16 once, as
 * GPU flash kernels do, moves OLMoE's fixture logits 3.4e-2 from
 * transformers' (CPU SDPA keeps them in float32); the output is divided by
 * the row sum and rounded once. Eager attention, which rounds the scores
 * and the normalised probabilities, and float32 models take the GEMM path.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "moe-cuda-decoder.h"
#include "moe-cuda-elements.cuh"

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

/* exp2 on the special function unit (as SDPA kernels built with fast
 * math): -inf gives 0 */
__device__ __forceinline__ float
exp2_fast (float x)
{
  float y;
  asm ("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Starts copying rows j0…j0+BK-1 of a head's keys or values (rows of @d at
 * @src) into shared memory rows of D + 8 (the pad keeps ldmatrix and the
 * fragment loads free of bank conflicts), zeros past @n rows and @d columns:
 * asynchronous 16-byte copies where rows allow them, else plain loads. */
template <typename T, int D>
__device__ __forceinline__ void
fetch_tile (T *dst, const T *src, int j0, int n, int d, bool async)
{
  constexpr int S = D + 8, C = D / 8;   /* 16-byte chunks a row */

#pragma unroll 4
  for (int i = threadIdx.x; i < BK * C; i += blockDim.x)
    {
      int r = i / C, c = i % C;
      const T *row = src + (size_t) (j0 + r) * d + c * 8;
      bool in = r < n && c * 8 < d;
      if (async)
        cp_async16 (dst + r * S + c * 8, in ? row : src, in);
      else
        {
          T e[8];
#pragma unroll
          for (int q = 0; q < 8; q++)
            e[q] = in && c * 8 + q < d ? row[q] : from_f<T> (0.0f);
          memcpy (dst + r * S + c * 8, e, sizeof e);
        }
    }
}

/* (Asking for three blocks an SM instead of two, which takes the 128-wide
 * heads' registers from 238 to 168 with a few spills, measured 178 µs
 * against 157 at 2048 tokens and 16 heads; issuing the value products two
 * dim octets a time, so that a hi and a lo product into one accumulator
 * stand four apart, measured no faster.) */
template <typename T, int DK, int DV>
__global__ void __launch_bounds__ (128)
flash_attention_kernel (MoeCudaAttention a)
{
  constexpr int SK = DK + 8, SV = DV + 8;
  extern __shared__ __align__ (16) unsigned char smem[];
  T *ks = (T *) smem, *vs = ks + 2 * BK * SK;   /* two stages each: the next tile loads during this one */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  /* query tiles are the grid's slowest dimension, the last (longest: they
   * see the most keys) first, so the short ones fill the tail */
  const int h = blockIdx.x, b = blockIdx.y;
  const int t0 = (gridDim.z - 1 - blockIdx.z) * BQ;
  const int past = a.past_dev != nullptr ? *a.past_dev : a.past;
  const size_t valid_stride = a.key_valid_stride > 0 ? a.key_valid_stride : past + a.n_tokens;
  const uint8_t *valid = a.key_valid != nullptr ? a.key_valid + b * valid_stride : nullptr;
  const int kvh = h / (a.heads / a.kv_heads);
  const T *K = (const T *) a.k_cache + (size_t) (b * a.kv_heads + kvh) * a.capacity * a.dk;
  const T *V = (const T *) a.v_cache + (size_t) (b * a.kv_heads + kvh) * a.capacity * a.dv;
  const bool async = a.dk % 8 == 0 && a.dv % 8 == 0 && (uintptr_t) K % 16 == 0 && (uintptr_t) V % 16 == 0;
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

  if (kbeg < kend)
    {
      fetch_tile<T, DK> (ks, K, kbeg, min (BK, kend - kbeg), a.dk, async);
      fetch_tile<T, DV> (vs, V, kbeg, min (BK, kend - kbeg), a.dv, async);
      asm volatile ("cp.async.commit_group;\n");
    }
  for (int j0 = kbeg, stage = 0; j0 < kend; j0 += BK, stage ^= 1)
    {
      const T *kt = ks + stage * BK * SK, *vt = vs + stage * BK * SV;

      if (j0 + BK < kend)
        {
          fetch_tile<T, DK> (ks + (stage ^ 1) * BK * SK, K, j0 + BK, min (BK, kend - j0 - BK), a.dk, async);
          fetch_tile<T, DV> (vs + (stage ^ 1) * BK * SV, V, j0 + BK, min (BK, kend - j0 - BK), a.dv, async);
          asm volatile ("cp.async.commit_group;\n");
          asm volatile ("cp.async.wait_group 1;\n");
        }
      else
        asm volatile ("cp.async.wait_group 0;\n");
      __syncthreads ();

      /* s = q · kᵀ for this warp's 16 queries × the tile's 64 keys */
      float s[BK / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < DK / 16; kk++)
#pragma unroll
        for (int n = 0; n < BK / 8; n += 2)
          {
            /* key octets n and n+1, dims kk·16…+15: four 8×8 matrices */
            unsigned kb[4];
            ldmatrix_x4 (kb, kt + (n * 8 + (lane & 7) + (lane >> 4) * 8) * SK + kk * 16 + ((lane >> 3) & 1) * 8,
                         false);
            mma16816<T> (s[n], qf[kk], kb);
            mma16816<T> (s[n + 1], qf[kk], kb + 2);
          }

      /* scale; mask where some key may not be attended to (the causal
       * diagonal, the tile's end, padding, a window); row maxima (a row's
       * 4 threads agree) */
      const bool mask = valid != nullptr || a.window > 0 || j0 + BK > kend ||
                        j0 + BK - 1 > past + t0 + warp * 16;
      /* four partial maxima (and sums below) a row: short dependency chains */
      float mx[2][4];
#pragma unroll
      for (int n = 0; n < BK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          {
            int j = j0 + n * 8 + 2 * c + (e & 1), qpos = past + row[e >> 1];
            bool ok = !mask || (j < kend && j <= qpos && (valid == nullptr || valid[j]) &&
                                (a.window == 0 || qpos - j < a.window));
            s[n][e] = ok ? s[n][e] * scale : -INFINITY;
            float &part = mx[e >> 1][(n % 2) * 2 + (e & 1)];
            part = n < 2 ? s[n][e] : fmaxf (part, s[n][e]);
          }
      float base[2], alpha[2], sum[2][4];
#pragma unroll
      for (int r = 0; r < 2; r++)
        {
          float top = fmaxf (fmaxf (m[r], fmaxf (mx[r][0], mx[r][1])), fmaxf (mx[r][2], mx[r][3]));
          top = fmaxf (top, __shfl_xor_sync (0xffffffffu, top, 1));
          top = fmaxf (top, __shfl_xor_sync (0xffffffffu, top, 2));
          base[r] = top == -INFINITY ? 0.0f : top;   /* all masked so far: nothing to rescale */
          alpha[r] = exp2_fast (m[r] - base[r]);
          m[r] = top;
        }
#pragma unroll
      for (int n = 0; n < BK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          {
            s[n][e] = exp2_fast (s[n][e] - base[e >> 1]);
            float &part = sum[e >> 1][(n % 2) * 2 + (e & 1)];
            part = n < 2 ? s[n][e] : part + s[n][e];
          }
#pragma unroll
      for (int r = 0; r < 2; r++)
        l[r] = l[r] * alpha[r] + ((sum[r][0] + sum[r][1]) + (sum[r][2] + sum[r][3]));
#pragma unroll
      for (int n = 0; n < DV / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          o[n][e] *= alpha[e >> 1];

      /* o += p · v, p as hi + lo: the score fragments of two key octets are
       * the A operands */
#pragma unroll
      for (int kk = 0; kk < BK / 16; kk++)
        {
          unsigned hi[4], lo[4];
#pragma unroll
          for (int q = 0; q < 4; q++)
            {
              const float *p = s[2 * kk + q / 2] + (q % 2) * 2;
              float h0 = rnd<T> (p[0]), h1 = rnd<T> (p[1]);
              hi[q] = pack2<T> (h0, h1);
              lo[q] = pack2<T> (p[0] - h0, p[1] - h1);
            }
#pragma unroll
          for (int np = 0; np < DV / 16; np++)
            {
              unsigned vb[4];
              ldmatrix_x4 (vb, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SV + np * 16 + (lane >> 4) * 8,
                           true);
              mma16816<T> (o[2 * np], hi, vb);
              mma16816<T> (o[2 * np + 1], hi, vb + 2);
              mma16816<T> (o[2 * np], lo, vb);
              mma16816<T> (o[2 * np + 1], lo, vb + 2);
            }
        }
      __syncthreads ();   /* this stage is refilled next iteration but one */
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
          float sink = a.sinks[h] * LOG2E, top = fmaxf (m[r], sink), f = exp2_fast (m[r] - top);
          l[r] = l[r] * f + exp2_fast (sink - top);
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
  constexpr int smem = 2 * BK * (DK + 8 + DV + 8) * (int) sizeof (T);
  dim3 grid (a->heads, a->batch, (a->n_tokens + BQ - 1) / BQ);
  static bool opted_in;   /* once per instantiation: more than 48 KiB of shared memory */

  if (!opted_in)
    {
      cudaFuncSetAttribute (flash_attention_kernel<T, DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      opted_in = true;
    }
  flash_attention_kernel<T, DK, DV><<<grid, 128, smem, s>>> (*a);
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
