/* moe-cuda-experts.cu: the three experts schedules on CUDA
 *
 * grouped  : route (count, scan, scatter: rows sorted by expert, offsets
 *            kept on the device) -> grouped GEMM gate_up with the gather of
 *            x and the activation fused -> grouped GEMM down with the bias
 *            and the un-permute fused -> combine (weights, sum in slot order)
 * per row  : one GEMV per (token, slot) row over its expert's weights, read
 *            in place -> the same combine
 * per expert: the routing read on the host, one cuBLAS GEMM per hit expert
 *
 * Rounding follows transformers computing in the activations' dtype: the
 * projections, the bias adds and each op of the activation round to it;
 * the K weighted slots are summed in float32 and rounded once.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "moe-cuda-experts.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cublas_v2.h>
#include <cstdlib>
#include <type_traits>
#include <vector>

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

/* ---- what one expert computes, one output at a time -------------------- */

/* The activation input: gate and up raw products of weight rows gr and ur. */
template <typename T>
__device__ __forceinline__ float
gate_up_finish (const MoeCudaExperts &p, int e, int gr, int ur, float g, float u)
{
  int upn = p.has_gate ? 2 * p.inter : p.inter;
  const T *bias = (const T *) p.up_bias;

  u = rnd<T> (u);
  if (bias != nullptr)
    u = rnd<T> (u + to_f (bias[(size_t) e * upn + ur]));
  if (!p.has_gate)
    return rnd<T> (activate (p.activation, u));
  g = rnd<T> (g);
  if (bias != nullptr)
    g = rnd<T> (g + to_f (bias[(size_t) e * upn + gr]));
  if (p.interleaved)
    {
      g = fminf (g, p.limit);
      u = fminf (fmaxf (u, -p.limit), p.limit);
      float sig = rnd<T> (1.0f / (1.0f + expf (-rnd<T> (p.alpha * g))));
      float glu = rnd<T> (g * sig);
      return rnd<T> (rnd<T> (u + 1.0f) * glu);
    }
  return rnd<T> (rnd<T> (activate (p.activation, g)) * u);
}

template <typename T>
__device__ __forceinline__ float
down_finish (const MoeCudaExperts &p, int e, int n, float y)
{
  const T *bias = (const T *) p.down_bias;

  y = rnd<T> (y);
  if (bias != nullptr)
    y = rnd<T> (y + to_f (bias[(size_t) e * p.hidden + n]));
  return y;
}

/* The weight rows behind output column j of h: gate row and up row. */
__device__ __forceinline__ void
gate_up_rows (const MoeCudaExperts &p, int j, int *gr, int *ur)
{
  if (!p.has_gate)
    *gr = *ur = j;
  else if (p.interleaved)
    *gr = 2 * j, *ur = 2 * j + 1;
  else
    *gr = j, *ur = p.inter + j;
}

/* The two projections: gate_up reads x (gathered by token) and writes h,
 * down reads h and writes y. */
enum { MODE_GATE_UP, MODE_DOWN };

/* ---- quantized weights: one value at a time ---------------------------- */

__device__ __forceinline__ float
e4m3_to_f (unsigned b)
{
  unsigned e = (b >> 3) & 15, m = b & 7;
  float v = e ? __int_as_float ((int) (((e + 120) << 23) | (m << 20))) : (float) m * (1.0f / 512.0f);
  if (e == 15 && m == 7)
    v = __int_as_float (0x7fc00000);
  return (b & 0x80) ? -v : v;
}

__device__ __forceinline__ float
e8m0_to_f (unsigned b)
{
  return b == 0 ? 5.877471754e-39f : (b == 255 ? __int_as_float (0x7fc00000) : __int_as_float ((int) (b << 23)));
}

__device__ __forceinline__ float
fp4_to_f (unsigned code)
{
  const float mag[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };
  float v = mag[code & 7];
  return (code & 8) ? -v : v;
}

/* The scale of quantized weight row `row`, input k, of expert e: FP8 one
 * per 128×128 block, FP4 one per row and 32 inputs. */
template <int WF, int MODE>
__device__ __forceinline__ float
weight_scale (const MoeCudaExperts &p, int e, int row, int k)
{
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const void *sc = MODE == MODE_DOWN ? p.down_scale : p.up_scale;

  if constexpr (WF == MOE_CUDA_WEIGHTS_FP4)
    return e8m0_to_f (((const unsigned char *) sc)[((size_t) e * nw + row) * (K / 32) + k / 32]);
  const int cols = (K + 127) / 128;
  const int rows = MODE == MODE_DOWN ? (nw + 127) / 128 : p.up_scale_rows;
  const int split = MODE == MODE_DOWN ? 0 : p.up_scale_split;
  const int sr = split == 0 ? row / 128 : (row < split ? row / 128 : (split + 127) / 128 + (row - split) / 128);
  const size_t si = ((size_t) e * rows + sr) * cols + k / 128;
  return p.scale_dtype == MOE_CUDA_E8M0 ? e8m0_to_f (((const unsigned char *) sc)[si]) : ((const float *) sc)[si];
}

/* Weight row `row` (an output feature), input k, of expert e, multiplied
 * out: plain T, FP8 × its block's scale, or FP4 × its group's scale. */
template <typename T, int WF, int MODE>
__device__ __forceinline__ float
weight_at (const MoeCudaExperts &p, int e, int row, int k)
{
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const void *base = MODE == MODE_DOWN ? p.down : p.up;

  if constexpr (WF == MOE_CUDA_WEIGHTS_PLAIN)
    {
      const T *w = (const T *) base + (size_t) e * nw * K;
      return to_f (p.transposed ? w[(size_t) k * nw + row] : w[(size_t) row * K + k]);
    }
  else if constexpr (WF == MOE_CUDA_WEIGHTS_FP8)
    {
      const unsigned char *w = (const unsigned char *) base + (size_t) e * nw * K;
      return e4m3_to_f (w[(size_t) row * K + k]) * weight_scale<WF, MODE> (p, e, row, k);
    }
  else
    {
      const unsigned char *w = (const unsigned char *) base + (size_t) e * nw * (K / 2);
      unsigned b = w[(size_t) row * (K / 2) + k / 2];
      return fp4_to_f ((k & 1) ? b >> 4 : b & 15) * weight_scale<WF, MODE> (p, e, row, k);
    }
}

/* One lane's share of a quantized weight row · x (x float, in shared
 * memory): 16-byte loads, each inside one scale block or group, the scale
 * applied to its partial sum. Needs K a multiple of 16 (FP8) or 32 (FP4). */
template <int WF, int MODE>
__device__ __forceinline__ float
dot_quantized (const MoeCudaExperts &p, int e, int row, const float *x, int lane)
{
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const unsigned char *base = (const unsigned char *) (MODE == MODE_DOWN ? p.down : p.up);
  constexpr int PER = WF == MOE_CUDA_WEIGHTS_FP8 ? 16 : 32;     /* values in 16 bytes */
  constexpr int DIV = PER / 16;                                 /* values per byte */
  const unsigned char *w = base + ((size_t) e * nw + row) * (size_t) (K / DIV);
  float acc = 0.0f;

  for (int k0 = lane * PER; k0 < K; k0 += 32 * PER)
    {
      uint4 v = __ldg ((const uint4 *) (w + k0 / DIV));
      const unsigned char *b = (const unsigned char *) &v;
      float part = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; i++)
        if constexpr (WF == MOE_CUDA_WEIGHTS_FP8)
          part += e4m3_to_f (b[i]) * x[k0 + i];
        else
          part += fp4_to_f (b[i] & 15) * x[k0 + 2 * i] + fp4_to_f (b[i] >> 4) * x[k0 + 2 * i + 1];
      acc += part * weight_scale<WF, MODE> (p, e, row, k0);
    }
  return acc;
}

/* The dynamic activation scheme: each row's 128-wide groups scaled by
 * amax / 448 (1 when all zero), rounded to e4m3 (nearest even, saturated)
 * and scaled back, as float. One block a row, one warp a group. */
template <typename T>
__global__ void __launch_bounds__ (256)
quantize_activations (const T *in, int K, float *out)
{
  const size_t row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int g = warp * 128; g < K; g += 8 * 128)
    {
      float v[4], amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; j++)
        {
          int k = g + lane + 32 * j;
          v[j] = k < K ? to_f (in[row * K + k]) : 0.0f;
          amax = fmaxf (amax, fabsf (v[j]));
        }
#pragma unroll
      for (int o = 16; o > 0; o /= 2)
        amax = fmaxf (amax, __shfl_xor_sync (0xffffffffu, amax, o));
      float s = amax > 0.0f ? amax / 448.0f : 1.0f;
#pragma unroll
      for (int j = 0; j < 4; j++)
        {
          int k = g + lane + 32 * j;
          if (k < K)
            {
              __nv_fp8_storage_t q = __nv_cvt_float_to_fp8 (v[j] / s, __NV_SATFINITE, __NV_E4M3);
              out[row * K + k] = e4m3_to_f (q) * s;
            }
        }
    }
}

/* ---- routing: rows sorted by expert, on the device --------------------- */

struct Route {
  int *counts;      /* [E] */
  int *cursor;      /* [E] */
  int *offsets;     /* [E + 1]: first sorted row of each expert */
  int *tile_start;  /* [E + 1]: first m-tile of each expert */
  int *sorted_pair; /* [S]: sorted row -> t * K + k */
};

/* One block sorts every (token, slot) row by expert: zero the counts, count,
 * scan the counts and the m-tiles per expert, scatter. One launch: at
 * decode sizes the launches, not the work, are what costs. */
__global__ void __launch_bounds__ (1024)
route (const int64_t *ids, int S, int E, int bm, Route r)
{
  __shared__ int rows_sum[1024], tiles_sum[1024];
  const int n = blockDim.x, tid = threadIdx.x;
  const int per = (E + n - 1) / n, lo = tid * per, hi = min (lo + per, E);
  int rows = 0, tiles = 0;

  for (int e = tid; e < E; e += n)
    r.counts[e] = 0, r.cursor[e] = 0;
  __syncthreads ();
  for (int i = tid; i < S; i += n)
    if ((unsigned long long) ids[i] < (unsigned long long) E)
      atomicAdd (&r.counts[ids[i]], 1);
  __syncthreads ();

  for (int e = lo; e < hi; e++)
    rows += r.counts[e], tiles += (r.counts[e] + bm - 1) / bm;
  rows_sum[tid] = rows;
  tiles_sum[tid] = tiles;
  __syncthreads ();
  for (int step = 1; step < n; step *= 2)
    {
      int a = tid >= step ? rows_sum[tid - step] : 0;
      int b = tid >= step ? tiles_sum[tid - step] : 0;
      __syncthreads ();
      rows_sum[tid] += a;
      tiles_sum[tid] += b;
      __syncthreads ();
    }
  rows = rows_sum[tid] - rows;
  tiles = tiles_sum[tid] - tiles;
  for (int e = lo; e < hi; e++)
    {
      r.offsets[e] = rows;
      r.tile_start[e] = tiles;
      rows += r.counts[e];
      tiles += (r.counts[e] + bm - 1) / bm;
    }
  if (tid == n - 1)
    r.offsets[E] = rows_sum[tid], r.tile_start[E] = tiles_sum[tid];
  __syncthreads ();

  for (int i = tid; i < S; i += n)
    if ((unsigned long long) ids[i] < (unsigned long long) E)
      r.sorted_pair[r.offsets[ids[i]] + atomicAdd (&r.cursor[ids[i]], 1)] = i;
}

/* ---- grouped GEMM -------------------------------------------------------
 *
 * C[rows of expert e, tile cols] = A[rows] · W_eᵀ, one CTA per (m-tile,
 * n-tile). MODE_GATE_UP gathers A from x by token and writes h (sorted
 * rows); MODE_DOWN reads h and writes y by (token, slot). */

struct Tile {
  int e, row0, rows;      /* expert, first sorted row, rows in this tile */
};

/* m-tile -> expert by binary search over tile_start; false past the end. */
__device__ __forceinline__ bool
find_tile (const Route &r, int E, int bm, int mt, Tile *t)
{
  if (mt >= r.tile_start[E])
    return false;
  int lo = 0, hi = E - 1;
  while (lo < hi)
    {
      int mid = (lo + hi + 1) / 2;
      if (r.tile_start[mid] <= mt)
        lo = mid;
      else
        hi = mid - 1;
    }
  t->e = lo;
  t->row0 = r.offsets[lo] + (mt - r.tile_start[lo]) * bm;
  t->rows = min (bm, r.offsets[lo + 1] - t->row0);
  return true;
}

/* Tile column c (of bn) of n-tile nt -> the weight row it multiplies, or -1.
 * Gated tiles hold bn/2 outputs: gate rows in the first half and up rows in
 * the second (concatenated), or gate/up alternating (interleaved). */
template <int MODE>
__device__ __forceinline__ int
tile_weight_row (const MoeCudaExperts &p, int bn, int nt, int c)
{
  if (MODE == MODE_DOWN)
    {
      int n = nt * bn + c;
      return n < p.hidden ? n : -1;
    }
  if (!p.has_gate)
    {
      int n = nt * bn + c;
      return n < p.inter ? n : -1;
    }
  int j0 = nt * (bn / 2);
  if (p.interleaved)
    return 2 * j0 + c < 2 * p.inter ? 2 * j0 + c : -1;
  int j = j0 + (c % (bn / 2));
  if (j >= p.inter)
    return -1;
  return c < bn / 2 ? j : p.inter + j;
}

/* The CTA's tile of accumulators, staged in shared memory, to outputs. */
template <typename T, int MODE>
__device__ void
tile_epilogue (const MoeCudaExperts &p, const Route &r, const float *cs, int ldc,
               int bm, int bn, int nt, const Tile &t, T *dst)
{
  if (MODE == MODE_DOWN)
    {
      T *y = dst;
      for (int i = threadIdx.x; i < bm * bn; i += blockDim.x)
        {
          int row = i / bn, c = i % bn, n = nt * bn + c;
          if (row < t.rows && n < p.hidden)
            {
              int pair = r.sorted_pair[t.row0 + row];
              y[(size_t) pair * p.hidden + n] = from_f<T> (down_finish<T> (p, t.e, n, cs[row * ldc + c]));
            }
        }
      return;
    }

  T *h = dst;
  int outs = p.has_gate ? bn / 2 : bn;
  for (int i = threadIdx.x; i < bm * outs; i += blockDim.x)
    {
      int row = i / outs, o = i % outs, j = nt * outs + o;
      if (row >= t.rows || j >= p.inter)
        continue;
      int gc, uc, gr, ur;
      if (!p.has_gate)
        gc = uc = o;
      else if (p.interleaved)
        gc = 2 * o, uc = 2 * o + 1;
      else
        gc = o, uc = o + bn / 2;
      gate_up_rows (p, j, &gr, &ur);
      float v = gate_up_finish<T> (p, t.e, gr, ur, cs[row * ldc + gc], cs[row * ldc + uc]);
      h[(size_t) (t.row0 + row) * p.inter + j] = from_f<T> (v);
    }
}

/* Tensor-core version (bf16/f16): mma.sync m16n8k16, ldmatrix, a cp.async
 * pipeline. Needs H and I multiples of 8 (16-byte rows). The m-tile follows
 * the rows per expert (see pick_tc_tile): a decode step gives each expert a
 * row or two, and a 128-row tile would multiply zeros 99% of the time. */
template <int BM_, int WM_, int BK_, int STAGES_>
struct TcTile {
  static constexpr int BM = BM_, BN = 128, BK = BK_, STAGES = STAGES_;
  static constexpr int WM = WM_, WN = 8 / WM_;             /* 8 warps */
  static constexpr int MI = BM / WM / 16, NI = BN / WN / 8; /* mma tiles per warp */
  static constexpr int LDA = BK + 8;                         /* A and K-major B: [row][k] */
  static constexpr int LDBN = BN + 8;                        /* N-major B: [k][col] */
  static constexpr int LDC = BN + 4;
  static constexpr int B_STAGE = BN * LDA > BK * LDBN ? BN * LDA : BK * LDBN;
  static constexpr size_t PIPE = (size_t) STAGES * (BM * LDA + B_STAGE) * 2;
  static constexpr size_t EPI = (size_t) BM * LDC * 4;
  static constexpr size_t SMEM = PIPE > EPI ? PIPE : EPI;
  static_assert (NI % 2 == 0, "B fragments load two n8 tiles at a time");
};

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

template <typename T, int MODE, bool KMAJOR, typename C>
__global__ void __launch_bounds__ (256)
grouped_gemm_tc (MoeCudaExperts p, Route r, const T *a_base, T *dst, int n_tiles)
{
  extern __shared__ __align__ (16) unsigned char smem[];
  __shared__ int a_row[C::BM];
  T *as = (T *) smem;
  T *bs = as + C::STAGES * C::BM * C::LDA;
  /* n-tiles fastest: the CTAs in flight share their m-tile's rows of A */
  const int nt = blockIdx.x % n_tiles, mt = blockIdx.x / n_tiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / C::WN, wn = warp % C::WN;
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  Tile t;

  if (!find_tile (r, p.num_experts, C::BM, mt, &t))
    return;
  for (int i = threadIdx.x; i < C::BM; i += blockDim.x)
    a_row[i] = i < t.rows ? (MODE == MODE_DOWN ? t.row0 + i : r.sorted_pair[t.row0 + i] / p.top_k) : -1;
  __syncthreads ();

  const T *w = (const T *) (MODE == MODE_DOWN ? p.down : p.up) + (size_t) t.e * nw * K;
  const int ktiles = (K + C::BK - 1) / C::BK;

  auto load_stage = [&] (int stage, int kt) {
    int k0 = kt * C::BK;
    T *sa = as + stage * C::BM * C::LDA;
    T *sb = bs + stage * C::B_STAGE;
    for (int c = threadIdx.x; c < C::BM * (C::BK / 8); c += blockDim.x)
      {
        int row = c / (C::BK / 8), k = (c % (C::BK / 8)) * 8;
        bool ok = a_row[row] >= 0 && k0 + k < K;
        const T *src = ok ? a_base + (size_t) a_row[row] * K + k0 + k : a_base;
        cp_async16 (sa + row * C::LDA + k, src, ok);
      }
    if (KMAJOR)
      for (int c = threadIdx.x; c < C::BN * (C::BK / 8); c += blockDim.x)
        {
          int col = c / (C::BK / 8), k = (c % (C::BK / 8)) * 8;
          int wr = tile_weight_row<MODE> (p, C::BN, nt, col);
          bool ok = wr >= 0 && k0 + k < K;
          const T *src = ok ? w + (size_t) wr * K + k0 + k : w;
          cp_async16 (sb + col * C::LDA + k, src, ok);
        }
    else
      for (int c = threadIdx.x; c < C::BK * (C::BN / 8); c += blockDim.x)
        {
          int k = c / (C::BN / 8), col = (c % (C::BN / 8)) * 8;
          int wr = tile_weight_row<MODE> (p, C::BN, nt, col);
          bool ok = wr >= 0 && k0 + k < K;
          const T *src = ok ? w + (size_t) (k0 + k) * nw + wr : w;
          cp_async16 (sb + k * C::LDBN + col, src, ok);
        }
  };

  float acc[C::MI][C::NI][4] = {};

  for (int s = 0; s < C::STAGES - 1; s++)
    {
      if (s < ktiles)
        load_stage (s, s);
      asm volatile ("cp.async.commit_group;\n");
    }

  for (int kt = 0; kt < ktiles; kt++)
    {
      asm volatile ("cp.async.wait_group %0;\n" :: "n"(C::STAGES - 2));
      __syncthreads ();
      if (kt + C::STAGES - 1 < ktiles)
        load_stage ((kt + C::STAGES - 1) % C::STAGES, kt + C::STAGES - 1);
      asm volatile ("cp.async.commit_group;\n");

      const T *sa = as + (kt % C::STAGES) * C::BM * C::LDA;
      const T *sb = bs + (kt % C::STAGES) * C::B_STAGE;
#pragma unroll
      for (int ks = 0; ks < C::BK; ks += 16)
        {
          unsigned a[C::MI][4], b[C::NI][2];
          const int mat = lane / 8;
#pragma unroll
          for (int mi = 0; mi < C::MI; mi++)
            {
              int row = wm * (C::BM / C::WM) + mi * 16 + (mat % 2) * 8 + lane % 8;
              ldmatrix_x4 (a[mi], sa + row * C::LDA + ks + (mat / 2) * 8, false);
            }
#pragma unroll
          for (int nj = 0; nj < C::NI / 2; nj++)
            {
              const int col0 = wn * (C::BN / C::WN) + nj * 16;
              unsigned q[4];
              if (KMAJOR)
                ldmatrix_x4 (q, sb + (col0 + (mat / 2) * 8 + lane % 8) * C::LDA + ks + (mat % 2) * 8, false);
              else
                ldmatrix_x4 (q, sb + (ks + (mat % 2) * 8 + lane % 8) * C::LDBN + col0 + (mat / 2) * 8, true);
              b[2 * nj][0] = q[0], b[2 * nj][1] = q[1];
              b[2 * nj + 1][0] = q[2], b[2 * nj + 1][1] = q[3];
            }
#pragma unroll
          for (int mi = 0; mi < C::MI; mi++)
#pragma unroll
            for (int ni = 0; ni < C::NI; ni++)
              mma16816<T> (acc[mi][ni], a[mi], b[ni]);
        }
    }
  asm volatile ("cp.async.wait_group 0;\n");
  __syncthreads ();

  float *cs = (float *) smem;
#pragma unroll
  for (int mi = 0; mi < C::MI; mi++)
#pragma unroll
    for (int ni = 0; ni < C::NI; ni++)
      {
        int row = wm * (C::BM / C::WM) + mi * 16 + lane / 4;
        int col = wn * (C::BN / C::WN) + ni * 8 + (lane % 4) * 2;
        cs[row * C::LDC + col] = acc[mi][ni][0];
        cs[row * C::LDC + col + 1] = acc[mi][ni][1];
        cs[(row + 8) * C::LDC + col] = acc[mi][ni][2];
        cs[(row + 8) * C::LDC + col + 1] = acc[mi][ni][3];
      }
  __syncthreads ();
  tile_epilogue<T, MODE> (p, r, cs, C::LDC, C::BM, C::BN, nt, t, dst);
}

/* Hopper version (sm_90a) of the big-tile case: wgmma from shared memory
 * laid out in the 128-byte swizzle, filled by cp.async (the A rows are
 * gathered, which the bulk tensor copy does not do). Two warpgroups, each
 * 64 rows × 128 columns of a 128 × 128 tile; K-major weights only. */
constexpr int WG_BM = 128, WG_BN = 128, WG_BK = 64, WG_STAGES = 3;
constexpr int WG_STAGE_BYTES = (WG_BM + WG_BN) * WG_BK * 2;
constexpr size_t WG_SMEM_PIPE = (size_t) WG_STAGES * WG_STAGE_BYTES + 1024;   /* + alignment */
constexpr size_t WG_SMEM_EPI = (size_t) WG_BM * (WG_BN + 4) * 4 + 1024;
constexpr size_t WG_SMEM = WG_SMEM_PIPE > WG_SMEM_EPI ? WG_SMEM_PIPE : WG_SMEM_EPI;

/* A K-major operand of 128-byte rows in the 128-byte swizzle: 8-row atoms
 * 1024 bytes apart; the leading offset is unused in this layout. */
[[maybe_unused]] __device__ __forceinline__ uint64_t
wgmma_desc (const void *smem)
{
  uint32_t addr = (uint32_t) __cvta_generic_to_shared (smem);
  return (uint64_t) ((addr & 0x3FFFF) >> 4) | (uint64_t) 1 << 16 | (uint64_t) (1024 >> 4) << 32 |
         (uint64_t) 1 << 62;
}

/* Byte offset of 16-byte chunk c of row r in a swizzled tile of 128-byte rows. */
[[maybe_unused]] __device__ __forceinline__ int
swizzle128 (int r, int c)
{
  return r * 128 + ((c ^ (r % 8)) * 16);
}

template <typename T>
__device__ __forceinline__ void
wgmma_m64n128k16 (float d[64], uint64_t da, uint64_t db)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile ("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                  "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                  : "l"(da), "l"(db), "r"(1));
  else
    asm volatile ("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                  "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                  : "l"(da), "l"(db), "r"(1));
#else
  __trap ();
#endif
}

template <typename T, int MODE>
__global__ void __launch_bounds__ (256)
grouped_gemm_wgmma (MoeCudaExperts p, Route r, const T *a_base, T *dst, int n_tiles)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  __shared__ int a_row[WG_BM];
  unsigned char *smem = (unsigned char *) (((uintptr_t) smem_raw + 1023) & ~(uintptr_t) 1023);
  const int nt = blockIdx.x % n_tiles, mt = blockIdx.x / n_tiles;
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x % 128) / 32;
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  Tile t;

  if (!find_tile (r, p.num_experts, WG_BM, mt, &t))
    return;
  for (int i = threadIdx.x; i < WG_BM; i += blockDim.x)
    a_row[i] = i < t.rows ? (MODE == MODE_DOWN ? t.row0 + i : r.sorted_pair[t.row0 + i] / p.top_k) : -1;
  __syncthreads ();

  const T *w = (const T *) (MODE == MODE_DOWN ? p.down : p.up) + (size_t) t.e * nw * K;
  const int ktiles = (K + WG_BK - 1) / WG_BK;

  auto stage_a = [&] (int stage) { return smem + stage * WG_STAGE_BYTES; };
  auto stage_b = [&] (int stage) { return smem + stage * WG_STAGE_BYTES + WG_BM * WG_BK * 2; };
  auto load_stage = [&] (int stage, int kt) {
    int k0 = kt * WG_BK;
    unsigned char *sa = stage_a (stage), *sb = stage_b (stage);
    for (int c = threadIdx.x; c < WG_BM * 8; c += blockDim.x)
      {
        int row = c / 8, ch = c % 8, k = ch * 8;
        bool ok = a_row[row] >= 0 && k0 + k < K;
        const T *src = ok ? a_base + (size_t) a_row[row] * K + k0 + k : a_base;
        cp_async16 (sa + swizzle128 (row, ch), src, ok);
      }
    for (int c = threadIdx.x; c < WG_BN * 8; c += blockDim.x)
      {
        int col = c / 8, ch = c % 8, k = ch * 8;
        int wr = tile_weight_row<MODE> (p, WG_BN, nt, col);
        bool ok = wr >= 0 && k0 + k < K;
        const T *src = ok ? w + (size_t) wr * K + k0 + k : w;
        cp_async16 (sb + swizzle128 (col, ch), src, ok);
      }
  };

  float d[64];
#pragma unroll
  for (int i = 0; i < 64; i++)
    d[i] = 0.0f;

  for (int s = 0; s < WG_STAGES - 1; s++)
    {
      if (s < ktiles)
        load_stage (s, s);
      asm volatile ("cp.async.commit_group;\n");
    }

  for (int kt = 0; kt < ktiles; kt++)
    {
      asm volatile ("cp.async.wait_group %0;\n" :: "n"(WG_STAGES - 2));
      /* the tensor cores read through the async proxy: order the copies first */
      asm volatile ("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads ();

      unsigned char *sa = stage_a (kt % WG_STAGES) + wg * 64 * 128;
      unsigned char *sb = stage_b (kt % WG_STAGES);
      asm volatile ("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int j = 0; j < WG_BK / 16; j++)
        wgmma_m64n128k16<T> (d, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32));
      asm volatile ("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      /* the previous step's products are done: its stage may be refilled */
      asm volatile ("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      __syncthreads ();
      if (kt + WG_STAGES - 1 < ktiles)
        load_stage ((kt + WG_STAGES - 1) % WG_STAGES, kt + WG_STAGES - 1);
      asm volatile ("cp.async.commit_group;\n");
    }
  asm volatile ("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  asm volatile ("cp.async.wait_group 0;\n");
  __syncthreads ();

  /* the m16n8 accumulator layout, once per n8 block, per warp of 16 rows */
  float *cs = (float *) smem;
  const int ldc = WG_BN + 4;
#pragma unroll
  for (int j = 0; j < WG_BN / 8; j++)
    {
      int row = wg * 64 + warp_in_wg * 16 + lane / 4, col = j * 8 + (lane % 4) * 2;
      cs[row * ldc + col] = d[4 * j];
      cs[row * ldc + col + 1] = d[4 * j + 1];
      cs[(row + 8) * ldc + col] = d[4 * j + 2];
      cs[(row + 8) * ldc + col + 1] = d[4 * j + 3];
    }
  __syncthreads ();
  tile_epilogue<T, MODE> (p, r, cs, ldc, WG_BM, WG_BN, nt, t, dst);
#else
  __trap ();
#endif
}

/* Plain float version: f32, and shapes the tensor-core path does not take. */
constexpr int SI_BM = 64, SI_BN = 64, SI_BK = 16, SI_LDC = SI_BN + 1;

/* TA: the activations' element type (float after dynamic quantization);
 * WF: the weights' format. */
template <typename T, typename TA, int MODE, int WF>
__global__ void __launch_bounds__ (256)
grouped_gemm_simt (MoeCudaExperts p, Route r, const TA *a_base, T *dst, int n_tiles)
{
  __shared__ float sa[SI_BK][SI_BM], sb[SI_BK][SI_BN];
  __shared__ float cs[SI_BM * SI_LDC];
  __shared__ int a_row[SI_BM], w_row[SI_BN];
  const int nt = blockIdx.x % n_tiles, mt = blockIdx.x / n_tiles;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  Tile t;

  if (!find_tile (r, p.num_experts, SI_BM, mt, &t))
    return;
  for (int i = threadIdx.x; i < SI_BM; i += blockDim.x)
    a_row[i] = i < t.rows ? (MODE == MODE_DOWN ? t.row0 + i : r.sorted_pair[t.row0 + i] / p.top_k) : -1;
  for (int i = threadIdx.x; i < SI_BN; i += blockDim.x)
    w_row[i] = tile_weight_row<MODE> (p, SI_BN, nt, i);
  __syncthreads ();

  float acc[4][4] = {};

  for (int k0 = 0; k0 < K; k0 += SI_BK)
    {
      for (int i = threadIdx.x; i < SI_BK * SI_BM; i += blockDim.x)
        {
          int row = i / SI_BK, k = i % SI_BK;
          sa[k][row] = a_row[row] >= 0 && k0 + k < K ? to_f (a_base[(size_t) a_row[row] * K + k0 + k]) : 0.0f;
        }
      for (int i = threadIdx.x; i < SI_BK * SI_BN; i += blockDim.x)
        {
          int col, k;
          if (p.transposed)
            k = i / SI_BN, col = i % SI_BN;
          else
            col = i / SI_BK, k = i % SI_BK;
          int wr = w_row[col];
          sb[k][col] = wr >= 0 && k0 + k < K ? weight_at<T, WF, MODE> (p, t.e, wr, k0 + k) : 0.0f;
        }
      __syncthreads ();
#pragma unroll
      for (int k = 0; k < SI_BK; k++)
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
          for (int j = 0; j < 4; j++)
            acc[i][j] += sa[k][ty + 16 * i] * sb[k][tx + 16 * j];
      __syncthreads ();
    }
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
      cs[(ty + 16 * i) * SI_LDC + tx + 16 * j] = acc[i][j];
  __syncthreads ();
  tile_epilogue<T, MODE> (p, r, cs, SI_LDC, SI_BM, SI_BN, nt, t, dst);
}

/* ---- per-row GEMV ------------------------------------------------------
 *
 * Block (row, group of outputs). K-major weights: one warp per output,
 * 16-byte loads along K. Transposed weights: 32 outputs per block, the
 * eight warps split K. */

/* Dot products of one or two weight rows with x (float, in shared memory),
 * by one warp: four 16-byte loads per row in flight per lane. */
template <typename T, bool TWO>
__device__ __forceinline__ void
dot_rows (const T *w0, const T *w1, const float *x, int K, int lane, float *s0, float *s1)
{
  float a = 0.0f, b = 0.0f;
  if (K % 8 == 0 && sizeof (T) == 2)
    {
      constexpr int U = 4;
      for (int k0 = lane * 8; k0 < K; k0 += 256 * U)
        {
          uint4 v0[U], v1[U];
#pragma unroll
          for (int u = 0; u < U; u++)
            {
              int k = k0 + u * 256;
              if (k < K)
                {
                  v0[u] = __ldg ((const uint4 *) (w0 + k));
                  if (TWO)
                    v1[u] = __ldg ((const uint4 *) (w1 + k));
                }
            }
#pragma unroll
          for (int u = 0; u < U; u++)
            {
              int k = k0 + u * 256;
              if (k >= K)
                break;
              const T *e0 = (const T *) &v0[u];
              const T *e1 = (const T *) &v1[u];
#pragma unroll
              for (int q = 0; q < 8; q++)
                {
                  a += to_f (e0[q]) * x[k + q];
                  if (TWO)
                    b += to_f (e1[q]) * x[k + q];
                }
            }
        }
    }
  else
    for (int k = lane; k < K; k += 32)
      {
        a += to_f (w0[k]) * x[k];
        if (TWO)
          b += to_f (w1[k]) * x[k];
      }
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
    {
      a += __shfl_xor_sync (0xffffffffu, a, o);
      if (TWO)
        b += __shfl_xor_sync (0xffffffffu, b, o);
    }
  *s0 = a;
  if (TWO)
    *s1 = b;
}

/* One output of one row: the gate/up pair for MODE_GATE_UP, one row else. */
template <typename T, typename TA, int MODE, int WF>
__global__ void __launch_bounds__ (256)
rowwise (MoeCudaExperts p, const TA *src_rows, T *h, T *y)
{
  extern __shared__ float xs[];
  const int pair = blockIdx.x, E = p.num_experts;
  const long long id = p.ids[pair];
  const int e = (int) id;
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int n_out = MODE == MODE_DOWN ? p.hidden : p.inter;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  /* gate_up reads x by token, down reads h by (token, slot) */
  const TA *src = MODE == MODE_DOWN ? src_rows + (size_t) pair * p.inter : src_rows + (size_t) (pair / p.top_k) * p.hidden;
  const T *w;

  if ((unsigned long long) id >= (unsigned long long) E)
    return;
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    xs[k] = to_f (src[k]);
  __syncthreads ();
  w = (const T *) (MODE == MODE_DOWN ? p.down : p.up) + (size_t) e * nw * K;

  if constexpr (WF != MOE_CUDA_WEIGHTS_PLAIN)
    {
      /* quantized: one warp an output, values multiplied out one by one */
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      const int o = blockIdx.y * 8 + warp;
      int gr = o, ur = o;
      float g = 0.0f, u = 0.0f;
      if (o >= n_out)
        return;
      if (MODE == MODE_GATE_UP)
        gate_up_rows (p, o, &gr, &ur);
      if (K % (WF == MOE_CUDA_WEIGHTS_FP8 ? 16 : 32) == 0)
        {
          u = dot_quantized<WF, MODE> (p, e, ur, xs, lane);
          if (MODE == MODE_GATE_UP && p.has_gate)
            g = dot_quantized<WF, MODE> (p, e, gr, xs, lane);
        }
      else
        for (int k = lane; k < K; k += 32)
          {
            u += weight_at<T, WF, MODE> (p, e, ur, k) * xs[k];
            if (MODE == MODE_GATE_UP && p.has_gate)
              g += weight_at<T, WF, MODE> (p, e, gr, k) * xs[k];
          }
#pragma unroll
      for (int off = 16; off > 0; off /= 2)
        {
          u += __shfl_xor_sync (0xffffffffu, u, off);
          g += __shfl_xor_sync (0xffffffffu, g, off);
        }
      if (lane != 0)
        return;
      if (MODE == MODE_DOWN)
        y[(size_t) pair * p.hidden + o] = from_f<T> (down_finish<T> (p, e, o, u));
      else
        h[(size_t) pair * p.inter + o] = from_f<T> (gate_up_finish<T> (p, e, gr, ur, p.has_gate ? g : u, u));
      return;
    }
  else if (!p.transposed)
    {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      const int o = blockIdx.y * 8 + warp;
      if (o >= n_out)
        return;
      if (MODE == MODE_DOWN)
        {
          float sum;
          dot_rows<T, false> (w + (size_t) o * K, nullptr, xs, K, lane, &sum, nullptr);
          if (lane == 0)
            y[(size_t) pair * p.hidden + o] = from_f<T> (down_finish<T> (p, e, o, sum));
        }
      else
        {
          int gr, ur;
          float g, u;
          gate_up_rows (p, o, &gr, &ur);
          if (p.has_gate)
            dot_rows<T, true> (w + (size_t) gr * K, w + (size_t) ur * K, xs, K, lane, &g, &u);
          else
            {
              dot_rows<T, false> (w + (size_t) ur * K, nullptr, xs, K, lane, &u, nullptr);
              g = u;
            }
          if (lane == 0)
            h[(size_t) pair * p.inter + o] = from_f<T> (gate_up_finish<T> (p, e, gr, ur, g, u));
        }
      return;
    }

  __shared__ float part[8][32][2];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int o = blockIdx.y * 32 + tx;
  int gr = o, ur = o;
  float g = 0.0f, u = 0.0f;
  if (o < n_out)
    {
      if (MODE == MODE_GATE_UP)
        gate_up_rows (p, o, &gr, &ur);
      for (int k = ty; k < K; k += 8)
        {
          u += to_f (w[(size_t) k * nw + ur]) * xs[k];
          if (MODE == MODE_GATE_UP && p.has_gate)
            g += to_f (w[(size_t) k * nw + gr]) * xs[k];
        }
    }
  part[ty][tx][0] = g;
  part[ty][tx][1] = u;
  __syncthreads ();
  if (ty != 0 || o >= n_out)
    return;
  for (int i = 1; i < 8; i++)
    g += part[i][tx][0], u += part[i][tx][1];
  if (MODE == MODE_DOWN)
    y[(size_t) pair * p.hidden + o] = from_f<T> (down_finish<T> (p, e, o, u));
  else
    h[(size_t) pair * p.inter + o] = from_f<T> (gate_up_finish<T> (p, e, gr, ur, p.has_gate ? g : u, u));
}

/* ---- combine: out[t] = Σ_k w[t,k] · y[t*K + k], in slot order --------- */

template <typename T>
__global__ void __launch_bounds__ (256)
combine (MoeCudaExperts p, const T *y)
{
  __shared__ float wk[64];
  __shared__ int live[64];
  const int t = blockIdx.x, K = p.top_k, H = p.hidden, E = p.num_experts;
  constexpr int V = 16 / sizeof (T);

  /* the ids are checked here, on the device: a bad one is reported to the
   * host through mapped memory and read at its next synchronization */
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    {
      long long id = p.ids[(size_t) t * K + k];
      if (id < 0 || id > E)
        {
          p.bad_id[1] = id;
          p.bad_id[0] = (long long) t * K + k + 1;
          __threadfence_system ();
        }
      live[k] = (unsigned long long) id < (unsigned long long) E;
      wk[k] = load_any (p.routing, p.routing_dtype, (size_t) t * K + k);
    }
  __syncthreads ();

  T *out = (T *) p.out + (size_t) t * H;
  if (H % V == 0)
    for (int n = threadIdx.x * V; n < H; n += blockDim.x * V)
      {
        float acc[V] = {};
        for (int k = 0; k < K; k++)
          if (live[k])
            {
              uint4 v = *(const uint4 *) (y + ((size_t) t * K + k) * H + n);
              const T *e = (const T *) &v;
#pragma unroll
              for (int q = 0; q < V; q++)
                acc[q] += to_f (e[q]) * wk[k];
            }
        uint4 o;
        T *oe = (T *) &o;
#pragma unroll
        for (int q = 0; q < V; q++)
          oe[q] = from_f<T> (acc[q]);
        *(uint4 *) (out + n) = o;
      }
  else
    for (int n = threadIdx.x; n < H; n += blockDim.x)
      {
        float acc = 0.0f;
        for (int k = 0; k < K; k++)
          if (live[k])
            acc += to_f (y[((size_t) t * K + k) * H + n]) * wk[k];
        out[n] = from_f<T> (acc);
      }
}

/* ---- per expert (eager): host routing, cuBLAS ---------------------------- */

template <typename T>
__global__ void
gather_rows (const T *x, const int *sorted_pair, int rows, int K, int H, T *dst)
{
  const int r = blockIdx.x;
  for (int n = threadIdx.x; n < H; n += blockDim.x)
    dst[(size_t) r * H + n] = x[(size_t) (sorted_pair[r] / K) * H + n];
}

/* u holds cuBLAS's rounded gate_up rows (sorted); writes h (sorted). */
template <typename T>
__global__ void
gate_rows (MoeCudaExperts p, const T *u, const int *row_expert, T *h)
{
  const int r = blockIdx.x, upn = p.has_gate ? 2 * p.inter : p.inter;
  for (int j = threadIdx.x; j < p.inter; j += blockDim.x)
    {
      int gr, ur;
      gate_up_rows (p, j, &gr, &ur);
      h[(size_t) r * p.inter + j] = from_f<T> (gate_up_finish<T> (p, row_expert[r], gr, ur,
                                                                  to_f (u[(size_t) r * upn + gr]),
                                                                  to_f (u[(size_t) r * upn + ur])));
    }
}

/* ys: cuBLAS's down rows (sorted) -> y by (token, slot), with the bias. */
template <typename T>
__global__ void
scatter_rows (MoeCudaExperts p, const T *ys, const int *sorted_pair, const int *row_expert, T *y)
{
  const int r = blockIdx.x, H = p.hidden;
  for (int n = threadIdx.x; n < H; n += blockDim.x)
    y[(size_t) sorted_pair[r] * H + n] = from_f<T> (down_finish<T> (p, row_expert[r], n, to_f (ys[(size_t) r * H + n])));
}

/* ---- host side ----------------------------------------------------------- */

size_t
align_up (size_t n)
{
  return (n + 255) & ~(size_t) 255;
}

struct Workspace {
  Route r;
  void *h, *y, *xg, *u, *ys;
  float *xq, *hq;           /* quantized weights: the activations after dynamic quantization */
  int *row_expert;
};

size_t
elem_size (int dtype)
{
  return dtype == MOE_CUDA_F32 ? 4 : 2;
}

size_t
carve (const MoeCudaExperts *p, int schedule, unsigned char *base, Workspace *w)
{
  size_t E = p->num_experts, S = (size_t) p->tokens * p->top_k, es = elem_size (p->dtype);
  size_t upn = p->has_gate ? 2 * (size_t) p->inter : p->inter;
  size_t off = 0;
  auto take = [&] (size_t bytes) -> void * {
    void *ptr = base != nullptr ? base + off : nullptr;
    off += align_up (bytes);
    return ptr;
  };

  /* counts and cursor first and adjacent: one memset clears both */
  w->r.counts = (int *) take (2 * E * sizeof (int));
  w->r.cursor = w->r.counts != nullptr ? w->r.counts + E : nullptr;
  w->r.offsets = (int *) take ((E + 1) * sizeof (int));
  w->r.tile_start = (int *) take ((E + 1) * sizeof (int));
  w->r.sorted_pair = (int *) take (S * sizeof (int));
  w->h = take (S * p->inter * es);
  w->y = take (S * p->hidden * es);
  if (schedule == MOE_CUDA_PER_EXPERT)
    {
      w->row_expert = (int *) take (S * sizeof (int));
      w->xg = take (S * p->hidden * es);
      w->u = take (S * upn * es);
      w->ys = take (S * p->hidden * es);
    }
  if (p->weight_format != MOE_CUDA_WEIGHTS_PLAIN)
    {
      w->xq = (float *) take ((size_t) p->tokens * p->hidden * sizeof (float));
      w->hq = (float *) take (S * p->inter * sizeof (float));
    }
  return off;
}

template <typename T>
const char *
launch_combine (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  combine<T><<<p.tokens, 256, 0, s>>> (p, (const T *) w.y);
  return nullptr;
}

/* Routes, then runs both grouped GEMMs with tile config C (m-tile C::BM). */
template <typename T, typename C>
const char *
run_grouped_tc (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  const int S = p.tokens * p.top_k, E = p.num_experts;
  const long m_slots = (S + C::BM - 1) / C::BM + (long) (E < S ? E : S);
  const int outs = p.has_gate ? C::BN / 2 : C::BN;
  const int nt_gu = (p.inter + outs - 1) / outs, nt_dn = (p.hidden + C::BN - 1) / C::BN;
  auto k_gu = p.transposed ? grouped_gemm_tc<T, MODE_GATE_UP, false, C> : grouped_gemm_tc<T, MODE_GATE_UP, true, C>;
  auto k_dn = p.transposed ? grouped_gemm_tc<T, MODE_DOWN, false, C> : grouped_gemm_tc<T, MODE_DOWN, true, C>;

  route<<<1, 1024, 0, s>>> (p.ids, S, E, C::BM, w.r);
  cudaFuncSetAttribute (k_gu, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) C::SMEM);
  cudaFuncSetAttribute (k_dn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) C::SMEM);
  k_gu<<<m_slots * nt_gu, 256, C::SMEM, s>>> (p, w.r, (const T *) p.x, (T *) w.h, nt_gu);
  k_dn<<<m_slots * nt_dn, 256, C::SMEM, s>>> (p, w.r, (const T *) w.h, (T *) w.y, nt_dn);
  return launch_combine<T> (p, w, s);
}

/* Whether the current device is a Hopper (compute capability 9.0), which the
 * sm_90a code needs; read once. */
bool
device_is_sm90 ()
{
  static int major = -1;
  if (major < 0)
    {
      int dev = 0;
      cudaGetDevice (&dev);
      if (cudaDeviceGetAttribute (&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
        major = 0;
      int minor = 0;
      cudaDeviceGetAttribute (&minor, cudaDevAttrComputeCapabilityMinor, dev);
      if (minor != 0)
        major = 0;
    }
  return major == 9;
}

template <typename T>
const char *
run_grouped_wgmma (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  const int S = p.tokens * p.top_k, E = p.num_experts;
  const long m_slots = (S + WG_BM - 1) / WG_BM + (long) (E < S ? E : S);
  const int outs = p.has_gate ? WG_BN / 2 : WG_BN;
  const int nt_gu = (p.inter + outs - 1) / outs, nt_dn = (p.hidden + WG_BN - 1) / WG_BN;

  route<<<1, 1024, 0, s>>> (p.ids, S, E, WG_BM, w.r);
  cudaFuncSetAttribute (grouped_gemm_wgmma<T, MODE_GATE_UP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) WG_SMEM);
  cudaFuncSetAttribute (grouped_gemm_wgmma<T, MODE_DOWN>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) WG_SMEM);
  grouped_gemm_wgmma<T, MODE_GATE_UP><<<m_slots * nt_gu, 256, WG_SMEM, s>>> (p, w.r, (const T *) p.x, (T *) w.h, nt_gu);
  grouped_gemm_wgmma<T, MODE_DOWN><<<m_slots * nt_dn, 256, WG_SMEM, s>>> (p, w.r, (const T *) w.h, (T *) w.y, nt_dn);
  return launch_combine<T> (p, w, s);
}

/* The plain-float grouped GEMMs: f32, odd sizes, and quantized weights
 * (then over the dynamically quantized activations, kept as float). */
template <typename T, int WF>
const char *
run_grouped_simt (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  const int S = p.tokens * p.top_k, E = p.num_experts;
  const long m_slots = (S + SI_BM - 1) / SI_BM + (long) (E < S ? E : S);
  const int outs = p.has_gate ? SI_BN / 2 : SI_BN;
  const int nt_gu = (p.inter + outs - 1) / outs, nt_dn = (p.hidden + SI_BN - 1) / SI_BN;

  route<<<1, 1024, 0, s>>> (p.ids, S, E, SI_BM, w.r);
  if constexpr (WF == MOE_CUDA_WEIGHTS_PLAIN)
    {
      grouped_gemm_simt<T, T, MODE_GATE_UP, WF><<<m_slots * nt_gu, 256, 0, s>>> (p, w.r, (const T *) p.x, (T *) w.h, nt_gu);
      grouped_gemm_simt<T, T, MODE_DOWN, WF><<<m_slots * nt_dn, 256, 0, s>>> (p, w.r, (const T *) w.h, (T *) w.y, nt_dn);
    }
  else
    {
      quantize_activations<T><<<p.tokens, 256, 0, s>>> ((const T *) p.x, p.hidden, w.xq);
      grouped_gemm_simt<T, float, MODE_GATE_UP, WF><<<m_slots * nt_gu, 256, 0, s>>> (p, w.r, w.xq, (T *) w.h, nt_gu);
      /* h rows are sorted, and only the routed ones were written */
      quantize_activations<T><<<S, 256, 0, s>>> ((const T *) w.h, p.inter, w.hq);
      grouped_gemm_simt<T, float, MODE_DOWN, WF><<<m_slots * nt_dn, 256, 0, s>>> (p, w.r, w.hq, (T *) w.y, nt_dn);
    }
  return launch_combine<T> (p, w, s);
}

template <typename T>
const char *
run_grouped (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  if (p.weight_format == MOE_CUDA_WEIGHTS_FP8)
    return run_grouped_simt<T, MOE_CUDA_WEIGHTS_FP8> (p, w, s);
  if (p.weight_format == MOE_CUDA_WEIGHTS_FP4)
    return run_grouped_simt<T, MOE_CUDA_WEIGHTS_FP4> (p, w, s);

  const int S = p.tokens * p.top_k, E = p.num_experts;

  if constexpr (sizeof (T) == 2)
    if (p.hidden % 8 == 0 && p.inter % 8 == 0)
      {
        /* rows per expert that is hit, about */
        const int per_expert = S / (E < S ? E : S);
        if (per_expert <= 16)
          return run_grouped_tc<T, TcTile<16, 1, 64, 4>> (p, w, s);
        if (per_expert <= 32)
          return run_grouped_tc<T, TcTile<32, 2, 64, 4>> (p, w, s);
        if (per_expert <= 64)
          return run_grouped_tc<T, TcTile<64, 2, 64, 4>> (p, w, s);
        if (!p.transposed && device_is_sm90 ())
          return run_grouped_wgmma<T> (p, w, s);
        return run_grouped_tc<T, TcTile<128, 2, 64, 3>> (p, w, s);
      }

  return run_grouped_simt<T, MOE_CUDA_WEIGHTS_PLAIN> (p, w, s);
}

template <typename T, int WF>
const char *
run_per_row_as (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  using TA = typename std::conditional<WF == MOE_CUDA_WEIGHTS_PLAIN, T, float>::type;
  const int S = p.tokens * p.top_k;
  const int per_block = p.transposed ? 32 : 8;
  dim3 grid_gu (S, (p.inter + per_block - 1) / per_block);
  dim3 grid_dn (S, (p.hidden + per_block - 1) / per_block);
  size_t smem_gu = (size_t) p.hidden * sizeof (float), smem_dn = (size_t) p.inter * sizeof (float);
  const TA *x = WF == MOE_CUDA_WEIGHTS_PLAIN ? (const TA *) p.x : (const TA *) w.xq;
  const TA *h = WF == MOE_CUDA_WEIGHTS_PLAIN ? (const TA *) w.h : (const TA *) w.hq;

  if (smem_gu > 200 * 1024 || smem_dn > 200 * 1024)
    return "hidden or intermediate size too large for the per-row kernels";
  cudaFuncSetAttribute (rowwise<T, TA, MODE_GATE_UP, WF>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem_gu);
  cudaFuncSetAttribute (rowwise<T, TA, MODE_DOWN, WF>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem_dn);
  if (WF != MOE_CUDA_WEIGHTS_PLAIN)
    quantize_activations<T><<<p.tokens, 256, 0, s>>> ((const T *) p.x, p.hidden, w.xq);
  rowwise<T, TA, MODE_GATE_UP, WF><<<grid_gu, 256, smem_gu, s>>> (p, x, (T *) w.h, (T *) w.y);
  /* h by (token, slot); a sentinel slot's row is left as it was, and unused */
  if (WF != MOE_CUDA_WEIGHTS_PLAIN)
    quantize_activations<T><<<S, 256, 0, s>>> ((const T *) w.h, p.inter, w.hq);
  rowwise<T, TA, MODE_DOWN, WF><<<grid_dn, 256, smem_dn, s>>> (p, h, (T *) w.h, (T *) w.y);
  return launch_combine<T> (p, w, s);
}

template <typename T>
const char *
run_per_row (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  if (p.weight_format == MOE_CUDA_WEIGHTS_FP8)
    return run_per_row_as<T, MOE_CUDA_WEIGHTS_FP8> (p, w, s);
  if (p.weight_format == MOE_CUDA_WEIGHTS_FP4)
    return run_per_row_as<T, MOE_CUDA_WEIGHTS_FP4> (p, w, s);
  return run_per_row_as<T, MOE_CUDA_WEIGHTS_PLAIN> (p, w, s);
}

template <typename T> cudaDataType_t cuda_type ();
template <> cudaDataType_t cuda_type<float> () { return CUDA_R_32F; }
template <> cudaDataType_t cuda_type<__nv_bfloat16> () { return CUDA_R_16BF; }
template <> cudaDataType_t cuda_type<__half> () { return CUDA_R_16F; }

/* rows × n = rows × k · Wᵀ for one expert's W ([n, k], or [k, n] transposed) */
template <typename T>
bool
gemm_rows (cublasHandle_t handle, bool transposed, int rows, int n, int k,
           const T *wmat, const T *a, T *c)
{
  const float one = 1.0f, zero = 0.0f;
  cudaDataType_t dt = cuda_type<T> ();
  return cublasGemmEx (handle, transposed ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N,
                       n, rows, k, &one, wmat, dt, transposed ? n : k, a, dt, k,
                       &zero, c, dt, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}

template <typename T>
const char *
run_per_expert (const MoeCudaExperts &p, const int64_t *host_ids, const Workspace &w,
                cublasHandle_t handle, cudaStream_t s)
{
  const int S = p.tokens * p.top_k, E = p.num_experts, H = p.hidden, I = p.inter;
  const int upn = p.has_gate ? 2 * I : I;
  std::vector<int> offsets (E + 1, 0), sorted_pair, row_expert;

  for (int i = 0; i < S; i++)
    if (host_ids[i] < E)
      offsets[host_ids[i] + 1]++;
  for (int e = 0; e < E; e++)
    offsets[e + 1] += offsets[e];
  const int rows = offsets[E];
  sorted_pair.resize (rows > 0 ? rows : 1);
  row_expert.resize (rows > 0 ? rows : 1);
  {
    std::vector<int> fill (offsets.begin (), offsets.end () - 1);
    for (int i = 0; i < S; i++)
      if (host_ids[i] < E)
        {
          int r = fill[host_ids[i]]++;
          sorted_pair[r] = i;
          row_expert[r] = (int) host_ids[i];
        }
  }
  if (rows > 0)
    {
      /* pageable copies: the host vectors are staged before these return */
      if (cudaMemcpyAsync (w.r.sorted_pair, sorted_pair.data (), rows * sizeof (int), cudaMemcpyHostToDevice, s) != cudaSuccess ||
          cudaMemcpyAsync (w.row_expert, row_expert.data (), rows * sizeof (int), cudaMemcpyHostToDevice, s) != cudaSuccess)
        return "cudaMemcpyAsync failed";
      gather_rows<T><<<rows, 256, 0, s>>> ((const T *) p.x, w.r.sorted_pair, rows, p.top_k, H, (T *) w.xg);
      for (int e = 0; e < E; e++)
        {
          int n_e = offsets[e + 1] - offsets[e];
          if (n_e == 0)
            continue;
          if (!gemm_rows<T> (handle, p.transposed, n_e, upn, H, (const T *) p.up + (size_t) e * upn * H,
                             (const T *) w.xg + (size_t) offsets[e] * H, (T *) w.u + (size_t) offsets[e] * upn))
            return "cublasGemmEx failed (gate_up)";
        }
      gate_rows<T><<<rows, 256, 0, s>>> (p, (const T *) w.u, w.row_expert, (T *) w.h);
      for (int e = 0; e < E; e++)
        {
          int n_e = offsets[e + 1] - offsets[e];
          if (n_e == 0)
            continue;
          if (!gemm_rows<T> (handle, p.transposed, n_e, H, I, (const T *) p.down + (size_t) e * H * I,
                             (const T *) w.h + (size_t) offsets[e] * I, (T *) w.ys + (size_t) offsets[e] * H))
            return "cublasGemmEx failed (down)";
        }
      scatter_rows<T><<<rows, 256, 0, s>>> (p, (const T *) w.ys, w.r.sorted_pair, w.row_expert, (T *) w.y);
    }
  return launch_combine<T> (p, w, s);
}

template <typename T>
const char *
run_typed (const MoeCudaExperts &p, int schedule, const int64_t *host_ids, const Workspace &w,
           cublasHandle_t handle, cudaStream_t s)
{
  switch (schedule)
    {
    case MOE_CUDA_GROUPED: return run_grouped<T> (p, w, s);
    case MOE_CUDA_PER_ROW: return run_per_row<T> (p, w, s);
    default: return run_per_expert<T> (p, host_ids, w, handle, s);
    }
}

} /* namespace */

extern "C" size_t
moe_cuda_experts_workspace_size (const MoeCudaExperts *e,
                                 int                   schedule)
{
  Workspace w;
  return carve (e, schedule, nullptr, &w);
}

extern "C" const char *
moe_cuda_experts_run (const MoeCudaExperts *e,
                      int                   schedule,
                      const int64_t        *host_ids,
                      void                 *workspace,
                      void                 *cublas,
                      cudaStream_t          stream)
{
  Workspace w;
  const char *msg;
  cudaError_t err;

  if (e->tokens == 0)
    return nullptr;
  if (e->num_experts > 1024 * 64)
    return "too many experts (at most 65536)";
  if (e->top_k > 64)
    return "top-k above 64 is not supported";
  if (schedule == MOE_CUDA_PER_EXPERT && host_ids == nullptr)
    return "the per-expert schedule needs the ids on the host";
  carve (e, schedule, (unsigned char *) workspace, &w);
  cudaGetLastError ();   /* a stale error is not ours */
  switch (e->dtype)
    {
    case MOE_CUDA_BF16: msg = run_typed<__nv_bfloat16> (*e, schedule, host_ids, w, (cublasHandle_t) cublas, stream); break;
    case MOE_CUDA_F16: msg = run_typed<__half> (*e, schedule, host_ids, w, (cublasHandle_t) cublas, stream); break;
    default: msg = run_typed<float> (*e, schedule, host_ids, w, (cublasHandle_t) cublas, stream); break;
    }
  if (msg != nullptr)
    return msg;
  err = cudaGetLastError ();
  return err == cudaSuccess ? nullptr : cudaGetErrorString (err);
}
