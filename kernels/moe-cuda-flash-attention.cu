/* moe-cuda-flash-attention.cu: attention of many queries (prefill) for bf16
 * and f16 models as one kernel, FlashAttention-2's scheme: a block per
 * (sequence, head, 64 queries) walks the keys in tiles of 64 through shared
 * memory; the scores, the online softmax and the output stay in registers
 * and both products run on the tensor cores (mma.sync m16n8k16, float32
 * accumulation). No score matrix ever reaches memory. On Hopper (sm_90a)
 * heads of up to 192 (keys) and 128 (values) dims run a second kernel of
 * the same scheme whose products are warpgroup MMAs (wgmma) over 128
 * queries × 128 keys a tile.
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
#include "moe-cuda-gemm.cuh"   /* wgmma_desc, swizzle128, wgmma_m64n128 */

namespace {

constexpr int BQ = 64;     /* queries a block: 16 per warp */
constexpr int BK = 64;     /* keys a tile */
constexpr float LOG2E = 1.4426950408889634f;

/* Two floats rounded to the model dtype, packed (one conversion), and
 * back as floats (bf16: bit shifts) */
template <typename T>
__device__ __forceinline__ unsigned
pack2_rn (float x0, float x1)
{
  unsigned u;
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    {
      __nv_bfloat162 v = __floats2bfloat162_rn (x0, x1);
      memcpy (&u, &v, 4);
    }
  else
    {
      __half2 v = __floats2half2_rn (x0, x1);
      memcpy (&u, &v, 4);
    }
  return u;
}

template <typename T>
__device__ __forceinline__ float2
unpack2 (unsigned u)
{
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    return make_float2 (__uint_as_float (u << 16), __uint_as_float (u & 0xffff0000u));
  else
    {
      __half2 v;
      memcpy (&v, &u, 4);
      return __half22float2 (v);
    }
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
  return pack2_rn<T> (d < a.dk ? to_f (q[d]) : 0.0f, d + 1 < a.dk ? to_f (q[d + 1]) : 0.0f);
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

/* The key range a block of queries t0…t0+nq-1 walks: keys after its last
 * query are masked for all of its rows, and with a sliding window the
 * tiles (of @tile keys) before its first query's window. */
struct KeyRange {
  int past, kbeg, kend;
};

__device__ __forceinline__ KeyRange
key_range (const MoeCudaAttention &a, int t0, int nq, int tile)
{
  KeyRange k;
  k.past = a.past_dev != nullptr ? *a.past_dev : a.past;
  k.kend = k.past + min (t0 + nq, a.n_tokens);
  k.kbeg = a.window > 0 ? max (0, k.past + t0 - a.window + 1) / tile * tile : 0;
  return k;
}

/* What a block of queries t0…t0+nq-1 of sequence b and head h reads: its
 * key range, the sequence's key padding (or NULL), and the head's keys and
 * values in the cache. */
template <typename T>
struct HeadView {
  KeyRange k;
  const uint8_t *valid;
  const T *K, *V;
};

template <typename T>
__device__ __forceinline__ HeadView<T>
head_view (const MoeCudaAttention &a, int b, int h, int t0, int nq, int tile)
{
  HeadView<T> v;
  v.k = key_range (a, t0, nq, tile);
  const size_t valid_stride = a.key_valid_stride > 0 ? a.key_valid_stride : v.k.past + a.n_tokens;
  v.valid = a.key_valid != nullptr ? a.key_valid + b * valid_stride : nullptr;
  const int kvh = h / (a.heads / a.kv_heads);
  v.K = (const T *) a.k_cache + (size_t) (b * a.kv_heads + kvh) * a.capacity * a.dk;
  v.V = (const T *) a.v_cache + (size_t) (b * a.kv_heads + kvh) * a.capacity * a.dv;
  return v;
}

/* Sets to -inf the scores of keys j0… that this thread's query rows @row
 * may not attend to: past the keys, after the query (causal), padding, or
 * out of the window. Only tiles that need it run this (the causal diagonal,
 * the tile's end, padding, a window): a condition a score in every tile
 * (branches around its loads of @valid) cost more than the rest of the
 * softmax. */
template <int NB>
__device__ __forceinline__ void
mask_scores (const MoeCudaAttention &a, const uint8_t *valid, const KeyRange &k, int j0, const int row[2], int c,
             float s[NB][4])
{
#pragma unroll
  for (int n = 0; n < NB; n++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      {
        int j = j0 + n * 8 + 2 * c + (e & 1), qpos = k.past + row[e >> 1];
        bool ok = j < k.kend && j <= qpos && (a.window == 0 || qpos - j < a.window);
        if (valid != nullptr && ok)
          ok = valid[j] != 0;
        s[n][e] = ok ? s[n][e] : -INFINITY;
      }
}

/* One tile's step of the online softmax, the same in both kernels: @s
 * holds the scores of this thread's two query rows @row (mma accumulator
 * layout: key octet n, keys 8n + 2c + {0, 1}, rows row[0] and row[1]) for
 * keys j0…; they are masked where @mask says some key of the tile may not
 * be attended to, scaled (log2 units) and turned into probabilities
 * against the running maxima @m (in those units); the row sums @l and the
 * output @o are rescaled to them. */
template <int NB, int NO>
__device__ __forceinline__ void
softmax_tile (const MoeCudaAttention &a, const uint8_t *valid, const KeyRange &k, int j0, const int row[2],
              int c, bool mask, float scale, float s[NB][4], float o[NO][4], float m[2], float l[2])
{
  if (mask)
    mask_scores<NB> (a, valid, k, j0, row, c, s);
  /* four partial maxima (and sums below) a row: short dependency chains;
   * on the unscaled scores (scale > 0: the same order), scaled once */
  float mx[2][4];
#pragma unroll
  for (int n = 0; n < NB; n++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      {
        float &part = mx[e >> 1][(n % 2) * 2 + (e & 1)];
        part = n < 2 ? s[n][e] : fmaxf (part, s[n][e]);
      }
  float base[2], alpha[2], sum[2][4];
#pragma unroll
  for (int r = 0; r < 2; r++)
    {
      float top = fmaxf (fmaxf (mx[r][0], mx[r][1]), fmaxf (mx[r][2], mx[r][3]));
      top = fmaxf (top, __shfl_xor_sync (0xffffffffu, top, 1));
      top = fmaxf (top, __shfl_xor_sync (0xffffffffu, top, 2));
      top = fmaxf (m[r], top * scale);
      base[r] = top == -INFINITY ? 0.0f : top;   /* all masked so far: nothing to rescale */
      alpha[r] = exp2_fast (m[r] - base[r]);
      m[r] = top;
    }
#pragma unroll
  for (int n = 0; n < NB; n++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      {
        s[n][e] = exp2_fast (fmaf (s[n][e], scale, -base[e >> 1]));   /* -inf (masked): 0 */
        float &part = sum[e >> 1][(n % 2) * 2 + (e & 1)];
        part = n < 2 ? s[n][e] : part + s[n][e];
      }
#pragma unroll
  for (int r = 0; r < 2; r++)
    l[r] = l[r] * alpha[r] + ((sum[r][0] + sum[r][1]) + (sum[r][2] + sum[r][3]));
#pragma unroll
  for (int n = 0; n < NO; n++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      o[n][e] *= alpha[e >> 1];
}

/* The probabilities of keys 16kk…16kk+15 as the A operand of the product
 * with the values (m16n8k16's layout, which a wgmma warp's 16 rows share),
 * as hi + lo in the model dtype. */
template <typename T, int NB>
__device__ __forceinline__ void
probability_fragments (const float s[NB][4], int kk, unsigned hi[4], unsigned lo[4])
{
#pragma unroll
  for (int q = 0; q < 4; q++)
    {
      const float *p = s[2 * kk + q / 2] + (q % 2) * 2;
      hi[q] = pack2_rn<T> (p[0], p[1]);
      float2 h = unpack2<T> (hi[q]);
      lo[q] = pack2_rn<T> (p[0] - h.x, p[1] - h.y);
    }
}

/* The output rows: row sums gathered from the row's 4 threads, a sink's
 * term (gpt-oss: one more logit per head in the denominator only), divided
 * and rounded once. */
template <typename T, int NO>
__device__ __forceinline__ void
finish_rows (const MoeCudaAttention &a, int b, int h, const int row[2], int c, float o[NO][4], float m[2],
             float l[2])
{
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; r++)
    {
      l[r] += __shfl_xor_sync (0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync (0xffffffffu, l[r], 2);
      if (a.sinks != nullptr)
        {
          float sink = a.sinks[h] * LOG2E, top = fmaxf (m[r], sink), f = exp2_fast (m[r] - top);
          l[r] = l[r] * f + exp2_fast (sink - top);
#pragma unroll
          for (int n = 0; n < NO; n++)
            {
              o[n][2 * r] *= f;
              o[n][2 * r + 1] *= f;
            }
        }
      inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;   /* a padded query with nothing to attend to: 0 */
    }
#pragma unroll
  for (int n = 0; n < NO; n++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      {
        int t = row[e >> 1], d = n * 8 + 2 * c + (e & 1);
        if (t < a.n_tokens && d < a.dv)
          ((T *) a.out)[((size_t) (b * a.n_tokens + t) * a.heads + h) * a.dv + d] = from_f<T> (o[n][e] * inv[e >> 1]);
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
  const HeadView<T> view = head_view<T> (a, b, h, t0, BQ, BK);
  const KeyRange k = view.k;
  const uint8_t *valid = view.valid;
  const T *K = view.K, *V = view.V;
  const bool async = a.dk % 8 == 0 && a.dv % 8 == 0 && (uintptr_t) K % 16 == 0 && (uintptr_t) V % 16 == 0;
  const float scale = a.scaling * LOG2E;   /* scores in log2 units: exp2 below */
  /* the two query rows (tokens of this step) whose fragments this thread holds */
  const int row[2] = { t0 + warp * 16 + g, t0 + warp * 16 + g + 8 };
  const int kend = k.kend;

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

  if (k.kbeg < kend)
    {
      fetch_tile<T, DK> (ks, K, k.kbeg, min (BK, kend - k.kbeg), a.dk, async);
      fetch_tile<T, DV> (vs, V, k.kbeg, min (BK, kend - k.kbeg), a.dv, async);
      asm volatile ("cp.async.commit_group;\n");
    }
  for (int j0 = k.kbeg, stage = 0; j0 < kend; j0 += BK, stage ^= 1)
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

      /* masks only where some key may not be attended to (the causal
       * diagonal, the tile's end, padding, a window) */
      const bool mask = valid != nullptr || a.window > 0 || j0 + BK > kend ||
                        j0 + BK - 1 > k.past + t0 + warp * 16;
      softmax_tile<BK / 8, DV / 8> (a, valid, k, j0, row, c, mask, scale, s, o, m, l);

      /* o += p · v, p as hi + lo: the score fragments of two key octets are
       * the A operands */
#pragma unroll
      for (int kk = 0; kk < BK / 16; kk++)
        {
          unsigned hi[4], lo[4];
          probability_fragments<T, BK / 8> (s, kk, hi, lo);
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
  finish_rows<T, DV / 8> (a, b, h, row, c, o, m, l);
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

/* ---- Hopper (sm_90a): the same scheme on warpgroup MMAs ------------------
 *
 * A block of two warpgroups takes 128 queries (64 each) and walks the keys
 * in tiles of 128, loaded by all its threads with cp.async into the
 * 128-byte swizzle that wgmma reads (rows of 64 dims: a head of DK dims is
 * DK / 64 such column blocks), a ring of stages. Each warpgroup forms its scores
 * s = q·kᵀ (m64n128k16, q and k from shared memory, both K-major), runs the
 * online softmax on them in its registers as the mma.sync kernel does, and
 * adds p·v with p from its registers (hi + lo) and v from shared memory
 * read transposed (MN-major: keys are the product's inner dimension, the
 * value dims its columns). 128 values dims: m64n128 for both products. */
constexpr int HQ = 128, HK = 128, H_THREADS = 256;

template <int D>
constexpr int
swizzled_bytes (int rows)
{
  return D / 64 * rows * 128;
}

/* Starts copying @n rows (zeros past them, and past @d dims) of @d
 * elements @stride apart at @src into ROWS rows of column blocks in the
 * 128-byte swizzle; d % 8 == 0 and 16-byte aligned rows. A thread copies
 * the same 16-byte chunk of every 32nd row: its swizzled place in a row is
 * the same in all of them (8 divides 32), and its addresses step by
 * constants. */
template <typename T, int D, int ROWS>
__device__ __forceinline__ void
fetch_swizzled (unsigned char *dst, const T *src, size_t stride, int n, int d)
{
  constexpr int STEP = H_THREADS / 8;   /* rows a pass */
  static_assert (ROWS % STEP == 0, "whole passes");
  const int r0 = threadIdx.x / 8, ch = threadIdx.x % 8;

#pragma unroll
  for (int cb = 0; cb < D / 64; cb++)
#pragma unroll
    for (int u = 0; u < ROWS / STEP; u++)
      {
        const int r = r0 + u * STEP, col = (cb * 8 + ch) * 8;
        const bool in = r < n && col < d;
        cp_async16 (dst + cb * ROWS * 128 + swizzle128 (r, ch), in ? src + (size_t) r * stride + col : src, in);
      }
}

/* An MN-major operand in the 128-byte swizzle: 64 columns a 128-byte row,
 * column blocks @block_bytes apart (the leading offset), 8-row atoms 1024
 * bytes apart (the stride offset). */
[[maybe_unused]] __device__ __forceinline__ uint64_t
wgmma_desc_mn (const void *smem, int block_bytes)
{
  uint32_t addr = (uint32_t) __cvta_generic_to_shared (smem);
  return (uint64_t) ((addr & 0x3FFFF) >> 4) | (uint64_t) (block_bytes >> 4) << 16 | (uint64_t) (1024 >> 4) << 32 |
         (uint64_t) 1 << 62;
}

#define MOE_WGMMA_M64N128_RS(kind)                                                                 \
  asm volatile ("wgmma.mma_async.sync.aligned." kind " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))

/* d += A·B over one k-step of 16: A (64 × 16) from registers, B (16 × 128)
 * MN-major from shared memory */
template <typename T>
__device__ __forceinline__ void
wgmma_m64n128_rs (float d[64], const unsigned a[4], uint64_t db)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    MOE_WGMMA_M64N128_RS ("m64n128k16.f32.bf16.bf16");
  else
    MOE_WGMMA_M64N128_RS ("m64n128k16.f32.f16.f16");
#else
  __trap ();
#endif
}

/* Ring stages of key/value tiles: three where they fit beside the queries
 * (128 key dims), else two. */
template <int DK>
constexpr int
hopper_stages ()
{
  return DK <= 128 ? 3 : 2;
}

/* the two warpgroups' turns on the tensor cores (named barriers 1 and 2) */
[[maybe_unused]] __device__ __forceinline__ void
turn_wait (int wg)
{
  asm volatile ("bar.sync %0, 256;\n" :: "r"(1 + wg) : "memory");
}

[[maybe_unused]] __device__ __forceinline__ void
turn_pass (int wg)
{
  asm volatile ("bar.arrive %0, 256;\n" :: "r"(1 + (wg ^ 1)) : "memory");
}

/* The warpgroups take turns (FlashAttention-3's ping-pong): one issues its
 * products — the previous tile's p·v, then this tile's q·kᵀ — while the
 * other runs its softmax, and hands the turn over once they are issued.
 * Tiles arrive through a ring whose stages carry two mbarriers: full (each
 * thread's copies landed) and empty (both warpgroups' products read it);
 * every thread copies its share of each tile, S - 1 tiles ahead. */
template <typename T, int DK>
__global__ void __launch_bounds__ (H_THREADS, 1)
flash_attention_wgmma_kernel (MoeCudaAttention a)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int DV = 128, S = hopper_stages<DK> (), QB = swizzled_bytes<DK> (HQ), KB = swizzled_bytes<DK> (HK);
  constexpr int SB = KB + swizzled_bytes<DV> (HK);   /* a stage: keys, then values */
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t full[S], empty[S];
  unsigned char *smem = (unsigned char *) (((uintptr_t) smem_raw + 1023) & ~(uintptr_t) 1023);
  unsigned char *qs = smem, *stages = smem + QB;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int h = blockIdx.x, b = blockIdx.y;
  const int t0 = (gridDim.z - 1 - blockIdx.z) * HQ;   /* the longest query tiles first */
  const HeadView<T> view = head_view<T> (a, b, h, t0, HQ, HK);
  const KeyRange k = view.k;
  const uint8_t *valid = view.valid;
  const T *K = view.K, *V = view.V;
  const T *Q = (const T *) a.q + (size_t) (b * a.n_tokens + t0) * a.q_row_stride + (size_t) h * a.dk;
  const float scale = a.scaling * LOG2E;
  const int first = t0 + wg * 64 + warp * 16;   /* this warp's first query */
  const int row[2] = { first + g, first + g + 8 };
  const int n = k.kbeg < k.kend ? (k.kend - k.kbeg + HK - 1) / HK : 0;   /* key tiles */
  auto fetch = [&] (int i) {
    unsigned char *dst = stages + (i % S) * SB;
    int j0 = k.kbeg + i * HK, rows = min (HK, k.kend - j0);
    fetch_swizzled<T, DK, HK> (dst, K + (size_t) j0 * a.dk, a.dk, rows, a.dk);
    fetch_swizzled<T, DV, HK> (dst + KB, V + (size_t) j0 * a.dv, a.dv, rows, a.dv);
    cp_async_arrive (&full[i % S]);
  };

  if (threadIdx.x == 0)
    for (int i = 0; i < S; i++)
      {
        mbar_init (&full[i], H_THREADS);
        mbar_init (&empty[i], H_THREADS);
      }
  __syncthreads ();
  fetch_swizzled<T, DK, HQ> (qs, Q, a.q_row_stride, a.n_tokens - t0, a.dk);
  for (int i = 0; i < S - 1 && i < n; i++)
    fetch (i);   /* full[0] covers the queries too */

  float o[DV / 8][4] = {};
  float m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };
  unsigned hi[HK / 16][4], lo[HK / 16][4];   /* the last tile's probabilities, for its p·v */
  /* issues o += p · v for tile i: p as hi + lo from the registers, v transposed */
  auto values_product = [&] (int i) {
    unsigned char *vt = stages + (i % S) * SB + KB;
#pragma unroll
    for (int kk = 0; kk < HK / 16; kk++)
      {
        uint64_t dv = wgmma_desc_mn (vt + kk * 16 * 128, HK * 128);
        wgmma_m64n128_rs<T> (&o[0][0], hi[kk], dv);
        wgmma_m64n128_rs<T> (&o[0][0], lo[kk], dv);
      }
  };

  if (wg == 1)
    turn_pass (wg);   /* warpgroup 0 goes first */
  for (int i = 0; i < n; i++)
    {
      const int j0 = k.kbeg + i * HK;
      unsigned char *kt = stages + (i % S) * SB;
      float s[HK / 8][4];

      turn_wait (wg);
      asm volatile ("wgmma.fence.sync.aligned;\n" ::: "memory");
      if (i > 0)
        values_product (i - 1);
      mbar_wait (&full[i % S], (i / S) & 1);
      /* the tensor cores read through the async proxy: order the copies first */
      asm volatile ("fence.proxy.async.shared::cta;\n" ::: "memory");
      /* s = q · kᵀ: this warpgroup's 64 queries × the tile's 128 keys
       * (also where a tile lies past all of them: a condition on the
       * warpgroup would have ptxas serialize every wgmma) */
#pragma unroll
      for (int ks = 0; ks < DK / 16; ks++)
        wgmma_m64n128<T> (&s[0][0], wgmma_desc (qs + (ks / 4) * HQ * 128 + wg * 64 * 128 + (ks % 4) * 32),
                          wgmma_desc (kt + (ks / 4) * HK * 128 + (ks % 4) * 32), ks > 0);
      asm volatile ("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      turn_pass (wg);   /* (under a condition on wg, ptxas would serialize every wgmma) */
      asm volatile ("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      if (i > 0)
        mbar_arrive (&empty[(i - 1) % S]);

      const bool mask = valid != nullptr || a.window > 0 || j0 + HK > k.kend || j0 + HK - 1 > k.past + first;
      softmax_tile<HK / 8, DV / 8> (a, valid, k, j0, row, c, mask, scale, s, o, m, l);
#pragma unroll
      for (int kk = 0; kk < HK / 16; kk++)
        probability_fragments<T, HK / 8> (s, kk, hi[kk], lo[kk]);
      /* the tile S - 1 ahead, into the stage of the tile before this one
       * (at the loop's top the other warpgroup could not release it
       * before taking a turn that this one had not passed yet) */
      if (i + S - 1 < n)
        {
          if (i > 0)
            mbar_wait (&empty[(i - 1) % S], ((i - 1) / S) & 1);
          fetch (i + S - 1);
        }
    }
  if (n > 0)
    {
      asm volatile ("wgmma.fence.sync.aligned;\n" ::: "memory");
      values_product (n - 1);
      asm volatile ("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile ("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
  if (wg == 0)
    turn_wait (wg);   /* warpgroup 1's last pass */
  asm volatile ("cp.async.wait_all;\n");   /* (no key tile: the queries' copies) */
  finish_rows<T, DV / 8> (a, b, h, row, c, o, m, l);
#else
  __trap ();
#endif
}

/* Whether the Hopper kernel takes @a: a Hopper device, 65…192 key dims and
 * 65…128 value dims (smaller heads are faster through the 64-query kernel),
 * rows of 16-byte chunks. */
bool
wgmma_fits (const MoeCudaAttention *a)
{
  return device_is_sm90 () && a->dk > 64 && a->dk <= 192 && a->dv > 64 && a->dv <= 128 && a->dk % 8 == 0 &&
         a->dv % 8 == 0 && a->q_row_stride % 8 == 0 && (uintptr_t) a->q % 16 == 0 &&
         (uintptr_t) a->k_cache % 16 == 0 && (uintptr_t) a->v_cache % 16 == 0;
}

template <typename T, int DK>
void
launch_wgmma (const MoeCudaAttention *a, cudaStream_t s)
{
  constexpr int smem = 1024 + swizzled_bytes<DK> (HQ) + hopper_stages<DK> () * (swizzled_bytes<DK> (HK) + swizzled_bytes<128> (HK));
  dim3 grid (a->heads, a->batch, (a->n_tokens + HQ - 1) / HQ);
  static bool opted_in;

  if (!opted_in)
    {
      cudaFuncSetAttribute (flash_attention_wgmma_kernel<T, DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      opted_in = true;
    }
  flash_attention_wgmma_kernel<T, DK><<<grid, H_THREADS, smem, s>>> (*a);
}

template <typename T>
void
launch_wgmma_dims (const MoeCudaAttention *a, cudaStream_t s)
{
  if (a->dk <= 128)
    launch_wgmma<T, 128> (a, s);
  else
    launch_wgmma<T, 192> (a, s);
}

} /* namespace */

extern "C" int
moe_cuda_flash_attention_fits (const MoeCudaAttention *a)
{
  return (a->dtype == MOE_CUDA_BF16 || a->dtype == MOE_CUDA_F16) && !a->eager && a->dk <= 192 && a->dv <= 128;
}

extern "C" int
moe_cuda_flash_attention_with (const MoeCudaAttention *a, MoeCudaFlashKernel kernel, cudaStream_t s)
{
  static int mma_only = -1;   /* MOE_CUDA_FLASH=mma: the mma.sync kernel everywhere */

  if (!moe_cuda_flash_attention_fits (a))
    return 0;
  if (mma_only < 0)
    mma_only = getenv ("MOE_CUDA_FLASH") != nullptr && strcmp (getenv ("MOE_CUDA_FLASH"), "mma") == 0;
  const bool wgmma = wgmma_fits (a);
  if (kernel == MOE_CUDA_FLASH_ANY)
    kernel = !mma_only && wgmma ? MOE_CUDA_FLASH_WGMMA : MOE_CUDA_FLASH_MMA_SYNC;
  if (kernel == MOE_CUDA_FLASH_WGMMA)
    {
      if (!wgmma)
        return 0;
      if (a->dtype == MOE_CUDA_BF16)
        launch_wgmma_dims<__nv_bfloat16> (a, s);
      else
        launch_wgmma_dims<__half> (a, s);
      return 1;
    }
  if (a->dtype == MOE_CUDA_BF16)
    launch_dims<__nv_bfloat16> (a, s);
  else
    launch_dims<__half> (a, s);
  return 1;
}

extern "C" void
moe_cuda_flash_attention (const MoeCudaAttention *a, cudaStream_t s)
{
  moe_cuda_flash_attention_with (a, MOE_CUDA_FLASH_ANY, s);
}
