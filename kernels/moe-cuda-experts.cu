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
#include "moe-cuda-gemm.cuh"
#include "moe-cuda-gemv.cuh"

#include <cuda.h>
#include <cublas_v2.h>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

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
  pdl_begin ();
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
#pragma unroll 8   /* the loads in flight together: this waits before any weight is read */
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

/* A token's bad expert ids (outside 0 … E, E the expert-parallel
 * sentinel) reported to the host through mapped memory, read at its next
 * synchronization; TRUE for a slot that has an expert to multiply */
__device__ __forceinline__ bool
check_slot (const MoeCudaExperts &p, int t, int k, long long id, bool report)
{
  if (report && (id < 0 || id > p.num_experts))
    {
      p.bad_id[1] = id;
      p.bad_id[0] = (long long) t * p.top_k + k + 1;
      __threadfence_system ();
    }
  return (unsigned long long) id < (unsigned long long) p.num_experts;
}

/* The weighted sum of each token's K slot outputs. EAGER: as transformers'
 * eager loop, expert by expert in ascending id order, each contribution
 * rounded to the dtype and added to the dtype-rounded sum (index_add_ on a
 * bf16 tensor); otherwise one float32 sum, rounded once. */
template <typename T, bool EAGER>
__global__ void __launch_bounds__ (256)
combine (MoeCudaExperts p, const T *y)
{
  pdl_begin ();
  __shared__ float wk[64];
  __shared__ int live[64], order[64];
  const int t = blockIdx.x, K = p.top_k, H = p.hidden;
  constexpr int V = 16 / sizeof (T);

  /* the ids are checked here, on the device */
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    {
      live[k] = check_slot (p, t, k, p.ids[(size_t) t * K + k], true);
      wk[k] = load_any (p.routing, p.routing_dtype, (size_t) t * K + k);
    }
  if (EAGER && threadIdx.x == 0)
    for (int k = 0; k < K; k++)
      {
        /* insertion sort of the slots by expert id (K ≤ 64) */
        int j = k;
        for (; j > 0 && p.ids[(size_t) t * K + order[j - 1]] > p.ids[(size_t) t * K + k]; j--)
          order[j] = order[j - 1];
        order[j] = k;
      }
  __syncthreads ();

  T *out = (T *) p.out + (size_t) t * H;
  if (H % V == 0)
    for (int n = threadIdx.x * V; n < H; n += blockDim.x * V)
      {
        float acc[V] = {};
        /* SLOTS slots' loads in flight together, then summed in order (one
         * load at a time, each waited for, was memory latency) */
        constexpr int SLOTS = 8;
        for (int i0 = 0; i0 < K; i0 += SLOTS)
          {
            uint4 v[SLOTS];
            int slot[SLOTS];   /* the j-th slot summed, or -1: none (past K, or a sentinel's) */
#pragma unroll
            for (int j = 0; j < SLOTS; j++)
              {
                const int k = i0 + j < K ? (EAGER ? order[i0 + j] : i0 + j) : 0;
                slot[j] = i0 + j < K && live[k] ? k : -1;
                if (slot[j] >= 0)
                  v[j] = *(const uint4 *) (y + ((size_t) t * K + k) * H + n);
              }
#pragma unroll
            for (int j = 0; j < SLOTS; j++)
              {
                if (slot[j] < 0)
                  continue;
                const T *e = (const T *) &v[j];
                const float w = wk[slot[j]];
#pragma unroll
                for (int q = 0; q < V; q++)
                  acc[q] = EAGER ? rnd<T> (acc[q] + rnd<T> (to_f (e[q]) * w)) : acc[q] + to_f (e[q]) * w;
              }
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
        for (int i = 0; i < K; i++)
          {
            int k = EAGER ? order[i] : i;
            if (!live[k])
              continue;
            float c = to_f (y[((size_t) t * K + k) * H + n]) * wk[k];
            acc = EAGER ? rnd<T> (acc + rnd<T> (c)) : acc + c;
          }
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
  unsigned char *xq8, *hq8; /* FP8 on the tensor cores: the e4m3 activations… */
  float *xs, *hs;           /* …and their scales, [rows, ⌈K/128⌉] */
  float *up_scale, *down_scale; /* …and UE8M0 weight scales as floats (the bulk-copy GEMMs') */
  unsigned char *xt8;       /* fp8_by_token: x's rows quantized once a token… */
  float *xts;               /* …and their scales, [⌈H/128⌉, tokens] */
  int *row_expert;
};

/* The bulk-copy GEMMs' FP8 x is quantized once a token, then its e4m3
 * rows and scales gathered in sorted order (gather_fp8_sorted, 16-byte
 * copies: H a multiple of 16), rather than quantized once a (token, slot)
 * row, each token's groups K times: Qwen3-30B-A3B's FP8 layer 2.4–3.7%
 * faster at T = 4096 and 16384 on an H100 (BENCHMARKS.md, thirty-eighth
 * session) */
bool
fp8_by_token (const MoeCudaExperts &p)
{
  return p.hidden % 16 == 0;
}

size_t
elem_size (int dtype)
{
  return dtype == MOE_CUDA_F32 ? 4 : 2;
}

/* FP8 batched_mm on the tensor cores (rowwise_fp8): gated K-major weights,
 * H and I multiples of 16, 16-byte aligned, a row's e4m3 copy and scales
 * within 48 KB of shared memory, a GPU whose tensor cores take e4m3 */
size_t
fp8_row_smem (int K)
{
  return (size_t) K + 4 * (size_t) ((K + 127) / 128);
}

bool
fp8_rowwise_mma (const MoeCudaExperts &p)
{
  return p.weight_format == MOE_CUDA_WEIGHTS_FP8 && !p.transposed && p.has_gate && p.hidden % 16 == 0 &&
         p.inter % 16 == 0 && (((uintptr_t) p.up | (uintptr_t) p.down) % 16) == 0 &&
         fp8_row_smem (p.hidden) <= 48 * 1024 && fp8_row_smem (p.inter) <= 48 * 1024 && device_has_fp8_mma ();
}

/* How the grouped schedules (grouped, deepgemm, fused) run their GEMMs:
 * bulk tensor copies + warp-specialized wgmma where rows are 16-byte
 * aligned, cp.async + wgmma where they are only 8-byte aligned (both on
 * Hopper, K-major weights), else the mma.sync / plain-float kernels. FP8
 * weights on the tensor cores take e4m3 activations with their scales.
 * Few rows an expert too: with that few the weights' bytes are the cost,
 * which the bulk copies stream faster than the small mma.sync tiles (H100,
 * grouped_mm: +5-7% at 8 and 64 tokens on the Qwen shapes, +22-43% at 512,
 * against the mma.sync tiles below 64 rows an expert). */
enum GemmPath { PATH_OTHER, PATH_WGMMA, PATH_TMA };

GemmPath
hopper_path (const MoeCudaExperts &p, int schedule)
{
  const bool fp8 = p.weight_format == MOE_CUDA_WEIGHTS_FP8;
  const int es = fp8 ? 1 : 2;

  if (schedule != MOE_CUDA_GROUPED && schedule != MOE_CUDA_DEEPGEMM && schedule != MOE_CUDA_FUSED)
    return PATH_OTHER;
  if (!device_is_sm90 () || p.transposed || p.weight_format == MOE_CUDA_WEIGHTS_FP4)
    return PATH_OTHER;
  if ((!fp8 && elem_size (p.dtype) != 2) || p.hidden % 8 != 0 || p.inter % 8 != 0)
    return PATH_OTHER;
  return (p.hidden * es) % 16 == 0 && (p.inter * es) % 16 == 0 ? PATH_TMA : PATH_WGMMA;
}

/* FP8: how many block scales up's and down's weight scale tensors hold */
void
fp8_scale_counts (const MoeCudaExperts &p, size_t *up_n, size_t *down_n)
{
  const size_t hb = (p.hidden + 127) / 128, ib = (p.inter + 127) / 128;
  *up_n = (size_t) p.num_experts * p.up_scale_rows * hb;
  *down_n = (size_t) p.num_experts * hb * ib;
}

/* Whether sonicmoe's gate/up gathers x's rows itself: below a wide
 * m-tile's 128 rows an expert, where the weights' bytes are the cost
 * (H100: 1-3% faster than the gather pass at 512 tokens of the Qwen and
 * DeepSeek-V3 shapes); from there on its copies fall behind the bulk
 * copies of the sorted rows (H100: Qwen1.5-MoE's layer at 4096 tokens,
 * 273 rows an expert, 23% slower; Mixtral's at 512, 128 rows, 20% with
 * an earlier form of the producer), so it gathers first. */
bool
fused_gathers (const MoeCudaExperts &p)
{
  return (long) p.tokens * p.top_k < 128L * p.num_experts;
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

  /* route's counts and cursors where the experts outnumber its shared memory's 1,024 */
  w->r.counts = (int *) take (2 * E * sizeof (int));
  w->r.cursor = w->r.counts != nullptr ? w->r.counts + E : nullptr;
  w->r.offsets = (int *) take ((E + 1) * sizeof (int));
  w->r.tile_start = (int *) take ((E + 1) * sizeof (int));
  w->r.sorted_pair = (int *) take (S * sizeof (int));
  w->r.chunk_counts = (int *) take ((S + ROUTE_CHUNK - 1) / ROUTE_CHUNK * E * sizeof (int));
  w->r.tile_bm = (int *) take (sizeof (int));
  w->h = take (S * p->inter * es);
  w->y = take (S * p->hidden * es);
  if (schedule == MOE_CUDA_PER_EXPERT)
    {
      w->row_expert = (int *) take (S * sizeof (int));
      w->xg = take (S * p->hidden * es);
      w->u = take (S * upn * es);
      w->ys = take (S * p->hidden * es);
    }
  const GemmPath path = hopper_path (*p, schedule);
  if (p->weight_format == MOE_CUDA_WEIGHTS_PLAIN && path == PATH_TMA && !(schedule == MOE_CUDA_FUSED && fused_gathers (*p)))
    w->xg = take (S * p->hidden * es);   /* the gather for the bulk copies */
  if (p->weight_format == MOE_CUDA_WEIGHTS_FP8 && path != PATH_OTHER)
    {
      /* the bulk copies read x gathered in sorted order, cp.async by token */
      size_t rows = path == PATH_TMA ? S : (size_t) p->tokens;
      w->xq8 = (unsigned char *) take (rows * p->hidden);
      w->xs = (float *) take (rows * ((p->hidden + 127) / 128) * sizeof (float));
      w->hq8 = (unsigned char *) take (S * p->inter);
      w->hs = (float *) take (S * ((p->inter + 127) / 128) * sizeof (float));
      if (path == PATH_TMA && fp8_by_token (*p))
        {
          w->xt8 = (unsigned char *) take ((size_t) p->tokens * p->hidden);
          w->xts = (float *) take ((size_t) p->tokens * ((p->hidden + 127) / 128) * sizeof (float));
        }
      if (path == PATH_TMA && p->scale_dtype == MOE_CUDA_E8M0)
        {
          size_t up_n, down_n;
          fp8_scale_counts (*p, &up_n, &down_n);
          w->up_scale = (float *) take (up_n * sizeof (float));
          w->down_scale = (float *) take (down_n * sizeof (float));
        }
    }
  else if (p->weight_format != MOE_CUDA_WEIGHTS_PLAIN && !(schedule == MOE_CUDA_PER_ROW && fp8_rowwise_mma (*p)))
    {
      w->xq = (float *) take ((size_t) p->tokens * p->hidden * sizeof (float));
      w->hq = (float *) take (S * p->inter * sizeof (float));
    }
  return off;
}

/* quantize_fp8 of @rows rows of K values, QUANT_BLOCK_GROUPS groups a
 * block; nullptr, or what the rows lack (the Hopper paths that run it
 * need K a multiple of 8 already) */
template <typename T>
const char *
launch_quantize_fp8 (const T *in, int rows, int K, unsigned char *q, float *scale, cudaStream_t s,
                     bool gather = false, Route r = Route (), int E = 0, int top_k = 1)
{
  const long groups = (long) rows * ((K + 127) / 128);

  if (K % 8 != 0 || (uintptr_t) in % 16 != 0 || (uintptr_t) q % 8 != 0)
    return "FP8 activations need rows of a multiple of 8 values, 16-byte aligned";
  if (groups >= (1L << 31))
    return "too many rows of FP8 activations for one call";
  if (groups > 0)
    launch_overlapped (quantize_fp8<T>, (unsigned) ((groups + QUANT_BLOCK_GROUPS - 1) / QUANT_BLOCK_GROUPS), 256, 0,
                       s, in, rows, K, q, scale, gather, r, E, top_k);
  return nullptr;
}

/* route's sort of the (token, slot) rows by expert: one block, or past a
 * chunk of rows (at most 1,024 experts) a block a chunk */
void
launch_route (const MoeCudaExperts &p, int bm, const Route &r, TileChoice choice, cudaStream_t s)
{
  const int S = p.tokens * p.top_k, E = p.num_experts, chunks = (S + ROUTE_CHUNK - 1) / ROUTE_CHUNK;

  if (chunks <= 1 || E > 1024)
    {
      launch_overlapped (route, 1, 1024, 0, s, p.ids, S, E, bm, r, choice);
      return;
    }
  launch_overlapped (route_count, chunks, 1024, 0, s, p.ids, S, E, r);
  launch_overlapped (route_scatter, chunks, 1024, 0, s, p.ids, S, E, bm, r, choice);
}

template <typename T>
const char *
launch_combine (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s, bool eager = false)
{
  if (eager)
    launch_overlapped (combine<T, true>, p.tokens, 256, 0, s, p, (const T *) w.y);
  else
    launch_overlapped (combine<T, false>, p.tokens, 256, 0, s, p, (const T *) w.y);
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

  launch_route (p, (int) C::BM, w.r, TileChoice (), s);
  cudaFuncSetAttribute (k_gu, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) C::SMEM);
  cudaFuncSetAttribute (k_dn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) C::SMEM);
  k_gu<<<m_slots * nt_gu, 256, C::SMEM, s>>> (p, w.r, (const T *) p.x, (T *) w.h, nt_gu);
  k_dn<<<m_slots * nt_dn, 256, C::SMEM, s>>> (p, w.r, (const T *) w.h, (T *) w.y, nt_dn);
  return launch_combine<T> (p, w, s);
}

template <typename T, int MODE, bool FP8>
__global__ void __launch_bounds__ (256)
grouped_gemm_wgmma (MoeCudaExperts p, Route r, const void *a_base, const float *a_scale, void *dst, int n_tiles)
{
  wgmma_gemm<T, MODE, FP8, 0> (p, r, a_base, a_scale, dst, n_tiles);
}

const char *
launch_wgmma (const void *kernel, long tiles, MoeCudaExperts p, Route r, const void *a, const float *a_scale,
              void *dst, int n_tiles, cudaStream_t s)
{
  void *args[] = { &p, &r, &a, &a_scale, &dst, &n_tiles };
  cudaError_t err = cudaFuncSetAttribute (kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) WG_SMEM);
  if (err == cudaSuccess)
    err = cudaLaunchKernel (kernel, dim3 ((unsigned) tiles), dim3 (256), args, WG_SMEM, s);
  return err == cudaSuccess ? nullptr : cudaGetErrorString (err);
}

/* Routes, then both wgmma grouped GEMMs: @k_gu and @k_dn are the ahead-of-
 * time kernels, or the deepgemm schedule's just-in-time ones. FP8 weights
 * get their activations quantized to e4m3 first, each projection's. */
template <typename T, bool FP8>
const char *
run_grouped_wgmma (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s, const void *k_gu, const void *k_dn)
{
  const int S = p.tokens * p.top_k, E = p.num_experts;
  const long m_slots = (S + WG_BM - 1) / WG_BM + (long) (E < S ? E : S);
  const int outs = p.has_gate ? WG_BN / 2 : WG_BN;
  const int nt_gu = (p.inter + outs - 1) / outs, nt_dn = (p.hidden + WG_BN - 1) / WG_BN;
  const void *x = p.x, *h = w.h;
  const float *xs = nullptr, *hs = nullptr;
  const char *msg;

  launch_route (p, (int) WG_BM, w.r, TileChoice (), s);
  if (FP8)
    {
      if ((msg = launch_quantize_fp8 ((const T *) p.x, p.tokens, p.hidden, w.xq8, w.xs, s)) != nullptr)
        return msg;
      x = w.xq8, xs = w.xs;
    }
  if ((msg = launch_wgmma (k_gu, m_slots * nt_gu, p, w.r, x, xs, w.h, nt_gu, s)) != nullptr)
    return msg;
  if (FP8)
    {
      /* h rows are sorted, and only the routed ones were written (or read) */
      if ((msg = launch_quantize_fp8 ((const T *) w.h, S, p.inter, w.hq8, w.hs, s)) != nullptr)
        return msg;
      h = w.hq8, hs = w.hs;
    }
  if ((msg = launch_wgmma (k_dn, m_slots * nt_dn, p, w.r, h, hs, w.y, nt_dn, s)) != nullptr)
    return msg;
  return launch_combine<T> (p, w, s);
}

template <typename T, bool FP8>
const char *
run_grouped_wgmma_aot (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  return run_grouped_wgmma<T, FP8> (p, w, s, (const void *) grouped_gemm_wgmma<T, MODE_GATE_UP, FP8>,
                                    (const void *) grouped_gemm_wgmma<T, MODE_DOWN, FP8>);
}

typedef CUresult (*EncodeTiled) (CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                 const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* The driver's tensor-map encoder, through the runtime (no link to libcuda). */
EncodeTiled
encode_tiled ()
{
  static EncodeTiled fn = nullptr;
  static bool looked = false;
  if (!looked)
    {
      void *ptr = nullptr;
      cudaDriverEntryPointQueryResult q;
      looked = true;
      if (cudaGetDriverEntryPointByVersion ("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) == cudaSuccess &&
          q == cudaDriverEntryPointSuccess)
        fn = (EncodeTiled) ptr;
      cudaGetLastError ();
    }
  return fn;
}

/* rows × cols elements of es bytes; boxes of one 128-byte swizzled row
 * span × box_rows rows (what wgmma_desc describes) */
const char *
make_tensor_map (CUtensorMap *map, const void *base, int es, size_t rows, int cols, int box_rows)
{
  EncodeTiled encode = encode_tiled ();
  cuuint64_t dims[2] = { (cuuint64_t) cols, (cuuint64_t) (rows > 0 ? rows : 1) };
  cuuint64_t strides[1] = { (cuuint64_t) cols * es };
  cuuint32_t box[2] = { (cuuint32_t) (WG_ROW_BYTES / es), (cuuint32_t) box_rows };
  cuuint32_t elem_strides[2] = { 1, 1 };

  if (encode == nullptr)
    return "the CUDA driver has no cuTensorMapEncodeTiled";
  if (encode (map, es == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, (void *) base, dims,
              strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled refused a tensor map";
  return nullptr;
}

template <typename T, int MODE, bool FP8, typename C, bool GATHER = false>
__global__ void __launch_bounds__ (C::THREADS, 1)
grouped_gemm_tma (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb, MoeCudaExperts p,
                  Route r, const float *a_scale, void *dst, int n_tiles)
{
  tma_gemm<T, MODE, FP8, 0, C, GATHER> (&ta, &tb, p, r, a_scale, dst, n_tiles);
}

template <typename C>
const char *
launch_tma (const void *kernel, long tiles, const void *a, int es, size_t a_rows, const void *w,
            size_t w_rows, int k, int w_box_rows, MoeCudaExperts p, Route r, const float *a_scale, void *dst,
            int n_tiles, cudaStream_t s)
{
  CUtensorMap ta, tb;
  const char *msg;
  void *args[] = { &ta, &tb, &p, &r, &a_scale, &dst, &n_tiles };
  cudaError_t err;

  if ((msg = make_tensor_map (&ta, a, es, a_rows, k, C::BM)) != nullptr ||
      (msg = make_tensor_map (&tb, w, es, w_rows, k, w_box_rows)) != nullptr)
    return msg;
  /* persistent: one CTA an SM (what the shared memory allows), or one
   * cluster of CTAs on as many SMs, as many as run at once, each taking
   * tiles (tile groups: CTAs a cluster) until they run out */
  int device, slots = 0;
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = {};
  const long groups = (tiles + C::CLUSTER - 1) / C::CLUSTER;

  /* overlapped with the kernel before (its blocks start as that one's
   * leave; the kernel waits for it first: pdl_begin) */
  cfg.attrs = attr;
  if (pdl_enabled ())
    {
      attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
  if (C::CLUSTER > 1)
    {
      attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
      attr[cfg.numAttrs].val.clusterDim.x = C::CLUSTER, attr[cfg.numAttrs].val.clusterDim.y = 1;
      attr[cfg.numAttrs++].val.clusterDim.z = 1;
    }
  cfg.gridDim = dim3 (C::CLUSTER);
  cfg.blockDim = dim3 (C::THREADS);
  cfg.dynamicSmemBytes = C::SMEM;
  cfg.stream = s;
  err = cudaFuncSetAttribute (kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) C::SMEM);
  if (err == cudaSuccess && C::CLUSTER == 1)
    err = cudaGetDevice (&device);
  if (err == cudaSuccess)
    err = C::CLUSTER == 1 ? cudaDeviceGetAttribute (&slots, cudaDevAttrMultiProcessorCount, device)
                          : cudaOccupancyMaxActiveClusters (&slots, kernel, &cfg);
  if (err == cudaSuccess && slots == 0)
    return "no cluster of the bulk-copy GEMM fits on this GPU";
  cfg.gridDim = dim3 ((unsigned) (C::CLUSTER * (groups < slots ? groups : slots)));
  if (err == cudaSuccess)
    err = cudaLaunchKernelExC (&cfg, kernel, args);
  return err == cudaSuccess ? nullptr : cudaGetErrorString (err);
}

/* The bulk-copy GEMM kernels of one tile shape: gate/up's, down's. */
struct TmaKernels {
  const void *gate_up, *down;
};

/* n-tiles of tile shape C in gate/up (mode MODE_GATE_UP: gated tiles hold
 * BN / 2 outputs) or in down */
template <typename C>
int
tma_n_tiles (const MoeCudaExperts &p, int mode)
{
  const int outs = p.has_gate ? C::BN / 2 : C::BN;
  return mode == MODE_GATE_UP ? (p.inter + outs - 1) / outs : (p.hidden + C::BN - 1) / C::BN;
}

/* MOE_CUDA_TILE=wide, pairs (FP8: the wide tile's large form) or tall
 * forces the bulk-copy GEMMs' tile shape where route chooses one (Hopper),
 * for measuring (tools/gpu-run.sh tiles); any other value is no force */
enum ForcedTile { TILE_ROUTED, TILE_WIDE, TILE_PAIRS, TILE_TALL };

ForcedTile
forced_tile ()
{
  static const ForcedTile tile = [] {
    const char *v = getenv ("MOE_CUDA_TILE");
    if (v == nullptr)
      return TILE_ROUTED;
    return strcmp (v, "wide") == 0 ? TILE_WIDE : strcmp (v, "pairs") == 0 ? TILE_PAIRS
                                               : strcmp (v, "tall") == 0  ? TILE_TALL
                                                                          : TILE_ROUTED;
  }();
  return tile;
}

/* What one m-tile of shape C costs, gate/up and down together (route's
 * TileChoice), in bytes loaded from L2: its operand bytes, rows and
 * weights (a CTA of a pair, which loads half the weight tile, counting
 * 3/4 of it: the pair's CTAs keep each other's pace, its padding m-tile
 * too), plus its products, padding included, at 48 FLOPs a byte (96 for
 * FP8, whose tensor cores run twice as fast). Bytes alone picked the
 * pairs where the tall tile was faster from ~384 rows an expert
 * (Qwen3-30B-A3B at 6,144 and 8,192 tokens: 4%, 9%). Over a forced-tile
 * table (H100, 36 points of three layers, bf16 and FP8: BENCHMARKS.md,
 * thirty-fifth session) a script's replica of the choice, from the rows
 * each expert would get, picks the fastest within 1% at 32 with the
 * products (the same from 40 to 80 FLOPs a byte), at 28 by bytes alone. */
template <typename C>
long long
tma_m_tile_cost (const MoeCudaExperts &p)
{
  const bool fp8 = p.weight_format == MOE_CUDA_WEIGHTS_FP8;
  const long long es = fp8 ? 1 : 2, flops_a_byte = fp8 ? 96 : 48;
  const long long weights = C::CLUSTER > 1 ? C::BN * 3 / 4 : C::BN;
  const long long per_k = (C::BM + weights) * es + 2LL * C::BM * C::BN / flops_a_byte;
  return per_k *
         ((long long) tma_n_tiles<C> (p, MODE_GATE_UP) * p.hidden + (long long) tma_n_tiles<C> (p, MODE_DOWN) * p.inter);
}

/* One projection with tile shape C: a = the sorted rows (x gathered, or
 * h), or for a gathering gate/up x itself (its tensor map unused) */
template <typename C>
const char *
launch_tma_projection (int mode, const TmaKernels &k, const MoeCudaExperts &p, const Workspace &w, const void *a,
                       int es, const float *as, cudaStream_t s)
{
  const size_t a_rows = a == p.x ? (size_t) p.tokens : (size_t) p.tokens * p.top_k;
  const int S = p.tokens * p.top_k, E = p.num_experts, nt = tma_n_tiles<C> (p, mode);
  /* at most: every m-tile full, and each expert's last and its cluster's padding not */
  const long m_slots = (S + C::BM - 1) / C::BM + (long) C::CLUSTER * (E < S ? E : S);
  const bool split = p.has_gate && !p.interleaved;
  /* weight boxes: the gate and up halves apart, or a cluster CTA's half */
  const bool halves = split || C::CLUSTER > 1;

  if (mode == MODE_GATE_UP)
    return launch_tma<C> (k.gate_up, m_slots * nt, a, es, a_rows, p.up, (size_t) E * (p.has_gate ? 2 * p.inter : p.inter),
                          p.hidden, halves ? C::BN / 2 : C::BN, p, w.r, as, w.h, nt, s);
  return launch_tma<C> (k.down, m_slots * nt, a, es, S, p.down, (size_t) E * p.hidden, p.inter,
                        C::CLUSTER > 1 ? C::BN / 2 : C::BN, p, w.r, as, w.y, nt, s);
}

/* UE8M0 scales as floats (2^(e − 127)) */
__global__ void __launch_bounds__ (256)
e8m0_to_float (const unsigned char *in, size_t n, float *out)
{
  const size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    out[i] = e8m0_to_f (in[i]);
}

/* As run_grouped_wgmma, with the bulk-copy GEMMs: x is first gathered (and
 * for FP8 quantized) into sorted rows, which the copies read in boxes —
 * unless GATHER, where gate/up's kernels gather x's rows themselves. With
 * a second tile shape D (kd), route picks C or D on the device from the
 * rows each expert got, and both kernels are launched: the other returns at
 * once (no host sync; a graph can hold it). */
template <typename T, bool FP8, typename C, typename D = C, bool GATHER = false>
const char *
run_grouped_tma (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s, const TmaKernels &kc,
                 const TmaKernels &kd = {})
{
  static_assert (!GATHER || !FP8, "gate/up gathers 16-bit x");
  constexpr bool two = !std::is_same<C, D>::value;
  const int S = p.tokens * p.top_k, E = p.num_experts, es = FP8 ? 1 : 2;
  TileChoice choice = { two ? D::BM : 0, tma_m_tile_cost<C> (p), tma_m_tile_cost<D> (p), C::CLUSTER, D::CLUSTER };
  if (forced_tile () != TILE_ROUTED)
    choice.forced = forced_tile () == TILE_TALL ? 2 : 1;
  const void *a;
  const float *as = nullptr;
  const char *msg;

  if (FP8 && p.scale_dtype == MOE_CUDA_E8M0)
    {
      /* the GEMMs' producers copy weight scales as they are, as floats */
      MoeCudaExperts q = p;
      size_t up_n, down_n;
      fp8_scale_counts (p, &up_n, &down_n);
      e8m0_to_float<<<(unsigned) ((up_n + 255) / 256), 256, 0, s>>> ((const unsigned char *) p.up_scale, up_n, w.up_scale);
      e8m0_to_float<<<(unsigned) ((down_n + 255) / 256), 256, 0, s>>> ((const unsigned char *) p.down_scale, down_n,
                                                                         w.down_scale);
      q.up_scale = w.up_scale, q.down_scale = w.down_scale, q.scale_dtype = MOE_CUDA_F32;
      return run_grouped_tma<T, FP8, C, D, GATHER> (q, w, s, kc, kd);
    }
  launch_route (p, (int) C::BM, w.r, choice, s);
  if (FP8 && fp8_by_token (p))
    {
      if ((msg = launch_quantize_fp8 ((const T *) p.x, p.tokens, p.hidden, w.xt8, w.xts, s)) != nullptr)
        return msg;
      launch_overlapped (gather_fp8_sorted, (unsigned) ((S + 7) / 8), 256, 0, s, (const unsigned char *) w.xt8,
                         (const float *) w.xts, w.r, E, p.top_k, p.tokens, S, p.hidden, w.xq8, w.xs);
      a = w.xq8, as = w.xs;
    }
  else if (FP8)
    {
      msg = launch_quantize_fp8 ((const T *) p.x, S, p.hidden, w.xq8, w.xs, s, true, w.r, E, p.top_k);
      if (msg != nullptr)
        return msg;
      a = w.xq8, as = w.xs;
    }
  else if (GATHER)
    a = p.x;
  else
    {
      launch_overlapped (gather_sorted<T>, S, 256, 0, s, (const T *) p.x, w.r, E, p.top_k, p.hidden, (T *) w.xg);
      a = w.xg;
    }
  if ((msg = launch_tma_projection<C> (MODE_GATE_UP, kc, p, w, a, es, as, s)) != nullptr ||
      (two && (msg = launch_tma_projection<D> (MODE_GATE_UP, kd, p, w, a, es, as, s)) != nullptr))
    return msg;
  a = w.h;
  if (FP8)
    {
      /* h rows are sorted, and only the routed ones were written (or read) */
      if ((msg = launch_quantize_fp8 ((const T *) w.h, S, p.inter, w.hq8, w.hs, s)) != nullptr)
        return msg;
      a = w.hq8, as = w.hs;
    }
  if ((msg = launch_tma_projection<C> (MODE_DOWN, kc, p, w, a, es, as, s)) != nullptr ||
      (two && (msg = launch_tma_projection<D> (MODE_DOWN, kd, p, w, a, es, as, s)) != nullptr))
    return msg;
  return launch_combine<T> (p, w, s);
}

template <typename T, bool FP8, typename C, bool GATHER = false>
TmaKernels
tma_kernels ()
{
  return { (const void *) grouped_gemm_tma<T, MODE_GATE_UP, FP8, C, GATHER>,
           (const void *) grouped_gemm_tma<T, MODE_DOWN, FP8, C> };
}

/* Whether the wide tile takes its form for many rows an expert
 * (TmaWideLarge), route then choosing it or the tall tile: bf16/f16 from
 * 128 (token, slot) rows an expert on average (H100: the single wide tile
 * was the slowest of the three at every point from 128 rows up, by 6-42%
 * against the pairs; where the pairs' second m-tile is mostly padding the
 * cost picks the tall tile); FP8 from 256: its 128 × 192 was up to 9% faster
 * than its 128 × 128 from 256 rows on the Qwen layers, but 8.6% slower
 * on DeepSeek-V3's at 128 (BENCHMARKS.md, thirty-fifth session) */
bool
large_tiles (const MoeCudaExperts &p)
{
  if (forced_tile () == TILE_WIDE || forced_tile () == TILE_PAIRS)
    return forced_tile () == TILE_PAIRS;

  const long from = p.weight_format == MOE_CUDA_WEIGHTS_FP8 ? 256 : 128;
  return (long) p.tokens * p.top_k >= from * p.num_experts;
}

/* The wide tile or the tall one, route's choice; GATHER: gate/up gathers
 * x's rows itself (sonicmoe's schedule, below 128 rows an expert, where
 * the wide tile's large form never runs: not even a forced one) */
template <typename T, bool FP8, bool GATHER = false>
const char *
run_grouped_tma_aot (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  using Tall = TmaTall<FP8>;
  if constexpr (!FP8 && sizeof (T) != 2)
    return "the bf16/f16 tensor-core path got another dtype";
  else
    {
      if constexpr (!GATHER)
        if (large_tiles (p))
          return run_grouped_tma<T, FP8, TmaWideLarge<FP8>, Tall> (p, w, s, tma_kernels<T, FP8, TmaWideLarge<FP8>> (),
                                                                   tma_kernels<T, FP8, Tall> ());
      return run_grouped_tma<T, FP8, TmaWide<FP8>, Tall, GATHER> (p, w, s, tma_kernels<T, FP8, TmaWide<FP8>, GATHER> (),
                                                                  tma_kernels<T, FP8, Tall, GATHER> ());
    }
}

/* sonicmoe's schedule: the gather of x fused into gate_up (its producer
 * warps copy rows by token: no gathered copy of x, no gather pass) where
 * fused_gathers says it pays, the activation into its epilogue, bias and
 * un-permute into down's, then the combine: four kernels, the bulk-copy
 * GEMMs' tiles. bf16 experts on bf16 hidden states; rows only 8-byte
 * aligned take the cp.async wgmma GEMMs, which gather the same way.
 * (Folding the combine into down's epilogue with float atomics measured
 * slower; so did a bulk copy a row for the gather: 58% at DeepSeek-V3's
 * layer, 4096 tokens.) */
const char *
run_fused (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  if (p.dtype != MOE_CUDA_BF16 || p.weight_format != MOE_CUDA_WEIGHTS_PLAIN)
    return "the fused schedule runs bf16 experts on bf16 hidden states";
  switch (hopper_path (p, MOE_CUDA_FUSED))
    {
    case PATH_TMA:
      return fused_gathers (p) ? run_grouped_tma_aot<__nv_bfloat16, false, true> (p, w, s)
                               : run_grouped_tma_aot<__nv_bfloat16, false> (p, w, s);
    case PATH_WGMMA:
      return run_grouped_wgmma_aot<__nv_bfloat16, false> (p, w, s);
    default:
      return "the fused schedule runs on Hopper (sm_90a) only";
    }
}

/* deepgemm: the grouped schedule on the Hopper tensor cores, with the
 * GEMMs the cuda device compiled for these shapes (bf16 activations). */
const char *
run_deepgemm (const MoeCudaExperts &p, const Workspace &w, cudaStream_t s)
{
  using B = __nv_bfloat16;
  const bool fp8 = p.weight_format == MOE_CUDA_WEIGHTS_FP8;

  if (p.jit_gate_up == nullptr || p.jit_down == nullptr || p.jit_tma_gate_up == nullptr || p.jit_tma_down == nullptr ||
      p.jit_tall_gate_up == nullptr || p.jit_tall_down == nullptr || p.jit_large_gate_up == nullptr ||
      p.jit_large_down == nullptr)
    return "the deepgemm schedule needs its just-in-time kernels";
  if (p.dtype != MOE_CUDA_BF16)
    return "deepgemm needs bfloat16 hidden states";
  switch (hopper_path (p, MOE_CUDA_DEEPGEMM))
    {
    case PATH_TMA:
      {
        const TmaKernels wide = { p.jit_tma_gate_up, p.jit_tma_down }, tall = { p.jit_tall_gate_up, p.jit_tall_down };
        const TmaKernels large = { p.jit_large_gate_up, p.jit_large_down };
        if (large_tiles (p))
          return fp8 ? run_grouped_tma<B, true, TmaWideLarge<true>, TmaTall<true>> (p, w, s, large, tall)
                     : run_grouped_tma<B, false, TmaWideLarge<false>, TmaTall<false>> (p, w, s, large, tall);
        return fp8 ? run_grouped_tma<B, true, TmaWide<true>, TmaTall<true>> (p, w, s, wide, tall)
                   : run_grouped_tma<B, false, TmaWide<false>, TmaTall<false>> (p, w, s, wide, tall);
      }
    case PATH_WGMMA:
      return fp8 ? run_grouped_wgmma<B, true> (p, w, s, p.jit_gate_up, p.jit_down)
                 : run_grouped_wgmma<B, false> (p, w, s, p.jit_gate_up, p.jit_down);
    default:
      return "deepgemm runs on Hopper (sm_90a) only";
    }
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

  launch_route (p, (int) SI_BM, w.r, TileChoice (), s);
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
  const bool fp8 = p.weight_format == MOE_CUDA_WEIGHTS_FP8;
  switch (hopper_path (p, MOE_CUDA_GROUPED))
    {
    case PATH_TMA:
      return fp8 ? run_grouped_tma_aot<T, true> (p, w, s) : run_grouped_tma_aot<T, false> (p, w, s);
    case PATH_WGMMA:
      if (fp8)
        return run_grouped_wgmma_aot<T, true> (p, w, s);
      if constexpr (sizeof (T) == 2)
        return run_grouped_wgmma_aot<T, false> (p, w, s);
      break;
    default:
      break;
    }
  if (fp8)
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
        return run_grouped_tc<T, TcTile<128, 2, 64, 3>> (p, w, s);
      }

  return run_grouped_simt<T, MOE_CUDA_WEIGHTS_PLAIN> (p, w, s);
}

/* The same on the tensor cores for bf16/f16 K-major weights (H and I
 * multiples of 8, 16-byte aligned): the decoder's few-row product
 * (moe-cuda-gemv.cuh) on each row's expert, a block per (row, 16 outputs),
 * rows fastest: rows that share an expert read its weights about together,
 * from L2 the second time (16 outputs fastest read them again from memory:
 * 10-17% slower at 8 tokens); M = 2 for gate/up pairs, and for down's
 * outputs n and n + 16 of 32 a block (H a multiple of 32). Nothing is
 * loaded before the wait: the expert comes from the router's ids. */
template <typename T, int MODE, int M>
__global__ void __launch_bounds__ (256)
rowwise_mma (MoeCudaExperts p, const T *src_rows, T *h, T *y)
{
  const int pair = blockIdx.x;
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int n_out = MODE == MODE_DOWN ? p.hidden : p.inter;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const T *src = MODE == MODE_DOWN ? src_rows + (size_t) pair * p.inter : src_rows + (size_t) (pair / p.top_k) * p.hidden;
  float s[M];
  int n, r;

  pdl_begin ();
  const long long id = p.ids[pair];
  if ((unsigned long long) id >= (unsigned long long) p.num_experts)
    return;
  const int e = (int) id;
  const T *w = (const T *) (MODE == MODE_DOWN ? p.down : p.up) + (size_t) e * nw * K;
  auto weight_row = [&] (int m, int o) {
    int gr = o, ur = o;
    if (MODE == MODE_DOWN)
      return w + (size_t) (o + 16 * m) * K;
    gate_up_rows (p, o, &gr, &ur);
    return w + (size_t) (m == 0 ? gr : ur) * K;
  };
  const int n0 = blockIdx.y * (MODE == MODE_DOWN ? 16 * M : 16);
  if (!gemv_mma_sums<T, 1, M> (weight_row, n0, n_out, K, src, K, 1, false, s, &n, &r))
    return;
  if (MODE == MODE_DOWN)
#pragma unroll
    for (int m = 0; m < M; m++)
      y[(size_t) pair * p.hidden + n + 16 * m] = from_f<T> (down_finish<T> (p, e, n + 16 * m, s[m]));
  else
    {
      int gr = n, ur = n;
      gate_up_rows (p, n, &gr, &ur);
      h[(size_t) pair * p.inter + n] = from_f<T> (gate_up_finish<T> (p, e, gr, ur, s[0], s[M - 1]));
    }
}

/* batched_mm's down product and the combine in one kernel, for up to KP
 * slots a token (bf16/f16 K-major weights, as rowwise_mma): a block per
 * (token, 16 outputs) multiplies the token's K rows of h by their experts'
 * down weights together — weight set m is slot m's expert and the K rows
 * are B's columns, of whose products only the diagonal (row m by expert m)
 * is kept: the tensor cores' spare columns cost nothing in a product bound
 * by the weights' bytes — then sums the slots as combine<T, false> does
 * (each slot's output rounded to T, times its routing weight, added in
 * slot order in float32, rounded once). One kernel fewer on a decode
 * step's critical path. */
template <typename T, int KP>
__global__ void __launch_bounds__ (256)
rowwise_down_combine (MoeCudaExperts p, const T *h)
{
  __shared__ float slot_out[KP][16];
  const int t = blockIdx.x, K = p.top_k, H = p.hidden, n0 = blockIdx.y * 16;
  long long id[KP];
  bool live[KP];
  float s[KP];
  int n, r;

  pdl_begin ();
  long long first = -1;   /* the first live slot's expert */
#pragma unroll
  for (int m = 0; m < KP; m++)
    {
      id[m] = m < K ? p.ids[(size_t) t * K + m] : -1;
      live[m] = m < K && check_slot (p, t, m, id[m], blockIdx.y == 0 && threadIdx.x == 0);
      if (live[m] && first < 0)
        first = id[m];
    }
  if (first < 0)
    {
      /* no expert for this token (all sentinels): zeros, as combine */
      if (threadIdx.x < 16 && n0 + (int) threadIdx.x < H)
        ((T *) p.out)[(size_t) t * H + n0 + threadIdx.x] = from_f<T> (0.0f);
      return;
    }
  /* a slot without an expert reads the first live slot's rows again (from
   * L1) and its product is dropped */
  auto weight_row = [&] (int m, int o) {
    return (const T *) p.down + ((size_t) (live[m] ? id[m] : first) * H + o) * p.inter;
  };
  const bool has = gemv_mma_sums<T, 1, KP> (weight_row, n0, H, p.inter, h + (size_t) t * K * p.inter, p.inter, K,
                                           false, s, &n, &r);
  if (has)
    {
      float d = 0.0f;
#pragma unroll
      for (int m = 0; m < KP; m++)
        if (m == r)
          d = live[m] ? rnd<T> (down_finish<T> (p, (int) id[m], n, s[m])) : 0.0f;
      slot_out[r][n - n0] = d;
    }
  __syncthreads ();
  if (threadIdx.x < 16 && n0 + (int) threadIdx.x < H)
    {
      float acc = 0.0f;
#pragma unroll
      for (int m = 0; m < KP; m++)
        if (live[m])
          acc += slot_out[m][threadIdx.x] * load_any (p.routing, p.routing_dtype, (size_t) t * K + m);
      ((T *) p.out)[(size_t) t * H + n0 + threadIdx.x] = from_f<T> (acc);
    }
}

/* FP8 weights on the tensor cores for one row's outputs, the dynamic
 * activation scheme made in the kernel: a block per (row, 16 outputs), rows
 * fastest as in rowwise_mma; M = 2 for gate/up pairs (the gated experts
 * FP8 checkpoints have); down: M groups of 16 outputs a block (fewer,
 * longer blocks). Warp w takes the 128-wide K blocks w, w + 8, …: it
 * quantizes the row's group of each into shared memory (load_group_fp8, as
 * quantize_fp8 does), then multiplies its 16 outputs' e4m3 weights by it
 * with m16n8k32 products, the row as B's
 * first column (the others zero), and adds each block's sum times the two
 * scales. A product's k order is free, so lane (g, q) loads the 16 bytes at
 * 16q and 64 + 16q of weight rows g and g + 8, and lanes 0-3 the row's
 * bytes at the same places: A and B fragments for four k32 steps. Needs K a
 * multiple of 16, 16-byte aligned weights, and ⌈K/128⌉ floats plus K bytes
 * of shared memory. */
template <typename T, int MODE, int M>
__global__ void __launch_bounds__ (256, 2)
rowwise_fp8 (MoeCudaExperts p, const T *src_rows, T *h, T *y)
{
  constexpr int WARPS = 8, U = 4 / M;   /* K blocks whose loads go out together */
  extern __shared__ uint4 rowwise_fp8_sm[];
  __shared__ float red[WARPS][M][16];
  /* down: M groups of 16 outputs a block */
  constexpr int OUTS = MODE == MODE_DOWN ? 16 * M : 16;
  const int pair = blockIdx.x, n0 = blockIdx.y * OUTS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int K = MODE == MODE_DOWN ? p.inter : p.hidden;
  const int n_out = MODE == MODE_DOWN ? p.hidden : p.inter;
  const int nw = MODE == MODE_DOWN ? p.hidden : (p.has_gate ? 2 * p.inter : p.inter);
  const int blocks = (K + 127) / 128;
  const T *src = MODE == MODE_DOWN ? src_rows + (size_t) pair * p.inter : src_rows + (size_t) (pair / p.top_k) * p.hidden;
  unsigned char *xq = (unsigned char *) rowwise_fp8_sm;
  float *xs = (float *) (xq + K);
  const uint4 zero = make_uint4 (0, 0, 0, 0);
  const uint4 *wrow[M][2];
  int srow[M][2];
  bool wok[M][2];
  uint4 wv[U][M][2][2];
  float wsc[U][M][2], acc[M][2] = {};

  pdl_begin ();
  const long long id = p.ids[pair];
  if ((unsigned long long) id >= (unsigned long long) p.num_experts)
    return;
  const int e = (int) id;
  const unsigned char *w = (const unsigned char *) (MODE == MODE_DOWN ? p.down : p.up) + (size_t) e * nw * K;
#pragma unroll
  for (int hf = 0; hf < 2; hf++)
#pragma unroll
    for (int m = 0; m < M; m++)
      {
        const int n = n0 + (MODE == MODE_DOWN ? 16 * m : 0) + g + 8 * hf;
        int gr = n, ur = n;
        wok[m][hf] = n < n_out;
        if (MODE == MODE_GATE_UP)
          gate_up_rows (p, wok[m][hf] ? n : n0, &gr, &ur);
        const int row = MODE == MODE_DOWN ? (wok[m][hf] ? n : n0) : (m == 0 ? gr : ur);
        wrow[m][hf] = (const uint4 *) (w + (size_t) row * K) + q;
        srow[m][hf] = fp8_scale_row<MODE> (p, e, row);
      }

  auto block_of = [&] (int j) { return warp + WARPS * j; };
  auto piece_in = [&] (int kb, int half) { return kb * 128 + 64 * half + 16 * q < K; };
  auto load_weights = [&] (int j0) {
#pragma unroll
    for (int u = 0; u < U; u++)
      {
        const int kb = block_of (j0 + u);
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
          for (int hf = 0; hf < 2; hf++)
            {
#pragma unroll
              for (int half = 0; half < 2; half++)
                wv[u][m][hf][half] = kb < blocks && wok[m][hf] && piece_in (kb, half)
                                       ? __ldg (wrow[m][hf] + 8 * kb + 4 * half) : zero;
              wsc[u][m][hf] = kb < blocks ? fp8_scale_at<MODE> (p, srow[m][hf] + kb) : 0.0f;
            }
      }
  };

  /* the weights go out first; meanwhile the warp quantizes its own groups */
  load_weights (0);
  for (int kb = warp; kb < blocks; kb += WARPS)
    {
      float v[4];
      const Fp8Scale s = load_group_fp8 (src, kb * 128, K, lane, v);
      const unsigned packed = fp8_quantize2 (v[0], v[1], s) | fp8_quantize2 (v[2], v[3], s) << 16;
      if (kb * 128 + 4 * lane < K)
        *(unsigned *) (xq + kb * 128 + 4 * lane) = packed;
      if (lane == 0)
        xs[kb] = s.s;
    }
  __syncwarp ();

  for (int j0 = 0; block_of (j0) < blocks; j0 += U)
    {
      if (j0 > 0)
        load_weights (j0);
#pragma unroll
      for (int u = 0; u < U; u++)
        {
          const int kb = block_of (j0 + u);
          if (kb >= blocks)
            break;
          uint4 xv[2];
#pragma unroll
          for (int half = 0; half < 2; half++)
            xv[half] = g == 0 && piece_in (kb, half) ? *(const uint4 *) (xq + kb * 128 + 64 * half + 16 * q) : zero;
          const float sx = xs[kb];
#pragma unroll
          for (int m = 0; m < M; m++)
            {
              float c[4] = {};
#pragma unroll
              for (int half = 0; half < 2; half++)
                {
                  const uint4 &lo = wv[u][m][0][half], &hi = wv[u][m][1][half], &xx = xv[half];
                  const unsigned a0[4] = { lo.x, hi.x, lo.y, hi.y }, b0[2] = { xx.x, xx.y };
                  const unsigned a1[4] = { lo.z, hi.z, lo.w, hi.w }, b1[2] = { xx.z, xx.w };
                  mma_e4m3 (c, a0, b0);
                  mma_e4m3 (c, a1, b1);
                }
              /* column 0 (lanes q = 0): rows g and g + 8 */
              acc[m][0] += c[0] * wsc[u][m][0] * sx;
              acc[m][1] += c[2] * wsc[u][m][1] * sx;
            }
        }
    }

  if (q == 0)
#pragma unroll
    for (int m = 0; m < M; m++)
      {
        red[warp][m][g] = acc[m][0];
        red[warp][m][g + 8] = acc[m][1];
      }
  __syncthreads ();
  const int o = threadIdx.x, n = n0 + o;
  if (o >= OUTS || n >= n_out)
    return;
  if constexpr (MODE == MODE_DOWN)
    {
      float sum = 0.0f;
#pragma unroll
      for (int wi = 0; wi < WARPS; wi++)
        sum += red[wi][o / 16][o % 16];
      y[(size_t) pair * p.hidden + n] = from_f<T> (down_finish<T> (p, e, n, sum));
    }
  else
    {
      float s[M] = {};
      int gr = n, ur = n;
#pragma unroll
      for (int m = 0; m < M; m++)
#pragma unroll
        for (int wi = 0; wi < WARPS; wi++)
          s[m] += red[wi][m][o];
      gate_up_rows (p, n, &gr, &ur);
      h[(size_t) pair * p.inter + n] = from_f<T> (gate_up_finish<T> (p, e, gr, ur, s[0], s[M - 1]));
    }
}

/* rowwise_down_combine's slot count for @tokens tokens of @top_k slots (a
 * power of two up to 8), or 0: down and the combine apart — more slots,
 * more than 4 tokens (H100, Qwen1.5-MoE's layer: 1.6% faster at 1 token,
 * level at 2 and 4, 1.3% slower at 8 and 16, where the separate down's
 * 2 slots a block keep more loads in flight), or MOE_CUDA_DOWN_COMBINE=0 */
static int
combine_slots (int tokens, int top_k)
{
  static const bool on = env_switch_on ("MOE_CUDA_DOWN_COMBINE");
  if (!on || tokens > 4 || top_k > 8)
    return 0;
  return top_k <= 1 ? 1 : top_k <= 2 ? 2 : top_k <= 4 ? 4 : 8;
}

/* rowwise_down_combine for combine_slots ()'s @slots, or none */
template <typename T>
static void (*down_combine_kernel (int slots)) (MoeCudaExperts, const T *)
{
  switch (slots)
    {
    case 1: return rowwise_down_combine<T, 1>;
    case 2: return rowwise_down_combine<T, 2>;
    case 4: return rowwise_down_combine<T, 4>;
    case 8: return rowwise_down_combine<T, 8>;
    default: return nullptr;
    }
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

  if constexpr (sizeof (T) == 2 && WF == MOE_CUDA_WEIGHTS_PLAIN)
    if (!p.transposed && p.hidden % 8 == 0 && p.inter % 8 == 0 &&
        (((uintptr_t) p.up | (uintptr_t) p.down | (uintptr_t) p.x | (uintptr_t) w.h) % 16) == 0)
      {
        const bool down32 = p.hidden % 32 == 0;
        dim3 mma_gu (S, (p.inter + 15) / 16), mma_dn (S, (p.hidden + 15) / (down32 ? 32 : 16));
        dim3 mma_dc (p.tokens, (p.hidden + 15) / 16);
        if (p.has_gate)
          launch_overlapped (rowwise_mma<T, MODE_GATE_UP, 2>, mma_gu, 256, 0, s, p, (const T *) p.x, (T *) w.h, (T *) w.y);
        else
          launch_overlapped (rowwise_mma<T, MODE_GATE_UP, 1>, mma_gu, 256, 0, s, p, (const T *) p.x, (T *) w.h, (T *) w.y);
        /* up to 8 slots a token: down and the combine as one kernel */
        if (auto down_combine = down_combine_kernel<T> (combine_slots (p.tokens, p.top_k)))
          {
            launch_overlapped (down_combine, mma_dc, 256, 0, s, p, (const T *) w.h);
            return nullptr;
          }
        if (down32)
          launch_overlapped (rowwise_mma<T, MODE_DOWN, 2>, mma_dn, 256, 0, s, p, (const T *) w.h, (T *) w.h, (T *) w.y);
        else
          launch_overlapped (rowwise_mma<T, MODE_DOWN, 1>, mma_dn, 256, 0, s, p, (const T *) w.h, (T *) w.h, (T *) w.y);
        return launch_combine<T> (p, w, s);
      }
  if constexpr (WF == MOE_CUDA_WEIGHTS_FP8)
    if (fp8_rowwise_mma (p))
      {
        dim3 mma_gu (S, (p.inter + 15) / 16), mma_dn (S, (p.hidden + 31) / 32);
        launch_overlapped (rowwise_fp8<T, MODE_GATE_UP, 2>, mma_gu, 256, fp8_row_smem (p.hidden), s, p, (const T *) p.x,
                           (T *) w.h, (T *) w.y);
        launch_overlapped (rowwise_fp8<T, MODE_DOWN, 2>, mma_dn, 256, fp8_row_smem (p.inter), s, p, (const T *) w.h,
                           (T *) w.h, (T *) w.y);
        return launch_combine<T> (p, w, s);
      }
  if (smem_gu > 200 * 1024 || smem_dn > 200 * 1024)
    return "hidden or intermediate size too large for the per-row kernels";
  cudaFuncSetAttribute (rowwise<T, TA, MODE_GATE_UP, WF>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem_gu);
  cudaFuncSetAttribute (rowwise<T, TA, MODE_DOWN, WF>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem_dn);
  if (WF != MOE_CUDA_WEIGHTS_PLAIN)
    quantize_activations<T><<<p.tokens, 256, 0, s>>> ((const T *) p.x, p.hidden, w.xq);
  launch_overlapped (rowwise<T, TA, MODE_GATE_UP, WF>, grid_gu, 256, smem_gu, s, p, x, (T *) w.h, (T *) w.y);
  /* h by (token, slot); a sentinel slot's row is left as it was, and unused */
  if (WF != MOE_CUDA_WEIGHTS_PLAIN)
    quantize_activations<T><<<S, 256, 0, s>>> ((const T *) w.h, p.inter, w.hq);
  launch_overlapped (rowwise<T, TA, MODE_DOWN, WF>, grid_dn, 256, smem_dn, s, p, h, (T *) w.h, (T *) w.y);
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
  return launch_combine<T> (p, w, s, true);
}

template <typename T>
const char *
run_typed (const MoeCudaExperts &p, int schedule, const int64_t *host_ids, const Workspace &w,
           cublasHandle_t handle, cudaStream_t s)
{
  switch (schedule)
    {
    case MOE_CUDA_GROUPED: return run_grouped<T> (p, w, s);
    case MOE_CUDA_DEEPGEMM: return run_deepgemm (p, w, s);
    case MOE_CUDA_FUSED: return run_fused (p, w, s);
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

extern "C" const char *
moe_cuda_quantize_fp8 (int                   dtype,
                       const void           *in,
                       int                   rows,
                       int                   K,
                       unsigned char        *q,
                       float                *scale,
                       cudaStream_t          stream)
{
  switch (dtype)
    {
    case MOE_CUDA_BF16: return launch_quantize_fp8 ((const __nv_bfloat16 *) in, rows, K, q, scale, stream);
    case MOE_CUDA_F16: return launch_quantize_fp8 ((const __half *) in, rows, K, q, scale, stream);
    default: return launch_quantize_fp8 ((const float *) in, rows, K, q, scale, stream);
    }
}
