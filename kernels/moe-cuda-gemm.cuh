/* moe-cuda-gemm.cuh: the device code the experts schedules share — element
 * types, what one expert computes, quantized weights, the routing and the
 * grouped GEMM kernels (mma.sync, and Hopper wgmma for bf16/f16 and FP8).
 *
 * Self-contained on top of moe-cuda-experts.h, moe-cuda-elements.cuh and
 * CUDA's headers: it is
 * compiled ahead of time into kernels/moe-cuda-experts.cu, and just in time
 * (specialised to the shapes) by the deepgemm schedule, which embeds this
 * text in the cuda plugin.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <cuda.h>          /* CUtensorMap (types only: no driver library) */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <type_traits>

#ifndef MOE_JIT   /* the deepgemm source puts the two headers before it */
# include "moe-cuda-elements.cuh"
#endif

namespace {

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

/* Gate/up is SwiGLU over concatenated gate and up halves, without bias:
 * what most checkpoints (Qwen, DeepSeek, Mixtral) run */
__device__ __forceinline__ bool
swiglu_plain (const MoeCudaExperts &p)
{
  return p.has_gate && !p.interleaved && p.up_bias == nullptr && p.activation == MOE_CUDA_ACT_SILU;
}

/* silu at 16-bit outputs: the approximate exp2 and reciprocal (relative
 * error ~1e-6, far under one rounding; denormals flushed: 1 + e^-g is 1
 * there) */
__device__ __forceinline__ float
silu_approx (float g)
{
  float e, inv;
  asm ("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm ("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(1.0f + e));
  return g * inv;
}

__device__ __forceinline__ __nv_bfloat162 pair_of (__nv_bfloat16, float a, float b) { return __floats2bfloat162_rn (a, b); }
__device__ __forceinline__ __half2 pair_of (__half, float a, float b) { return __floats2half2_rn (a, b); }
__device__ __forceinline__ float2 floats_of (__nv_bfloat162 v) { return __bfloat1622float2 (v); }
__device__ __forceinline__ float2 floats_of (__half2 v) { return __half22float2 (v); }

/* gate_up_finish for swiglu_plain, two adjacent outputs of a 16-bit type
 * at once, packed as stored: the gates and ups rounded to T, silu of the
 * rounded gates rounded to T, and their product with the ups rounded once
 * (a bf16x2/f16x2 multiply: the product of two 16-bit values is exact in
 * f32, so this is the reference's f32 product rounded) */
template <typename T>
__device__ __forceinline__ unsigned
swiglu_pair (float g0, float g1, float u0, float u1)
{
  const float2 g = floats_of (pair_of (T (), g0, g1));
  union {
    decltype (pair_of (T (), 0.0f, 0.0f)) v;
    unsigned bits;
  } y;
  y.v = __hmul2 (pair_of (T (), silu_approx (g.x), silu_approx (g.y)), pair_of (T (), u0, u1));
  return y.bits;
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

/* FP8: where the scales of quantized weight row `row` of expert e start
 * (one per 128-wide K block from there on) */
template <int MODE>
__device__ __forceinline__ int
fp8_scale_row (const MoeCudaExperts &p, int e, int row)
{
  const int K = MODE != MODE_GATE_UP ? p.inter : p.hidden;
  const int nw = MODE != MODE_GATE_UP ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const int cols = (K + 127) / 128;
  const int rows = MODE != MODE_GATE_UP ? (nw + 127) / 128 : p.up_scale_rows;
  const int split = MODE != MODE_GATE_UP ? 0 : p.up_scale_split;
  const int sr = split == 0 ? row / 128 : (row < split ? row / 128 : (split + 127) / 128 + (row - split) / 128);
  return (e * rows + sr) * cols;
}

/* FP8 scale i of the projection's scale tensor, F32 or E8M0 */
template <int MODE>
__device__ __forceinline__ float
fp8_scale_at (const MoeCudaExperts &p, int i)
{
  const void *sc = MODE != MODE_GATE_UP ? p.down_scale : p.up_scale;
  return p.scale_dtype == MOE_CUDA_E8M0 ? e8m0_to_f (((const unsigned char *) sc)[i]) : ((const float *) sc)[i];
}

/* The scale of quantized weight row `row`, input k, of expert e: FP8 one
 * per 128×128 block, FP4 one per row and 32 inputs. */
template <int WF, int MODE>
__device__ __forceinline__ float
weight_scale (const MoeCudaExperts &p, int e, int row, int k)
{
  if constexpr (WF == MOE_CUDA_WEIGHTS_FP4)
    {
      const int K = MODE != MODE_GATE_UP ? p.inter : p.hidden;
      const int nw = MODE != MODE_GATE_UP ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
      const void *sc = MODE != MODE_GATE_UP ? p.down_scale : p.up_scale;
      return e8m0_to_f (((const unsigned char *) sc)[((size_t) e * nw + row) * (K / 32) + k / 32]);
    }
  return fp8_scale_at<MODE> (p, fp8_scale_row<MODE> (p, e, row) + k / 128);
}

/* Weight row `row` (an output feature), input k, of expert e, multiplied
 * out: plain T, FP8 × its block's scale, or FP4 × its group's scale. */
template <typename T, int WF, int MODE>
__device__ __forceinline__ float
weight_at (const MoeCudaExperts &p, int e, int row, int k)
{
  const int K = MODE != MODE_GATE_UP ? p.inter : p.hidden;
  const int nw = MODE != MODE_GATE_UP ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const void *base = MODE != MODE_GATE_UP ? p.down : p.up;

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
  const int K = MODE != MODE_GATE_UP ? p.inter : p.hidden;
  const int nw = MODE != MODE_GATE_UP ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const unsigned char *base = (const unsigned char *) (MODE != MODE_GATE_UP ? p.down : p.up);
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

/* The dynamic activation scheme's rule, one place for every kernel that
 * quantizes: a 128-wide group's scale s from its largest magnitude, amax /
 * 448 (e4m3's largest), or 1 when the group is all zero, and r, 1 / s
 * correctly rounded, for the quotients below (0: divide) … */
struct Fp8Scale {
  float s, r;
};

__device__ __forceinline__ Fp8Scale
fp8_group_scale (float amax)
{
  const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
  return { s, s >= 0x1p-80f && s <= 0x1p100f ? __frcp_rn (s) : 0.0f };
}

/* … v / s, the division's float: with r = 1 / s rounded to nearest, the
 * product corrected once by its exact remainder is the correctly rounded
 * quotient (Markstein), and s within [2⁻⁸⁰, 2¹⁰⁰] keeps the remainder exact
 * for every quotient e4m3 does not round to 0 — a product and two FMAs a
 * value, where div.rn took about three times the instructions (quantize_fp8
 * 56 → 48 µs a call in Qwen3's FP8 layer at 4096 tokens on an H100) … */
__device__ __forceinline__ float
fp8_scaled (float v, Fp8Scale g)
{
  const float q = __fmul_rn (v, g.r);
  return fmaf (fmaf (-q, g.s, v), g.r, q);
}

/* … and two values of the group as e4m3 bytes of v / s (nearest even,
 * saturated), @a's the low byte */
__device__ __forceinline__ unsigned
fp8_quantize2 (float a, float b, Fp8Scale g)
{
  const float2 q = g.r != 0.0f ? make_float2 (fp8_scaled (a, g), fp8_scaled (b, g)) : make_float2 (a / g.s, b / g.s);
  return __nv_cvt_float2_to_fp8x2 (q, __NV_SATFINITE, __NV_E4M3);
}

/* One warp's 128-wide group of a row, four values a lane (input
 * g + 4·lane + j, zero past K), and its dynamic e4m3 scale
 * (fp8_group_scale). */
template <typename T>
__device__ __forceinline__ Fp8Scale
load_group_fp8 (const T *row, int g, int K, int lane, float v[4])
{
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; j++)
    {
      int k = g + lane * 4 + j;
      v[j] = k < K ? to_f (row[k]) : 0.0f;
      amax = fmaxf (amax, fabsf (v[j]));
    }
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
    amax = fmaxf (amax, __shfl_xor_sync (0xffffffffu, amax, o));
  return fp8_group_scale (amax);
}

/* The dynamic activation scheme's rounding of each row's 128-wide groups,
 * scaled back, as float. One block a row, one warp a group. */
template <typename T>
__global__ void __launch_bounds__ (256)
quantize_activations (const T *in, int K, float *out)
{
  const size_t row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int g = warp * 128; g < K; g += 8 * 128)
    {
      float v[4];
      const Fp8Scale s = load_group_fp8 (in + row * K, g, K, lane, v);
      const unsigned q[2] = { fp8_quantize2 (v[0], v[1], s), fp8_quantize2 (v[2], v[3], s) };
#pragma unroll
      for (int j = 0; j < 4; j++)
        {
          int k = g + lane * 4 + j;
          if (k < K)
            out[row * K + k] = e4m3_to_f ((q[j / 2] >> (8 * (j % 2))) & 0xffu) * s.s;
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
  int *chunk_counts; /* [⌈S / ROUTE_CHUNK⌉ · E]: route_count's rows of each chunk per expert */
  int *tile_bm;     /* [1]: the m-tile height route sorted for (the bulk-copy GEMMs of another one return at once) */
};

/* A second m-tile height route may take instead of its bm: the one whose
 * m-tiles (each costing cost_a for bm's, cost_b for bm_b's: their operand
 * bytes and products, tma_m_tile_cost) cost less in all, with the rows each
 * expert really got. An expert's m-tiles are counted in multiples of the
 * GEMM's cluster size (cluster_a for bm's, cluster_b for bm_b's): the CTAs
 * of a cluster take m-tiles of one expert. */
struct TileChoice {
  int bm_b;
  long long cost_a, cost_b;
  int cluster_a = 1, cluster_b = 1;
  int forced = 0;   /* 1: bm's m-tiles, 2: bm_b's, whatever they cost (MOE_CUDA_TILE) */
};

/* m-tiles of bm rows for an expert's rows, in multiples of cluster */
__device__ __forceinline__ int
expert_m_tiles (int rows, int bm, int cluster)
{
  const int tiles = (rows + bm - 1) / bm;
  return (tiles + cluster - 1) / cluster * cluster;
}

/* ids this thread of the block loads together before it counts or
 * scatters them (one id a loop, each load waited for in turn, was memory
 * latency) */
constexpr int ROUTE_BATCH = 8;

/* fn (i, e) for each of this thread's rows i in [begin, end) with expert e
 * in range, ROUTE_BATCH ids loaded together */
template <typename Fn>
__device__ __forceinline__ void
route_each_row (const int64_t *ids, int begin, int end, int E, Fn fn)
{
  const int n = blockDim.x;
  for (int i0 = begin + threadIdx.x; i0 < end; i0 += n * ROUTE_BATCH)
    {
      int64_t id[ROUTE_BATCH];
#pragma unroll
      for (int b = 0; b < ROUTE_BATCH; b++)
        id[b] = i0 + b * n < end ? ids[i0 + b * n] : -1;
#pragma unroll
      for (int b = 0; b < ROUTE_BATCH; b++)
        if ((unsigned long long) id[b] < (unsigned long long) E)
          fn (i0 + b * n, (int) id[b]);
    }
}

/* From every expert's row count, the sort's layout: each expert's first
 * sorted row into offsets (the block's own copy), and with write also into
 * r, with the m-tile height (bm, or choice's where its tiles load fewer
 * bytes) and each expert's first m-tile. Every thread of a block of at most
 * 1,024 takes part. */
__device__ void
route_layout (const int *counts, int E, int bm, TileChoice choice, Route r, int *offsets, bool write)
{
  __shared__ int rows_sum[1024], tiles_sum[1024], tiles_ab[2];
  const int n = blockDim.x, tid = threadIdx.x;
  const int per = (E + n - 1) / n, lo = tid * per, hi = min (lo + per, E);
  int rows = 0, tiles = 0, cluster = choice.cluster_a;

  if (tid == 0)
    tiles_ab[0] = tiles_ab[1] = 0;
  __syncthreads ();
  if (choice.bm_b > 0)
    {
      int a = 0, b = 0;
      for (int e = lo; e < hi; e++)
        a += expert_m_tiles (counts[e], bm, cluster), b += expert_m_tiles (counts[e], choice.bm_b, choice.cluster_b);
      atomicAdd (&tiles_ab[0], a);
      atomicAdd (&tiles_ab[1], b);
      __syncthreads ();
      if (choice.forced == 2 ||
          (choice.forced == 0 && (long long) tiles_ab[1] * choice.cost_b < (long long) tiles_ab[0] * choice.cost_a))
        bm = choice.bm_b, cluster = choice.cluster_b;
    }
  if (write && tid == 0 && r.tile_bm != nullptr)
    *r.tile_bm = bm;
  for (int e = lo; e < hi; e++)
    rows += counts[e], tiles += expert_m_tiles (counts[e], bm, cluster);
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
      offsets[e] = rows;
      if (write)
        r.offsets[e] = rows, r.tile_start[e] = tiles;
      rows += counts[e];
      tiles += expert_m_tiles (counts[e], bm, cluster);
    }
  if (write && tid == n - 1)
    r.offsets[E] = rows_sum[tid], r.tile_start[E] = tiles_sum[tid];
  __syncthreads ();
}

/* One block sorts every (token, slot) row by expert: zero the counts, count,
 * lay out, scatter. One launch: at decode sizes the launches, not the work,
 * are what costs. Past ROUTE_CHUNK rows route_count and route_scatter share
 * the work among blocks instead. */
__global__ void __launch_bounds__ (1024)
route (const int64_t *ids, int S, int E, int bm, Route r, TileChoice choice = {})
{
  __shared__ int per_expert[3][1024];
  /* the counting and scattering atomics, and the offsets the scatter
   * reads, in shared memory where the experts fit (their global round
   * trips were most of route's time) */
  int *counts = E <= 1024 ? per_expert[0] : r.counts, *cursor = E <= 1024 ? per_expert[1] : r.cursor;
  int *offsets = E <= 1024 ? per_expert[2] : r.offsets;

  pdl_begin ();   /* launched overlapped: the ids are the kernels' before */

  for (int e = threadIdx.x; e < E; e += blockDim.x)
    counts[e] = 0, cursor[e] = 0;
  __syncthreads ();
  route_each_row (ids, 0, S, E, [&] (int, int e) { atomicAdd (&counts[e], 1); });
  __syncthreads ();
  route_layout (counts, E, bm, choice, r, offsets, true);
  route_each_row (ids, 0, S, E, [&] (int i, int e) { r.sorted_pair[offsets[e] + atomicAdd (&cursor[e], 1)] = i; });
}

/* Many rows, at most 1,024 experts: block b counts rows [b·ROUTE_CHUNK,
 * (b + 1)·ROUTE_CHUNK) per expert into r.chunk_counts[b·E + e]; then every
 * block of route_scatter lays out all the counts and scatters its own
 * chunk's rows after those of the chunks before. One block took 40.6 µs for
 * 32,768 rows on an H100 (its ids, atomics and scattered stores all on one
 * SM); the two kernels take 3.8 + 8.9 µs. */
constexpr int ROUTE_CHUNK = 2048;

__global__ void __launch_bounds__ (1024)
route_count (const int64_t *ids, int S, int E, Route r)
{
  __shared__ int counts[1024];
  const int begin = blockIdx.x * ROUTE_CHUNK, end = min (begin + ROUTE_CHUNK, S);

  pdl_begin ();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    counts[e] = 0;
  __syncthreads ();
  route_each_row (ids, begin, end, E, [&] (int, int e) { atomicAdd (&counts[e], 1); });
  __syncthreads ();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    r.chunk_counts[(size_t) blockIdx.x * E + e] = counts[e];
}

__global__ void __launch_bounds__ (1024)
route_scatter (const int64_t *ids, int S, int E, int bm, Route r, TileChoice choice = {})
{
  __shared__ int counts[1024], cursor[1024], offsets[1024];
  const int begin = blockIdx.x * ROUTE_CHUNK, end = min (begin + ROUTE_CHUNK, S);

  pdl_begin ();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    counts[e] = 0, cursor[e] = 0;
  __syncthreads ();
  /* every expert's rows, and in cursor those of the chunks before this one */
  for (int j = threadIdx.x; j < (int) gridDim.x * E; j += blockDim.x)
    {
      const int c = r.chunk_counts[j], e = j % E;
      atomicAdd (&counts[e], c);
      if (j / E < (int) blockIdx.x)
        atomicAdd (&cursor[e], c);
    }
  __syncthreads ();
  route_layout (counts, E, bm, choice, r, offsets, blockIdx.x == 0);
  route_each_row (ids, begin, end, E, [&] (int i, int e) {
    r.sorted_pair[offsets[e] + atomicAdd (&cursor[e], 1)] = i;
  });
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
  if (MODE != MODE_GATE_UP)
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
               int bm, int bn, int nt, const Tile &t, void *dst,
               int tid = threadIdx.x, int nthreads = blockDim.x)
{
  if (MODE != MODE_GATE_UP)
    {
      T *y = (T *) dst;
      for (int i = tid; i < bm * bn; i += nthreads)
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

  T *h = (T *) dst;
  int outs = p.has_gate ? bn / 2 : bn;
  for (int i = tid; i < bm * outs; i += nthreads)
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

/* 16 bytes of a row whose start is only 8-byte aligned: two 8-byte copies,
 * each all there or zero-filled (K a multiple of 8 bytes). */
__device__ __forceinline__ void
cp_async8x2 (void *smem, const unsigned char *row, int offset, int row_bytes)
{
  unsigned s = (unsigned) __cvta_generic_to_shared (smem);
#pragma unroll
  for (int half = 0; half < 2; half++)
    {
      int o = offset + 8 * half, n = o < row_bytes ? 8 : 0;
      asm volatile ("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
                    :: "r"(s + 8 * half), "l"(row + (n ? o : 0)), "r"(n));
    }
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
  const int K = MODE != MODE_GATE_UP ? p.inter : p.hidden;
  const int nw = MODE != MODE_GATE_UP ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  Tile t;

  if (!find_tile (r, p.num_experts, C::BM, mt, &t))
    return;
  for (int i = threadIdx.x; i < C::BM; i += blockDim.x)
    a_row[i] = i < t.rows ? (MODE != MODE_GATE_UP ? t.row0 + i : r.sorted_pair[t.row0 + i] / p.top_k) : -1;
  __syncthreads ();

  const T *w = (const T *) (MODE != MODE_GATE_UP ? p.down : p.up) + (size_t) t.e * nw * K;
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
 * 64 rows × 128 columns of a 128 × 128 tile; K-major weights only. A stage
 * holds 128-byte rows: 64 bf16/f16 values, or 128 FP8 values (one scale
 * block along K).
 *
 * FP8 (e4m3 activations × e4m3 weights): the tensor cores sum one 128-wide
 * block of products, which is then scaled by the row's activation scale and
 * the column's weight scale into float accumulators; the tensor cores' own
 * FP8 sums are not kept in full float precision, so none spans two blocks. */
constexpr int WG_BM = 128, WG_BN = 128, WG_STAGES = 3, WG_ROW_BYTES = 128;
constexpr int WG_STAGE_BYTES = (WG_BM + WG_BN) * WG_ROW_BYTES;
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

#define MOE_WGMMA_M64N128(kind, tail)                                                              \
  asm volatile ("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                      \
                "wgmma.mma_async.sync.aligned." kind " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1" tail ";\n}\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                            \
                : "l"(da), "l"(db), "r"(accumulate))

/* d (+)= A·Bᵀ over one k-step: 16 bf16/f16 values, or 32 e4m3 values;
 * accumulate = 0 overwrites d. */
template <typename TOp>
__device__ __forceinline__ void
wgmma_m64n128 (float d[64], uint64_t da, uint64_t db, int accumulate)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same<TOp, __nv_bfloat16>::value)
    MOE_WGMMA_M64N128 ("m64n128k16.f32.bf16.bf16", ", 0, 0");
  else if constexpr (std::is_same<TOp, __half>::value)
    MOE_WGMMA_M64N128 ("m64n128k16.f32.f16.f16", ", 0, 0");
  else
    MOE_WGMMA_M64N128 ("m64n128k32.f32.e4m3.e4m3", "");
#else
  __trap ();
#endif
}

/* d += A·Bᵀ over one k-step of 16 bf16/f16 values, 256 columns */
template <typename TOp>
__device__ __forceinline__ void
wgmma_m64n256 (float d[128], uint64_t da, uint64_t db)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same<TOp, __nv_bfloat16>::value)
    asm volatile ("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, 0, 0;\n"
                  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) : "l"(da), "l"(db));
  else if constexpr (std::is_same<TOp, __half>::value)
    asm volatile ("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, 0, 0;\n"
                  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) : "l"(da), "l"(db));
  else
    __trap ();
#else
  __trap ();
#endif
}

/* d += A·Bᵀ over one k-step of 16 bf16/f16 values, 192 columns (the tall
 * bulk-copy tile's) */
#define MOE_WGMMA_M64N192(kind)                                                                    \
  asm volatile ("wgmma.mma_async.sync.aligned." kind " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, 1, 1, 1, 0, 0;\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]) \
                : "l"(da), "l"(db))

template <typename TOp>
__device__ __forceinline__ void
wgmma_m64n192 (float d[96], uint64_t da, uint64_t db)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same<TOp, __nv_bfloat16>::value)
    MOE_WGMMA_M64N192 ("m64n192k16.f32.bf16.bf16");
  else if constexpr (std::is_same<TOp, __half>::value)
    MOE_WGMMA_M64N192 ("m64n192k16.f32.f16.f16");
  else
    __trap ();
#else
  __trap ();
#endif
}

/* d (+)= A·Bᵀ over one k-step of 32 e4m3 values, 96 columns (the tall FP8
 * tile's); accumulate = 0 overwrites d */
template <typename TOp>
__device__ __forceinline__ void
wgmma_m64n96_fp8 (float d[48], uint64_t da, uint64_t db, int accumulate)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile ("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1;\n}\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                : "l"(da), "l"(db), "r"(accumulate));
#else
  __trap ();
#endif
}

/* d (+)= A·Bᵀ over one k-step of 32 e4m3 values, 192 columns (the wide FP8
 * tile's); accumulate = 0 overwrites d */
template <typename TOp>
__device__ __forceinline__ void
wgmma_m64n192_fp8 (float d[96], uint64_t da, uint64_t db, int accumulate)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile ("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1;\n}\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
                : "l"(da), "l"(db), "r"(accumulate));
#else
  __trap ();
#endif
}

/* The wgmma accumulator layout (m64nN, per warpgroup): thread lane of the
 * warp whose 16 rows start at row - lane / 4 holds, for each 8-column
 * block j, columns 8j + 2(lane % 4) + {0, 1} of its row and of row + 8. */

/* FP8: one 128-wide K block's products into the float accumulators, times
 * the rows' activation scales and the columns' weight scales (sc: the
 * tile's BM row scales, then one weight scale per 8 columns: H and I are
 * multiples of 8 on these paths, so 8 adjacent columns are 8 adjacent
 * weight rows inside one 128-row scale block). One scale product per 8
 * columns and row, not one per output; with PER32 (fp8_scales_per_32:
 * every 32-column block of the tile within one scale block) one per 32,
 * a quarter of the multiplies and scale loads: the promotion runs while
 * the tensor cores wait. */
template <int BM, int N = 128, bool PER32 = false>
__device__ __forceinline__ void
promote_fp8 (float d[N / 2], const float part[N / 2], const float *sc, int row)
{
  const float sa0 = sc[row], sa1 = sc[row + 8];
  auto add = [&] (int j, float s0, float s1) {
    d[4 * j] += part[4 * j] * s0;
    d[4 * j + 1] += part[4 * j + 1] * s0;
    d[4 * j + 2] += part[4 * j + 2] * s1;
    d[4 * j + 3] += part[4 * j + 3] * s1;
  };

  if constexpr (PER32)
    {
#pragma unroll
      for (int q = 0; q < N / 32; q++)
        {
          const float b = sc[BM + 4 * q], s0 = sa0 * b, s1 = sa1 * b;
#pragma unroll
          for (int j = 4 * q; j < 4 * q + 4; j++)
            add (j, s0, s1);
        }
    }
  else
#pragma unroll
    for (int j = 0; j < N / 8; j++)
      {
        const float b = sc[BM + j];
        add (j, sa0 * b, sa1 * b);
      }
}

/* Whether every 32-column block of a tile @bn wide maps to weight rows
 * inside one 128-row scale block (tile_weight_row, fp8_scale_row). A
 * tile's columns are rows from a multiple of bn (a multiple of 32), or in
 * a split gate/up, gate rows from a multiple of bn / 2 and up rows from I
 * plus that: bn / 2 must be a multiple of 32 (the 192 × 96 tile's 48 is
 * not), and I too unless up's scales start blocks of their own. */
template <int MODE>
__device__ __forceinline__ bool
fp8_scales_per_32 (const MoeCudaExperts &p, int bn)
{
  if (MODE != MODE_GATE_UP || !p.has_gate || p.interleaved)
    return bn % 32 == 0;
  return (bn / 2) % 32 == 0 && (p.up_scale_split != 0 || p.inter % 32 == 0);
}

/* A warpgroup's N-column accumulators into a float tile in shared memory. */
template <int N>
__device__ __forceinline__ void
stage_accumulators (float *cs, int ldc, const float *d, int row, int lane)
{
#pragma unroll
  for (int j = 0; j < N / 8; j++)
    {
      int col = j * 8 + (lane % 4) * 2;
      cs[row * ldc + col] = d[4 * j];
      cs[row * ldc + col + 1] = d[4 * j + 1];
      cs[(row + 8) * ldc + col] = d[4 * j + 2];
      cs[(row + 8) * ldc + col + 1] = d[4 * j + 3];
    }
}

/* One CTA of the wgmma grouped GEMM. FP8: a_base holds e4m3 rows and
 * a_scale their scales, [⌈K/128⌉, rows] (quantize_fp8's); else a_base holds T rows. KC is
 * the inner size when known at compile time (just-in-time builds), or 0. */
template <typename T, int MODE, bool FP8, int KC>
__device__ __forceinline__ void
wgmma_gemm (const MoeCudaExperts &p, const Route &r, const void *a_base, const float *a_scale, void *dst,
            int n_tiles)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  using TOp = typename std::conditional<FP8, unsigned char, T>::type;
  constexpr int ES = sizeof (TOp), BK = WG_ROW_BYTES / ES, CHUNK = 16 / ES;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int a_row[WG_BM], b_row[WG_BN];
  __shared__ float s_scale[FP8 ? WG_STAGES : 1][WG_BM + WG_BN / 8];   /* FP8: rows', then 8 columns' */
  unsigned char *smem = (unsigned char *) (((uintptr_t) smem_raw + 1023) & ~(uintptr_t) 1023);
  const int nt = blockIdx.x % n_tiles, mt = blockIdx.x / n_tiles;
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x % 128) / 32;
  const int K = KC != 0 ? KC : (MODE != MODE_GATE_UP ? p.inter : p.hidden);
  const int nw = MODE != MODE_GATE_UP ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  /* rows of a_scale: x's tokens (gate_up reads them in place), or h's */
  const size_t a_rows = MODE != MODE_GATE_UP ? (size_t) p.tokens * p.top_k : (size_t) p.tokens;
  Tile t;

  if (!find_tile (r, p.num_experts, WG_BM, mt, &t))
    return;
  for (int i = threadIdx.x; i < WG_BM; i += blockDim.x)
    a_row[i] = i < t.rows ? (MODE != MODE_GATE_UP ? t.row0 + i : r.sorted_pair[t.row0 + i] / p.top_k) : -1;
  for (int c = threadIdx.x; c < WG_BN; c += blockDim.x)
    b_row[c] = tile_weight_row<MODE> (p, WG_BN, nt, c);
  __syncthreads ();

  const unsigned char *a = (const unsigned char *) a_base;
  const unsigned char *w = (const unsigned char *) (MODE != MODE_GATE_UP ? p.down : p.up) + (size_t) t.e * nw * K * ES;
  const int ktiles = (K + BK - 1) / BK;

  auto stage_a = [&] (int stage) { return smem + stage * WG_STAGE_BYTES; };
  auto stage_b = [&] (int stage) { return smem + stage * WG_STAGE_BYTES + WG_BM * WG_ROW_BYTES; };
  auto load_stage = [&] (int stage, int kt) -> void {
    int k0 = kt * BK;
    unsigned char *sa = stage_a (stage), *sb = stage_b (stage);
    /* rows of K·ES bytes: 16-byte copies where that keeps them aligned */
    const bool aligned = (K * ES) % 16 == 0;
    for (int c = threadIdx.x; c < (WG_BM + WG_BN) * 8; c += blockDim.x)
      {
        const bool is_a = c < WG_BM * 8;
        int row = (is_a ? c : c - WG_BM * 8) / 8, ch = c % 8, k = k0 + ch * CHUNK;
        int src_row = is_a ? a_row[row] : b_row[row];
        const unsigned char *base = is_a ? a : w;
        unsigned char *dst = (is_a ? sa : sb) + swizzle128 (row, ch);
        if (src_row < 0)
          cp_async16 (dst, base, false);
        else if (aligned)
          cp_async16 (dst, k < K ? base + ((size_t) src_row * K + k) * ES : base, k < K);
        else
          cp_async8x2 (dst, base + (size_t) src_row * K * ES, k * ES, K * ES);
      }
    if (FP8)
      for (int i = threadIdx.x; i < WG_BM + WG_BN / 8; i += blockDim.x)
        {
          int c = 8 * (i - WG_BM);
          s_scale[stage][i] = i < WG_BM ? (a_row[i] >= 0 ? a_scale[(size_t) kt * a_rows + a_row[i]] : 0.0f)
                                        : (b_row[c] >= 0 ? weight_scale<MOE_CUDA_WEIGHTS_FP8, MODE> (p, t.e, b_row[c], k0) : 0.0f);
        }
  };

  float d[64];
  float part[FP8 ? 64 : 1];
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

      unsigned char *sa = stage_a (kt % WG_STAGES) + wg * 64 * WG_ROW_BYTES;
      unsigned char *sb = stage_b (kt % WG_STAGES);
      asm volatile ("wgmma.fence.sync.aligned;\n" ::: "memory");
      if constexpr (FP8)
        {
#pragma unroll
          for (int j = 0; j < 4; j++)
            wgmma_m64n128<TOp> (part, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32), j > 0);
          asm volatile ("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          asm volatile ("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
          promote_fp8<WG_BM> (d, part, s_scale[kt % WG_STAGES], wg * 64 + warp_in_wg * 16 + lane / 4);
        }
      else
        {
#pragma unroll
          for (int j = 0; j < BK / 16; j++)
            wgmma_m64n128<TOp> (d, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32), 1);
          asm volatile ("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          /* the previous step's products are done: its stage may be refilled */
          asm volatile ("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        }
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
  stage_accumulators<WG_BN> (cs, ldc, d, wg * 64 + warp_in_wg * 16 + lane / 4, lane);
  __syncthreads ();
  tile_epilogue<T, MODE> (p, r, cs, ldc, WG_BM, WG_BN, nt, t, dst);
#else
  __trap ();
#endif
}

/* ---- Hopper: bulk tensor copies and warp-specialized wgmma ---------------
 *
 * For A rows already in sorted order in one buffer (the gathered x, or h):
 * one producer warp issues bulk tensor copies (128-byte swizzle, what wgmma
 * reads) of the tile's A rows and weight rows into a few-stage ring guarded
 * by mbarriers; consumer warpgroups (64 rows each) run wgmma as stages fill
 * and hand each stage back when its products are done. No block-wide
 * barrier in the main loop. Rows and weight rows that belong to the next
 * expert (or lie past the end) are multiplied and never written. Needs
 * 16-byte aligned rows (H·size and I·size multiples of 16). */

/* The persistent GEMM's general epilogue (every finish but the common one,
 * finish_in_registers): each consumer warpgroup drains its 64 × BN
 * accumulators through a buffer of its own (the ring is already filling
 * with the next tile's operands), TM_EPI_COLS columns at a time. (Straight
 * from the registers, this finish unrolled for every output measured
 * 40-60% slower: the code outgrew the instruction cache; the common
 * finish is small enough to.) Each thread then
 * finishes a few adjacent outputs of a row and stores them as one vector:
 * h's and y's rows are 16-byte aligned (I and H multiples of 8, the
 * bulk-copy path's requirement), so a group is all in or all out.
 * A thread's rows are the same in every chunk: down's (token, slot) row is
 * looked up once a tile, not once an output. (One scalar store an output,
 * its row looked up each time, took about 45% of down's consumer time at
 * 16384 tokens, Nsight Compute's stall sampling.) */
constexpr int TM_EPI_COLS = 32, TM_EPI_LD = TM_EPI_COLS + 4;
constexpr int TM_EPI_BYTES = 64 * TM_EPI_LD * 4;

/* N floats of 16-byte aligned shared memory */
template <int N>
__device__ __forceinline__ void
load_floats (float (&v)[N], const float *src)
{
#pragma unroll
  for (int i = 0; i < N / 4; i++)
    {
      const float4 f = ((const float4 *) src)[i];
      v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
}

/* W finished outputs as vector stores (of 4, 8 or 16 bytes) */
template <typename T, int W>
__device__ __forceinline__ void
store_outputs (T *dst, const float (&v)[W])
{
  constexpr int BYTES = W * sizeof (T), VEC = BYTES % 16 == 0 ? 16 : BYTES % 8 == 0 ? 8 : 4;
  using Vec = typename std::conditional<VEC == 16, uint4, typename std::conditional<VEC == 8, uint2, unsigned>::type>::type;
  union {
    Vec vec[BYTES / VEC];
    T t[W];
  } out;
#pragma unroll
  for (int e = 0; e < W; e++)
    out.t[e] = from_f<T> (v[e]);
#pragma unroll
  for (int i = 0; i < BYTES / VEC; i++)
    ((Vec *) dst)[i] = out.vec[i];
}

/* Two outputs rounded to T (16-bit) and packed as stored */
template <typename T>
__device__ __forceinline__ unsigned
pair_bits (float a, float b)
{
  union {
    T t[2];
    unsigned bits;
  } y;
  y.t[0] = from_f<T> (a), y.t[1] = from_f<T> (b);
  return y.bits;
}

/* v[k] of lane k of this quad (lanes 4g … 4g + 3) into v[lane % 4] of …:
 * after it, lane q holds what the quad's lanes held at index q, in lane
 * order (a 4 × 4 transpose by two butterfly exchanges) */
__device__ __forceinline__ void
quad_transpose (unsigned (&v)[4])
{
  const int q = threadIdx.x % 4;
#pragma unroll
  for (int m = 1; m <= 2; m *= 2)
    {
      const bool hi = q & m;
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (!(j & m))
          {
            /* the lane keeps the index whose bit m is its own, and swaps the other */
            const unsigned got = __shfl_xor_sync (0xffffffffu, hi ? v[j] : v[j | m], m);
            if (hi)
              v[j] = got;
            else
              v[j | m] = got;
          }
    }
}

/* The common finish: gate/up SwiGLU over split halves without bias, down
 * without bias (swiglu_plain, down_bias). A thread holds each gate
 * accumulator beside its up one (column c and c + N/2 of a split tile), so
 * it finishes and stores its outputs straight from the registers: no
 * staging in shared memory, no barrier. A lane holds two adjacent outputs
 * of each 8-column block (its quad the block's 8); 16-bit outputs of four
 * blocks are exchanged within the quad so that each lane stores one
 * block's 8 as a 16-byte vector, a quarter of the stores that the pairs
 * (4 bytes each, 8 rows a warp's store) took. (Through the staging
 * buffer, as every other case still runs, this finish was ~18% of
 * gate/up's consumer time at 2048 tokens; the general finish, output by
 * output with the activation switch, ~35%.) */
template <typename T, int MODE, int N>
__device__ __forceinline__ void
finish_in_registers (const MoeCudaExperts &p, const Route &r, const float (&d)[N / 2], int cw, int nt,
                     const Tile &t, void *dst)
{
  const int lane = threadIdx.x % 32, row = (threadIdx.x % 128) / 32 * 16 + lane / 4, c0 = (lane % 4) * 2;
  const int rows = t.rows - cw * 64, row0 = t.row0 + cw * 64;
  const int ld = MODE == MODE_GATE_UP ? p.inter : p.hidden;
  constexpr int BLOCKS = MODE == MODE_GATE_UP ? N / 16 : N / 8;   /* 8-column blocks of outputs */
  /* blocks stored as 16-byte vectors, in fours (16-bit T), the rest as pairs */
  constexpr int VEC_BLOCKS = sizeof (T) == 2 ? BLOCKS / 4 * 4 : 0;
  T *out[2];   /* this thread's two rows of h (sorted) or y (token, slot); nullptr: none */

#pragma unroll
  for (int h = 0; h < 2; h++)
    {
      const int i = row + 8 * h;
      out[h] = i >= rows ? nullptr
               : (T *) dst + (size_t) (MODE == MODE_GATE_UP ? row0 + i : r.sorted_pair[row0 + i]) * ld;
    }
  /* gate/up: the gates and their ups; down: its products (block j, row h) */
  auto gates = [&] (int j, int h) { return d + 4 * j + 2 * h; };
  auto ups = [&] (int j, int h) { return MODE == MODE_GATE_UP ? d + 4 * (j + N / 16) + 2 * h : gates (j, h); };
  /* 16-bit T: block j's two outputs of row h, finished and packed as stored */
  auto pair_out = [&] (int j, int h) -> unsigned {
    const float *a = gates (j, h), *u = ups (j, h);
    if constexpr (sizeof (T) != 2)
      return 0;
    else if constexpr (MODE == MODE_GATE_UP)
      return swiglu_pair<T> (a[0], a[1], u[0], u[1]);
    else
      return pair_bits<T> (a[0], a[1]);
  };

#pragma unroll
  for (int j0 = 0; j0 < VEC_BLOCKS; j0 += 4)
    {
      /* every lane of the quad exchanges, whatever it stores */
      const int o = nt * (BLOCKS * 8) + (j0 + lane % 4) * 8;   /* this lane's block after the exchange */
#pragma unroll
      for (int h = 0; h < 2; h++)
        {
          unsigned v[4];
#pragma unroll
          for (int k = 0; k < 4; k++)
            v[k] = pair_out (j0 + k, h);
          quad_transpose (v);
          if (out[h] != nullptr && o < ld)
            *(uint4 *) (out[h] + o) = make_uint4 (v[0], v[1], v[2], v[3]);
        }
    }
#pragma unroll
  for (int j = VEC_BLOCKS; j < BLOCKS; j++)
    {
      const int o = nt * (BLOCKS * 8) + j * 8 + c0;   /* h's or y's column: o and o + 1 */
      if (o >= ld)
        break;
#pragma unroll
      for (int h = 0; h < 2; h++)
        {
          if constexpr (sizeof (T) == 2)
            {
              const unsigned y = pair_out (j, h);
              if (out[h] != nullptr)
                *(unsigned *) (out[h] + o) = y;
            }
          else
            {
              /* f32 (FP8 experts on f32 hidden states): the exact silu; the store rounds */
              const float *a = gates (j, h), *u = ups (j, h);
              float v[2] = { a[0], a[1] };
              if (MODE == MODE_GATE_UP)
                v[0] = activate (MOE_CUDA_ACT_SILU, a[0]) * u[0], v[1] = activate (MOE_CUDA_ACT_SILU, a[1]) * u[1];
              if (out[h] != nullptr)
                store_outputs<T, 2> (out[h] + o, v);
            }
        }
    }
}

/* Every other finish, output by output as the reference does: each
 * consumer warpgroup drains its 64 × N accumulators through its buffer. */
template <typename T, int MODE, int N>
__device__ __forceinline__ void
drain_accumulators (const MoeCudaExperts &p, const Route &r, const float (&d)[N / 2], float *buf, int cw,
                    int nt, const Tile &t, void *dst)
{
  /* a chunk of split gate/up columns: 16 gates and their 16 ups */
  const bool split = MODE == MODE_GATE_UP && p.has_gate && !p.interleaved;
  const bool gated = MODE == MODE_GATE_UP && p.has_gate;
  const int tid = threadIdx.x % 128, lane = threadIdx.x % 32, row = tid / 32 * 16 + lane / 4, c0 = (lane % 4) * 2;
  const int rows = t.rows - cw * 64, row0 = t.row0 + cw * 64;
  /* W adjacent outputs a (row, group) item (gate/up's 4: with the gates
   * beside the ups, 8 took more registers than the tall tile's 128 and
   * spilled); per chunk, 1 to 4 items a thread, the same rows in every
   * chunk */
  constexpr int W = MODE == MODE_GATE_UP ? 4 : 8, MAX_ITEMS = 64 * TM_EPI_COLS / W / 128;
  const int outs = gated ? TM_EPI_COLS / 2 : TM_EPI_COLS, groups = outs / W, items = 64 * groups / 128;
  const int ld = MODE == MODE_GATE_UP ? p.inter : p.hidden;
  int dst_row[MAX_ITEMS];   /* h's sorted row, or y's (token, slot) row; -1: none */

  if (rows <= 0)   /* the same for the whole warpgroup */
    return;
#pragma unroll
  for (int k = 0; k < MAX_ITEMS; k++)
    {
      const int i = (tid + 128 * k) / groups;
      dst_row[k] = k >= items || i >= rows ? -1 : MODE == MODE_GATE_UP ? row0 + i : r.sorted_pair[row0 + i];
    }
  for (int q = 0; q < N / TM_EPI_COLS; q++)
    {
      /* the accumulators' 8-column blocks of chunk q (d indexed by
       * constants only: it stays in registers) */
#pragma unroll
      for (int j = 0; j < N / 8; j++)
        {
          const int chunk = split ? (j % (N / 16)) / 2 : j / 4;
          const int pos = split ? (j >= N / 16) * 2 + j % 2 : j % 4;
          if (chunk != q)
            continue;
          float *at = buf + row * TM_EPI_LD + pos * 8 + c0;
          *(float2 *) at = make_float2 (d[4 * j], d[4 * j + 1]);
          *(float2 *) (at + 8 * TM_EPI_LD) = make_float2 (d[4 * j + 2], d[4 * j + 3]);
        }
      asm volatile ("bar.sync %0, 128;\n" :: "r"(2 + cw) : "memory");
#pragma unroll
      for (int k = 0; k < MAX_ITEMS; k++)
        {
          const int i = (tid + 128 * k) / groups, grp = (tid + 128 * k) % groups;
          const int o0 = (nt * (N / TM_EPI_COLS) + q) * outs + grp * W;   /* h's or y's column */
          if (dst_row[k] < 0 || o0 >= ld)
            continue;
          /* the item's columns: u (down's, or gate/up's up or only column)
           * and g (gate), read as 16-byte vectors */
          const float *src = buf + i * TM_EPI_LD;
          float g[W] = {}, u[W];
          if (MODE == MODE_GATE_UP && p.has_gate && p.interleaved)
            {
              float gu[2 * W];
              load_floats<2 * W> (gu, src + grp * 2 * W);
#pragma unroll
              for (int e = 0; e < W; e++)
                g[e] = gu[2 * e], u[e] = gu[2 * e + 1];
            }
          else
            {
              load_floats<W> (u, src + grp * W + (gated ? outs : 0));
              if (gated)
                load_floats<W> (g, src + grp * W);
            }
#pragma unroll
          for (int e = 0; e < W; e++)
            if (MODE != MODE_GATE_UP)
              u[e] = down_finish<T> (p, t.e, o0 + e, u[e]);
            else
              {
                int gr, ur;
                gate_up_rows (p, o0 + e, &gr, &ur);
                u[e] = gate_up_finish<T> (p, t.e, gr, ur, g[e], u[e]);
              }
          store_outputs<T, W> ((T *) dst + (size_t) dst_row[k] * ld + o0, u);
        }
      asm volatile ("bar.sync %0, 128;\n" :: "r"(2 + cw) : "memory");
    }
}

/* A tile of the bulk-copy GEMM: CW consumer warpgroups (BM = 64·CW rows)
 * × BN columns, and the registers a thread of the producer warpgroup and of
 * a consumer keep after setmaxnreg (together the SM's 64K). With CLUSTER 2
 * the CTAs run in pairs, each pair on two m-tiles of one expert and the
 * same weight tile: each CTA copies half of that tile into both (a
 * multicast bulk copy), so L2 serves each weight tile once for the two. */
template <int CW_, int BN_, int CLUSTER_ = 1>
struct TmaTile {
  static constexpr int CW = CW_, BM = 64 * CW, BN = BN_, THREADS = 128 * (CW + 1), CLUSTER = CLUSTER_;
  static constexpr int STAGE_BYTES = (BM + BN) * WG_ROW_BYTES, STAGES = STAGE_BYTES >= 48 * 1024 ? 4 : 5;
  static constexpr size_t SMEM = (size_t) STAGES * STAGE_BYTES + 1024 + CW * TM_EPI_BYTES;
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = CW == 2 ? 232 : 152;
  static_assert (128 * PRODUCER_REGS + 128 * CW * CONSUMER_REGS <= 65536, "registers");
};

/* The wide tile, 128 rows × 256 columns (bf16/f16) or 128 (FP8, whose
 * per-block partial sums take as many registers again): of 128 rows an
 * expert or more, few pipeline fills and epilogues per FLOP. */
template <bool FP8>
using TmaWide = TmaTile<2, FP8 ? 128 : 256>;

/* The wide tile for many rows an expert (large_tiles chooses it). FP8:
 * 128 × 192 (96 + 96 of a consumer's 232 registers), a third fewer A bytes
 * per FLOP than 128 × 128, which at 16384 tokens is bound by what the
 * copies bring in (+8.5% on an H100 for Qwen1.5-MoE's layer), but slower
 * at 2048 (-12%: more of its columns multiply in an expert's last,
 * part-filled m-tile's wake). bf16/f16: the
 * wide tile in CTA pairs sharing the weight tile (H100: +6.7% for that
 * layer at 16384 tokens, +2.7% for DeepGEMM's 4 × 8192-row shape, but
 * -11% at 2048, where an expert's second m-tile is mostly padding; FP8's
 * pairs measured no faster than its single CTAs, and slower below 16384
 * tokens). */
template <bool FP8>
using TmaWideLarge = typename std::conditional<FP8, TmaTile<2, 192>, TmaTile<2, 256, 2>>::type;

/* The tall tile, 192 × 192 (bf16/f16) or 192 × 96 (FP8): one m-tile for
 * an expert of up to 192 rows, where the wide one takes two, the second
 * nearly empty (137 rows an expert in a 2048-token prefill of 60 experts,
 * top-4), each loading the whole weight tile every k-step. */
template <bool FP8>
using TmaTall = TmaTile<3, FP8 ? 96 : 192>;

__device__ __forceinline__ unsigned
smem_addr (const void *p)
{
  return (unsigned) __cvta_generic_to_shared (p);
}

__device__ __forceinline__ void
mbar_init (uint64_t *bar, unsigned count)
{
  asm volatile ("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr (bar)), "r"(count));
}

__device__ __forceinline__ void
mbar_expect_tx (uint64_t *bar, unsigned bytes)
{
  asm volatile ("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(smem_addr (bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void
mbar_arrive (uint64_t *bar)
{
  asm volatile ("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr (bar)) : "memory");
}

__device__ __forceinline__ void
mbar_wait (uint64_t *bar, unsigned parity)
{
  asm volatile ("{\n.reg .pred done;\nMOE_WAIT_%=:\n"
                "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                "@!done bra MOE_WAIT_%=;\n}\n" :: "r"(smem_addr (bar)), "r"(parity) : "memory");
}

/* box at (element k, row) of a 2-D tensor map into shared memory */
__device__ __forceinline__ void
tma_load (void *dst, const CUtensorMap *map, uint64_t *bar, int k, int row)
{
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                " [%0], [%1, {%3, %4}], [%2];\n"
                :: "r"(smem_addr (dst)), "l"(map), "r"(smem_addr (bar)), "r"(k), "r"(row) : "memory");
#endif
}

/* box at (element k, row) into the same place of every CTA in mask's
 * cluster, each CTA's bar counting its bytes */
__device__ __forceinline__ void
tma_load_multicast (void *dst, const CUtensorMap *map, uint64_t *bar, int k, int row, unsigned short mask)
{
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                " [%0], [%1, {%3, %4}], [%2], %5;\n"
                :: "r"(smem_addr (dst)), "l"(map), "r"(smem_addr (bar)), "r"(k), "r"(row), "h"(mask) : "memory");
#endif
}

/* an arrival on bar's twin in CTA rank of the cluster (the default
 * CTA-scope release: at cluster scope each arrival waited on a memory
 * barrier, a quarter of all stall samples; what it orders, the reads of
 * the stage's wgmmas, is complete before it anyway) */
__device__ __forceinline__ void
mbar_arrive_cluster (uint64_t *bar, unsigned rank)
{
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned remote;
  asm volatile ("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr (bar)), "r"(rank));
  asm volatile ("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" :: "r"(remote) : "memory");
#endif
}

/* every thread of every CTA in the cluster */
__device__ __forceinline__ void
cluster_sync ()
{
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile ("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}

/* 4 bytes global → shared without registers (zeros where !valid), and an
 * arrival on bar once this thread's copies so far have landed (counted in
 * the barrier's initial count): the thread goes on without waiting */
__device__ __forceinline__ void
cp_async4 (void *smem, const void *gmem, bool valid)
{
  asm volatile ("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(smem_addr (smem)), "l"(gmem), "r"(valid ? 4 : 0)
                : "memory");
}

[[maybe_unused]] __device__ __forceinline__ void
cp_async_arrive (uint64_t *bar)
{
  asm volatile ("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_addr (bar)) : "memory");
}

/* One CTA of the bulk-copy GEMM. With GATHER (gate/up of 16-bit x only:
 * sonicmoe's schedule) the producer warpgroup gathers A's rows from x by
 * token itself, cp.async into the swizzled stage, so no sorted copy of x
 * is made first; the weight tile still comes by bulk copy. */
template <typename T, int MODE, bool FP8, int KC, typename C, bool GATHER = false>
__device__ __forceinline__ void
tma_gemm (const CUtensorMap *ta, const CUtensorMap *tb, const MoeCudaExperts &p, const Route &r,
          const float *a_scale, void *dst, int n_tiles)
{
#if defined (__CUDA_ARCH_FEAT_SM90_ALL)
  using TOp = typename std::conditional<FP8, unsigned char, T>::type;
  constexpr int ES = sizeof (TOp), BK = WG_ROW_BYTES / ES;
  constexpr int BM = C::BM, BN = C::BN, STAGES = C::STAGES, STAGE_BYTES = C::STAGE_BYTES, CL = C::CLUSTER;
  static_assert (!FP8 || (C::CW == 2 && (BN == 128 || BN == 192)) || (BN == 96 && C::CW == 3),
                 "FP8 tiles are 128 × 128, 128 × 192 or 192 × 96");
  static_assert (CL == 1 || CL == 2, "clusters of one CTA or two");
  static_assert (!GATHER || (!FP8 && MODE == MODE_GATE_UP), "the gathering producer reads 16-bit x for gate/up");
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__ (8) uint64_t full[STAGES], empty[STAGES];
  /* FP8: each producer lane's share of a stage's scales, the rows' then
   * one per 8 columns (promote_fp8's), in a ring twice the stages': a
   * consumer hands a stage back once its products are done and promotes
   * them after, while the producer may fill the stage again, and its
   * scales' slot next */
  constexpr int PER_LANE = FP8 ? (BM + BN / 8 + 31) / 32 : 1, SCALE_SLOTS = FP8 ? 2 * STAGES : 1;
  __shared__ float s_scale[SCALE_SLOTS][32 * PER_LANE];
  __shared__ int s_token[GATHER ? BM : 1];   /* GATHER: the tile's rows' tokens */
  unsigned char *smem = (unsigned char *) (((uintptr_t) smem_raw + 1023) & ~(uintptr_t) 1023);
  const int K = KC != 0 ? KC : (MODE != MODE_GATE_UP ? p.inter : p.hidden);
  const int nw = MODE != MODE_GATE_UP ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const int ktiles = (K + BK - 1) / BK;
  const size_t S = (size_t) p.tokens * p.top_k;   /* rows of a_scale */
  /* Persistent: cluster c takes tile groups c, c + clusters, …, a group
   * being CL adjacent m-tiles of one expert (route counts each expert's
   * m-tiles in multiples of CL) at one n-tile, n-tiles fastest, so the
   * CTAs in flight share their m-tiles' rows of A; until they run past
   * the routed rows. Every thread walks the same tiles, and the ring's
   * stages and phases run on across them (it counts k-steps so far). */
  const int rank = blockIdx.x % CL, first = blockIdx.x / CL, step = gridDim.x / CL;
  Tile t;
  auto tile_at = [&] (int group) { return find_tile (r, p.num_experts, BM, group / n_tiles * CL + rank, &t); };

  /* launched overlapped (launch_tma): route's and the gather's output are
   * the kernels' before */
  pdl_begin ();
  /* route sorted this call for the other tile height: its kernel runs it
   * (the same answer for every CTA of the cluster) */
  if (*r.tile_bm != BM)
    return;

  if (threadIdx.x == 0)
    {
      for (int s = 0; s < STAGES; s++)
        {
          /* FP8: every producer lane's scale copies, and lane 0's bytes;
           * GATHER: lane 0's bytes and each producer thread's rows */
          mbar_init (&full[s], FP8 ? 33 : GATHER ? 129 : 1);
          /* each consumer warp of every CTA the stage's copies reach */
          mbar_init (&empty[s], CL * C::CW * 4);
        }
      asm volatile ("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
  /* no copy lands in, or arrives at, a CTA before its barriers are set */
  if constexpr (CL > 1)
    cluster_sync ();
  else
    __syncthreads ();

  auto stage_a = [&] (int stage) { return smem + stage * STAGE_BYTES; };
  auto stage_b = [&] (int stage) { return smem + stage * STAGE_BYTES + BM * WG_ROW_BYTES; };
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;

  if (wg == 0)
    {
      /* the producer: warp 0, whose lane 0 issues the bulk copies (GATHER:
       * and warps 1-3, each gathering a quarter of A's rows) */
      asm volatile ("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(C::PRODUCER_REGS));
      if (GATHER || threadIdx.x < 32)
        {
          const int warp = threadIdx.x / 32;
          /* the tile's weight rows: one box, or the gate and up halves apart */
          const bool split = MODE == MODE_GATE_UP && p.has_gate && !p.interleaved;
          /* FP8 (float scales: run_grouped_tma converts UE8M0 ones): each
           * lane copies its share of a stage's scales asynchronously, the
           * stage's barrier counting them in; 8 columns' come from where
           * their first weight row's scales start (b_scale, -1 past the end) */
          const float *w_scale = (const float *) (MODE != MODE_GATE_UP ? p.down_scale : p.up_scale);
          int b_scale[PER_LANE];
          [[maybe_unused]] const T *x = (const T *) p.x;
          for (int group = first, it = 0; tile_at (group); group += step)
            {
              const int nt = group % n_tiles, row0 = tile_weight_row<MODE> (p, BN, nt, 0);
              const int wrow0 = t.e * nw + (split ? nt * (BN / 2) : row0 >= 0 ? row0 : 0);
              if (FP8)
                {
#pragma unroll
                  for (int j = 0; j < PER_LANE; j++)
                    {
                      const int c = 8 * (lane + 32 * j - BM);
                      const int row = c >= 0 && c < BN ? tile_weight_row<MODE> (p, BN, nt, c) : -1;
                      b_scale[j] = row >= 0 ? fp8_scale_row<MODE> (p, t.e, row) : -1;
                    }
                }
              if constexpr (GATHER)
                {
                  /* this warp's rows' tokens (-1 past the expert's rows) */
                  for (int i = lane; i < BM / 4; i += 32)
                    {
                      const int row = warp * (BM / 4) + i;
                      s_token[row] = row < t.rows ? r.sorted_pair[t.row0 + row] / p.top_k : -1;
                    }
                  __syncwarp ();
                }
              for (int kt = 0; kt < ktiles; kt++, it++)
                {
                  const int s = it % STAGES;
                  if (it >= STAGES)
                    mbar_wait (&empty[s], ((it / STAGES) + 1) & 1);
                  if (FP8)
                    {
                      float *slot = s_scale[it % SCALE_SLOTS];
#pragma unroll
                      for (int j = 0; j < PER_LANE; j++)
                        {
                          const int i = lane + 32 * j;
                          if (i < BM)
                            cp_async4 (slot + i, i < t.rows ? a_scale + kt * S + t.row0 + i : a_scale, i < t.rows);
                          else
                            cp_async4 (slot + i, b_scale[j] >= 0 ? w_scale + b_scale[j] + kt : w_scale, b_scale[j] >= 0);
                        }
                      cp_async_arrive (&full[s]);
                    }
                  if (threadIdx.x == 0)
                    {
                      mbar_expect_tx (&full[s], GATHER ? STAGE_BYTES - BM * WG_ROW_BYTES : STAGE_BYTES);
                      if constexpr (!GATHER)
                        tma_load (stage_a (s), ta, &full[s], kt * BK, t.row0);
                      if constexpr (CL > 1)
                        /* this CTA's half of the weight tile, into both */
                        tma_load_multicast (stage_b (s) + rank * (BN / 2) * WG_ROW_BYTES, tb, &full[s], kt * BK,
                                            split ? wrow0 + rank * p.inter : wrow0 + rank * (BN / 2), 0x3);
                      else if (split)
                        {
                          tma_load (stage_b (s), tb, &full[s], kt * BK, wrow0);
                          tma_load (stage_b (s) + (BN / 2) * WG_ROW_BYTES, tb, &full[s], kt * BK, wrow0 + p.inter);
                        }
                      else
                        tma_load (stage_b (s), tb, &full[s], kt * BK, wrow0);
                    }
                  if constexpr (GATHER)
                    {
                      /* lane l: 16-byte chunk l % 8 of rows l / 8, + 4, … */
                      const int ch = lane % 8, k = kt * BK + ch * 8;
#pragma unroll 4
                      for (int i = lane / 8; i < BM / 4; i += 4)
                        {
                          const int row = warp * (BM / 4) + i, token = s_token[row];
                          const bool ok = token >= 0 && k < K;
                          cp_async16 (stage_a (s) + swizzle128 (row, ch), ok ? x + (size_t) token * K + k : x, ok);
                        }
                      /* each producer thread arrives once its copies land */
                      cp_async_arrive (&full[s]);
                    }
                }
            }
        }
    }
  else
    {
      asm volatile ("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(C::CONSUMER_REGS));
      const int cw = wg - 1, warp_in_wg = (threadIdx.x % 128) / 32;
      const int row = cw * 64 + warp_in_wg * 16 + lane / 4;   /* of the tile: this thread's first */
      auto wait_full = [&] (int it) {
        mbar_wait (&full[it % STAGES], (it / STAGES) & 1);
        /* GATHER: A's rows came by cp.async, in the generic proxy; the
         * tensor cores read in the async one */
        if constexpr (GATHER)
          asm volatile ("fence.proxy.async.shared::cta;\n" ::: "memory");
      };
      auto stage_a_mine = [&] (int it) { return stage_a (it % STAGES) + cw * 64 * WG_ROW_BYTES; };
      /* this warp is done with a stage (its products waited for): one
       * arrival a warp, at every CTA whose copies the stage holds */
      auto release = [&] (int it) {
        __syncwarp ();
        if (lane == 0)
          {
            mbar_arrive (&empty[it % STAGES]);
            if constexpr (CL > 1)
              mbar_arrive_cluster (&empty[it % STAGES], rank ^ 1);
          }
      };
      float d[BN / 2];

      for (int group = first, it0 = 0; tile_at (group); group += step, it0 += ktiles)
        {
          const int nt = group % n_tiles;
          /* A warpgroup with no rows in its tile's part (an expert's last
           * m-tile; with skewed routing most experts fill one m-tile a
           * little; a cluster's padding m-tile) only hands the stages
           * back, in step with the ring, leaving the tensor cores to the
           * others. Its epilogue has its own barrier. */
          if (t.rows <= cw * 64)
            {
              for (int it = it0; it < it0 + ktiles; it++)
                {
                  wait_full (it);
                  release (it);
                }
              continue;
            }
#pragma unroll
          for (int i = 0; i < BN / 2; i++)
            d[i] = 0.0f;

          if constexpr (FP8)
            {
              /* One block's partial sums, scaled into d once its products are
               * done. (Two sets, the next block's products running during the
               * scaling, made ptxas serialize every wgmma: it sees the other
               * set's registers read while products are in flight.) */
              float part[BN / 2];
              /* the tile's K blocks, the promotion's form chosen once,
               * outside the loop (a branch inside it spilled the 128 × 192
               * tile's registers) */
              auto k_blocks = [&] (auto per32) {
                for (int it = it0; it < it0 + ktiles; it++)
                  {
                    wait_full (it);
                    unsigned char *sa = stage_a_mine (it), *sb = stage_b (it % STAGES);
                    asm volatile ("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                    for (int j = 0; j < 4; j++)
                      if constexpr (BN == 96)
                        wgmma_m64n96_fp8<TOp> (part, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32), j > 0);
                      else if constexpr (BN == 192)
                        wgmma_m64n192_fp8<TOp> (part, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32), j > 0);
                      else
                        wgmma_m64n128<TOp> (part, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32), j > 0);
                    asm volatile ("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                    asm volatile ("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                    release (it);
                    promote_fp8<BM, BN, decltype (per32)::value> (d, part, s_scale[it % SCALE_SLOTS], row);
                  }
              };
              if (fp8_scales_per_32<MODE> (p, BN))
                k_blocks (std::true_type ());
              else
                k_blocks (std::false_type ());
            }
          else
            {
              for (int it = it0; it < it0 + ktiles; it++)
                {
                  wait_full (it);
                  unsigned char *sa = stage_a_mine (it), *sb = stage_b (it % STAGES);
                  asm volatile ("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                  for (int j = 0; j < BK / 16; j++)
                    if constexpr (BN == 256)
                      wgmma_m64n256<TOp> (d, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32));
                    else if constexpr (BN == 192)
                      wgmma_m64n192<TOp> (d, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32));
                    else
                      wgmma_m64n128<TOp> (d, wgmma_desc (sa + j * 32), wgmma_desc (sb + j * 32), 1);
                  asm volatile ("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                  /* the previous step's products are done: hand its stage back */
                  asm volatile ("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                  if (it > it0)
                    release (it - 1);
                }
              asm volatile ("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
              release (it0 + ktiles - 1);
            }
          /* while the producer fills the ring with the next tile's operands */
          if (MODE == MODE_GATE_UP ? swiglu_plain (p) : p.down_bias == nullptr)
            finish_in_registers<T, MODE, BN> (p, r, d, cw, nt, t, dst);
          else
            drain_accumulators<T, MODE, BN> (p, r, d, (float *) (smem + STAGES * STAGE_BYTES) + cw * 64 * TM_EPI_LD,
                                             cw, nt, t, dst);
        }
    }
  /* no CTA leaves while the other's copies may still land in it or its
   * consumers still arrive at its barriers */
  if constexpr (CL > 1)
    cluster_sync ();
#else
  __trap ();
#endif
}

/* Rows in sorted order for the bulk tensor copies: row i of dst is x's
 * token of sorted row i (gate_up's A), for the rows that were routed. */
template <typename T>
__global__ void __launch_bounds__ (256)
gather_sorted (const T *x, Route r, int E, int top_k, int H, T *dst)
{
  const int row = blockIdx.x;

  pdl_begin ();
  if (row >= r.offsets[E])
    return;
  const uint4 *src = (const uint4 *) (x + (size_t) (r.sorted_pair[row] / top_k) * H);
  uint4 *out = (uint4 *) (dst + (size_t) row * H);
  for (int i = threadIdx.x; i < H * (int) sizeof (T) / 16; i += blockDim.x)
    out[i] = src[i];
}

/* x's e4m3 rows (@K bytes, a multiple of 16), quantized once a token
 * (@xq, scales @xs [⌈K/128⌉, @T]), in sorted order: row i of @q and
 * @scale ([⌈K/128⌉, @S]) is sorted row i's token's. A warp a row, its
 * loads all in flight before it stores; rows past the routed ones are
 * skipped. */
__global__ void __launch_bounds__ (256)
gather_fp8_sorted (const unsigned char *__restrict__ xq, const float *__restrict__ xs, Route r, int E, int top_k,
                   int T, int S, int K, unsigned char *__restrict__ q, float *__restrict__ scale)
{
  constexpr int U = 4;
  const int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = K / 16, G = (K + 127) / 128;

  pdl_begin ();
  if (row >= r.offsets[E])
    return;
  const int token = r.sorted_pair[row] / top_k;
  const uint4 *src = (const uint4 *) (xq + (size_t) token * K);
  uint4 *out = (uint4 *) (q + (size_t) row * K);
  for (int i0 = lane; i0 < n; i0 += 32 * U)
    {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; u++)
        if (i0 + 32 * u < n)
          v[u] = src[i0 + 32 * u];
#pragma unroll
      for (int u = 0; u < U; u++)
        if (i0 + 32 * u < n)
          out[i0 + 32 * u] = v[u];
    }
  for (int g = lane; g < G; g += 32)
    scale[(size_t) g * S + row] = xs[(size_t) g * T + token];
}

/* The dynamic activation scheme for the FP8 tensor cores: each row's
 * 128-wide groups scaled and rounded to e4m3 (fp8_group_scale,
 * fp8_quantize2), kept as bytes plus one float scale per
 * group ([⌈K/128⌉, rows]). With @gather, row i of the output is sorted row
 * i of @r (its token's x), and rows past the routed ones are skipped.
 *
 * A half-warp takes a group, 8 values a lane, and QUANT_UNROLL groups at
 * once (the block's 16 half-warps consecutive groups in each), their loads
 * all in flight before any is used (a block a row and a warp a group, 4
 * values a lane, took 77 µs a call on average in Qwen3's FP8 layer at 4096
 * tokens on an H100, this 60; two groups a thread instead of four, 56 —
 * four took 63 registers). rows · ⌈K/128⌉ < 2³¹ (a 32-bit group
 * index: a 64-bit division a group cost more than the loads). K a
 * multiple of 8, @in 16-byte and @q 8-byte aligned (launch_quantize_fp8
 * checks): one vector load and one vector store a lane. */
constexpr int QUANT_UNROLL = 2, QUANT_BLOCK_GROUPS = 16 * QUANT_UNROLL;

/* eight consecutive values from 16-byte aligned p, as floats */
__device__ __forceinline__ void
load8 (const float *p, float v[8])
{
  const float4 a = ((const float4 *) p)[0], b = ((const float4 *) p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void
load8 (const T *p, float v[8])
{
  const uint4 q = *(const uint4 *) p;
  const T *e = (const T *) &q;
#pragma unroll
  for (int i = 0; i < 8; i++)
    v[i] = to_f (e[i]);
}

template <typename T>
__global__ void __launch_bounds__ (256)
quantize_fp8 (const T *__restrict__ in, int rows, int K, unsigned char *__restrict__ q, float *__restrict__ scale,
              bool gather, Route r, int E, int top_k)
{
  constexpr int U = QUANT_UNROLL;
  const unsigned G = (K + 127) / 128, groups = (unsigned) rows * G;
  const int lane = threadIdx.x % 16;
  int row[U], k0[U];
  size_t src[U];
  bool ok[U];
  float v[U][8];

  pdl_begin ();
  const int live = gather ? r.offsets[E] : rows;
  /* group j's row and group in it: one division, then 16 groups on */
  unsigned j = blockIdx.x * QUANT_BLOCK_GROUPS + threadIdx.x / 16, jr = j / G, jg = j - jr * G;
#pragma unroll
  for (int u = 0; u < U; u++, j += 16)
    {
      if (u > 0)
        for (jg += 16; jg >= G; jg -= G)
          jr++;
      row[u] = (int) jr;
      k0[u] = (int) jg * 128 + 8 * lane;
      ok[u] = j < groups && row[u] < live;
      src[u] = !ok[u] ? 0 : gather ? (size_t) (r.sorted_pair[row[u]] / top_k) : (size_t) row[u];
    }
#pragma unroll
  for (int u = 0; u < U; u++)
    {
      if (ok[u] && k0[u] < K)
        load8 (in + src[u] * K + k0[u], v[u]);
      else
#pragma unroll
        for (int e = 0; e < 8; e++)
          v[u][e] = 0.0f;
    }
#pragma unroll
  for (int u = 0; u < U; u++)
    {
      /* every lane takes part in the half-warp's reduction */
      float amax = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; e++)
        amax = fmaxf (amax, fabsf (v[u][e]));
#pragma unroll
      for (int o = 8; o > 0; o /= 2)
        amax = fmaxf (amax, __shfl_xor_sync (0xffffffffu, amax, o));
      const Fp8Scale s = fp8_group_scale (amax);
      if (!ok[u])
        continue;
      if (k0[u] < K)
        {
          unsigned b[4];
#pragma unroll
          for (int e = 0; e < 4; e++)
            b[e] = fp8_quantize2 (v[u][2 * e], v[u][2 * e + 1], s);
          *(uint2 *) (q + (size_t) row[u] * K + k0[u]) = make_uint2 (b[0] | b[1] << 16, b[2] | b[3] << 16);
        }
      if (lane == 0)
        scale[(size_t) (k0[u] / 128) * rows + row[u]] = s.s;
    }
}

} /* namespace */
