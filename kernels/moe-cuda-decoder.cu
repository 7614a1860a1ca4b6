/* moe-cuda-decoder.cu: the decoder stack's kernels besides the experts and
 * cuBLAS's matmuls: embedding, RMSNorm (with the residual add fused),
 * RoPE, the KV cache, attention, routers and the small elementwise ops.
 *
 * Each op computes in float32 and rounds its output to the model dtype, at
 * the points where torch does, so that bf16 models agree with transformers
 * as the CPU path does.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "moe-cuda-decoder.h"
#include "moe-cuda-elements.cuh"
#include "moe-cuda-gemv.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <initializer_list>

namespace {

#define DISPATCH(dtype, ...)                                                  \
  do {                                                                       \
    switch (dtype)                                                           \
      {                                                                      \
      case MOE_CUDA_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; } break;   \
      case MOE_CUDA_F16: { typedef __half T; __VA_ARGS__; } break;           \
      default: { typedef float T; __VA_ARGS__; } break;                      \
      }                                                                      \
  } while (0)

__device__ __forceinline__ float
warp_sum (float v)
{
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync (0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float
warp_max (float v)
{
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf (v, __shfl_xor_sync (0xffffffffu, v, o));
  return v;
}

/* The block's sum (or max) of @v, in every thread. */
template <bool MAX>
__device__ float
block_reduce (float v)
{
  __shared__ float part[32];
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = (blockDim.x + 31) / 32;

  v = MAX ? warp_max (v) : warp_sum (v);
  __syncthreads ();
  if (lane == 0)
    part[warp] = v;
  __syncthreads ();
  v = lane < nw ? part[lane] : (MAX ? -INFINITY : 0.0f);
  return MAX ? warp_max (v) : warp_sum (v);
}

/* Elementwise kernels move V elements at a time: 16 bytes where the
 * launcher found every row start and width a multiple of 16 bytes (V =
 * 16 / sizeof (T)), else one (V = 1). */
template <typename T, int V>
__device__ __forceinline__ void
load_vec (T (&d)[V], const T *p)
{
  if constexpr (V * sizeof (T) == 16)
    {
      uint4 u = *(const uint4 *) p;
      memcpy (d, &u, 16);
    }
  else
    for (int i = 0; i < V; i++)
      d[i] = p[i];
}

template <typename T, int V>
__device__ __forceinline__ void
store_vec (T *p, const T (&d)[V])
{
  if constexpr (V * sizeof (T) == 16)
    {
      uint4 u;
      memcpy (&u, d, 16);
      *(uint4 *) p = u;
    }
  else
    for (int i = 0; i < V; i++)
      p[i] = d[i];
}

/* the block's threads copy @n elements */
template <typename T, int V>
__device__ __forceinline__ void
copy_vec (T *dst, const T *src, int n)
{
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V)
    {
      T e[V];
      load_vec<T, V> (e, src + i);
      store_vec<T, V> (dst + i, e);
    }
}

/* Whether 16-byte pieces fit: every value (element counts, strides) a
 * multiple of 16 bytes' worth and every pointer 16-byte aligned. */
template <typename T>
bool
fits_vec (std::initializer_list<long> counts, std::initializer_list<const void *> ptrs)
{
  for (long n : counts)
    if (n % (long) (16 / sizeof (T)) != 0)
      return false;
  for (const void *q : ptrs)
    if ((uintptr_t) q % 16 != 0)
      return false;
  return true;
}

/* launches kernel<T, V> (overlapped) with V = 16 bytes' worth when @vec, else 1 */
#define LAUNCH_VEC(vec, kernel, grid, block, stream, ...)                    \
  do {                                                                       \
    if (vec)                                                                 \
      launch_overlapped (kernel<T, 16 / sizeof (T)>, grid, block, 0, stream, __VA_ARGS__); \
    else                                                                     \
      launch_overlapped (kernel<T, 1>, grid, block, 0, stream, __VA_ARGS__); \
  } while (0)

template <typename T>
__global__ void
embed_kernel (const T *table, const int64_t *ids, int width, T *out)
{
  pdl_begin ();
  const T *src = table + ids[blockIdx.x] * (size_t) width;
  T *dst = out + blockIdx.x * (size_t) width;
#pragma unroll 8
  for (int i = threadIdx.x; i < width; i += blockDim.x)
    dst[i] = src[i];
}

/* A block per (row, group). The values stay in registers between the sum
 * of squares and the scaling, and every load of a pass is issued before
 * the first is used: at batch 1 a norm is one block, bound by load latency
 * rather than bandwidth. V values a load (16 bytes where the rows allow:
 * a prefill's norms are bound by bandwidth, and 2-byte loads left it at
 * half the memory's speed). */
constexpr int NORM_PER_THREAD = 8;

template <typename T, int V>
__global__ void
rms_norm_kernel (T *x, const T *h_add, const T *h_add2, int n, int groups, int group_stride, int in_stride,
                 const float *w, float eps, int weight_last, T *y, int out_stride)
{
  constexpr int NK = NORM_PER_THREAD / V;   /* pieces of V values a thread holds */
  pdl_release ();
  size_t r = blockIdx.x / groups, g = blockIdx.x % groups;
  T *xr = x + r * in_stride + g * group_stride;
  T *yr = y + r * out_stride + g * group_stride;
  const T *ar = h_add != nullptr ? h_add + r * in_stride + g * group_stride : nullptr;
  const T *ar2 = h_add2 != nullptr ? h_add2 + r * in_stride + g * group_stride : nullptr;
  float v[NK][V], wv[NK][V], ss = 0;
  T e[V];
  auto at = [] (int k) { return (int) (threadIdx.x + k * blockDim.x) * V; };   /* piece k's first index */
  /* h = x (+ h_add) at @i, rounded; written back with h_add */
  auto load_sum = [&] (int i, float (&h)[V]) {
    load_vec<T, V> (e, xr + i);
#pragma unroll
    for (int u = 0; u < V; u++)
      h[u] = to_f (e[u]);
    if (ar != nullptr)
      {
        float a[V];
        load_vec<T, V> (e, ar + i);
#pragma unroll
        for (int u = 0; u < V; u++)
          a[u] = to_f (e[u]);
        if (ar2 != nullptr)
          {
            load_vec<T, V> (e, ar2 + i);
#pragma unroll
            for (int u = 0; u < V; u++)
              a[u] = rnd<T> (a[u] + to_f (e[u]));
          }
#pragma unroll
        for (int u = 0; u < V; u++)
          h[u] = rnd<T> (h[u] + a[u]);
      }
  };
  auto store = [&] (T *dst, const float (&h)[V]) {
#pragma unroll
    for (int u = 0; u < V; u++)
      e[u] = from_f<T> (h[u]);
    store_vec<T, V> (dst, e);
  };

  /* the weights' loads first: they never depend on the kernels before */
#pragma unroll
  for (int k = 0; k < NK; k++)
#pragma unroll
    for (int u = 0; u < V; u++)
      wv[k][u] = at (k) < n ? w[at (k) + u] : 0.0f;
  pdl_wait ();
#pragma unroll
  for (int k = 0; k < NK; k++)
    if (at (k) < n)
      load_sum (at (k), v[k]);
    else
#pragma unroll
      for (int u = 0; u < V; u++)
        v[k][u] = 0.0f;
#pragma unroll
  for (int k = 0; k < NK; k++)
    {
      if (ar != nullptr && at (k) < n)
        store (xr + at (k), v[k]);
#pragma unroll
      for (int u = 0; u < V; u++)
        ss += v[k][u] * v[k][u];
    }
  /* rows wider than the registers hold (over 8192): the rest in a loop */
  for (int i = at (NK); i < n; i += blockDim.x * V)
    {
      float t[V];
      load_sum (i, t);
      if (ar != nullptr)
        store (xr + i, t);
#pragma unroll
      for (int u = 0; u < V; u++)
        ss += t[u] * t[u];
    }
  float inv = 1.0f / sqrtf (block_reduce<false> (ss) / (float) n + eps);
  auto scaled = [&] (float t, float wi) { return weight_last ? t * inv * wi : rnd<T> (t * inv) * wi; };
#pragma unroll
  for (int k = 0; k < NK; k++)
    if (at (k) < n)
      {
        float o[V];
#pragma unroll
        for (int u = 0; u < V; u++)
          o[u] = scaled (v[k][u], wv[k][u]);
        store (yr + at (k), o);
      }
  for (int i = at (NK); i < n; i += blockDim.x * V)
    {
      float o[V];
      load_vec<T, V> (e, xr + i);   /* this thread's own write above */
#pragma unroll
      for (int u = 0; u < V; u++)
        o[u] = scaled (to_f (e[u]), w[i + u]);
      store (yr + i, o);
    }
}

template <typename T>
__global__ void
clamp_kernel (T *x, size_t n, float limit)
{
  for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x)
    x[i] = from_f<T> (fminf (fmaxf (to_f (x[i]), -limit), limit));
}

/* Pair i's rotation at @pos: its cos and sin, scaled and rounded to the
 * model dtype (transformers' cos/sin tables are in it) */
template <typename T>
__device__ __forceinline__ void
rope_cos_sin (const float *inv_freq, int i, float pos, float scale, float *c, float *s)
{
  const float angle = inv_freq[i] * pos;
  *c = rnd<T> (cosf (angle) * scale);
  *s = rnd<T> (sinf (angle) * scale);
}

/* The pair (x1, x2) rotated by (c, s), with its roundings spelled out —
 * the compiler's own choice of which product to fuse varies with the code
 * around it — so that every RoPE kernel gives the same values
 * (test-cuda-rope checks them against each other) */
__device__ __forceinline__ void
rope_rotate (float x1, float x2, float c, float s, float *y1, float *y2)
{
  *y1 = __fsub_rn (__fmul_rn (x1, c), __fmul_rn (x2, s));
  *y2 = __fmaf_rn (x1, s, __fmul_rn (x2, c));
}

/* A block per row, a thread per rotated pair: its cos and sin once (the
 * accurate ones are the costly part), applied to every head with the
 * heads' loads in flight together. */
template <typename T>
__global__ void
rope_kernel (T *x, int heads, int row_stride, int head_stride, const int64_t *positions, const float *inv_freq,
             int rope_dim, float scale)
{
  pdl_begin ();
  int half = rope_dim / 2;
  float pos = (float) positions[blockIdx.x];
  T *row = x + blockIdx.x * (size_t) row_stride;

  for (int i = threadIdx.x; i < half; i += blockDim.x)
    {
      float c, s;
      rope_cos_sin<T> (inv_freq, i, pos, scale, &c, &s);
      /* eight heads' loads, then their stores (which the compiler may
       * not move loads past) */
      for (int h0 = 0; h0 < heads; h0 += 8)
        {
          float x1[8], x2[8];
#pragma unroll
          for (int u = 0; u < 8; u++)
            if (h0 + u < heads)
              {
                x1[u] = to_f (row[(size_t) (h0 + u) * head_stride + i]);
                x2[u] = to_f (row[(size_t) (h0 + u) * head_stride + i + half]);
              }
#pragma unroll
          for (int u = 0; u < 8; u++)
            if (h0 + u < heads)
              {
                float y1, y2;
                rope_rotate (x1[u], x2[u], c, s, &y1, &y2);
                row[(size_t) (h0 + u) * head_stride + i] = from_f<T> (y1);
                row[(size_t) (h0 + u) * head_stride + i + half] = from_f<T> (y2);
              }
        }
    }
}

/* A projected row [q heads | k heads | v heads] (@head_dim each) to the
 * attention's inputs in one pass: q's heads rotated in place, k's rotated
 * and v's copied into the layer's cache (as rope_kernel, then
 * store_kv_kernel: the same values). A block per (row, head), a thread per
 * rotated pair, or per dim past the rotated ones: a decode step's rows are
 * one round of loads, where a block per row walked the heads in turn. */
template <typename T>
__global__ void
rope_store_kv_kernel (T *qkv, int row_stride, int heads, int kv_heads, int head_dim, int n_tokens,
                      const int64_t *positions, const float *inv_freq, int rope_dim, float scale,
                      T *k_cache, T *v_cache, int capacity, int past, const int *past_dev)
{
  pdl_begin ();
  const int row = blockIdx.x, h = blockIdx.y, half = rope_dim / 2;
  const bool is_k = h >= heads && h < heads + kv_heads, is_v = h >= heads + kv_heads;
  T *x = qkv + (size_t) row * row_stride + (size_t) h * head_dim;
  T *cached = nullptr;

  if (is_k || is_v)
    {
      const int kh = h - heads - (is_v ? kv_heads : 0), b = row / n_tokens, t = row % n_tokens;
      if (past_dev != nullptr)
        past = *past_dev;
      cached = (is_k ? k_cache : v_cache) + (((size_t) b * kv_heads + kh) * capacity + past + t) * head_dim;
    }
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x)
    if (!is_v && i < half)
      {
        float c, s;
        rope_cos_sin<T> (inv_freq, i, (float) positions[row], scale, &c, &s);
        float r1, r2;
        rope_rotate (to_f (x[i]), to_f (x[i + half]), c, s, &r1, &r2);
        const T y1 = from_f<T> (r1), y2 = from_f<T> (r2);
        x[i] = y1;
        x[i + half] = y2;
        if (is_k)
          cached[i] = y1, cached[i + half] = y2;
      }
    else if (is_v || i >= rope_dim)
      {
        if (cached != nullptr)
          cached[i] = x[i];
      }
}

/* The same for a prefill's rows (the same values again): a block per row.
 * The row's cos and sin go to shared memory once, one thread per pair (a
 * block per head recomputed them for every head, and the sincos was most
 * of its time); then V elements a thread at a time, a head's pairs across
 * neighbouring threads: v and the non-rotated dims of k copied into the
 * cache, q's and k's pairs rotated — q back in place, k only into the
 * cache: the attention kernels (attention_kernel, flash, attend_gemm's
 * pointers) read keys from the cache, never from the projected row. */
template <typename T, int V>
__global__ void
rope_store_kv_rows_kernel (T *__restrict__ qkv, int row_stride, int heads, int kv_heads, int head_dim,
                           int n_tokens, const int64_t *positions, const float *inv_freq, int rope_dim,
                           float scale, T *__restrict__ k_cache, T *__restrict__ v_cache, int capacity, int past,
                           const int *past_dev)
{
  extern __shared__ float cs[];   /* [half] cos, then [half] sin */
  pdl_begin ();
  const int row = blockIdx.x, half = rope_dim / 2, b = row / n_tokens, t = row % n_tokens;
  T *x = qkv + (size_t) row * row_stride;
  float *sn = cs + half;

  if (past_dev != nullptr)
    past = *past_dev;
  const size_t slot0 = (size_t) b * kv_heads * capacity + past + t;   /* kv head h's: + h · capacity */

  for (int i = threadIdx.x; i < half; i += blockDim.x)
    rope_cos_sin<T> (inv_freq, i, (float) positions[row], scale, &cs[i], &sn[i]);

  /* the copies need no cos or sin: before the barrier */
  const int pk = (head_dim - rope_dim) / V, per_kv = pk + head_dim / V;
  for (int j = threadIdx.x; j < kv_heads * per_kv; j += blockDim.x)
    {
      const int h = j / per_kv, c = j % per_kv;
      const size_t slot = slot0 + (size_t) h * capacity;
      const T *src;
      T *dst, e[V];
      if (c < pk)
        src = x + (size_t) (heads + h) * head_dim + rope_dim + c * V,
        dst = k_cache + slot * head_dim + rope_dim + c * V;
      else
        src = x + (size_t) (heads + kv_heads + h) * head_dim + (c - pk) * V,
        dst = v_cache + slot * head_dim + (c - pk) * V;
      load_vec<T, V> (e, src);
      store_vec<T, V> (dst, e);
    }
  __syncthreads ();

  const int pp = half / V;
  for (int j = threadIdx.x; j < (heads + kv_heads) * pp; j += blockDim.x)
    {
      const int h = j / pp, i = (j % pp) * V;
      T *src = x + (size_t) h * head_dim + i, a[V], z[V], y1[V], y2[V];
      load_vec<T, V> (a, src);
      load_vec<T, V> (z, src + half);
#pragma unroll
      for (int u = 0; u < V; u++)
        {
          float r1, r2;
          rope_rotate (to_f (a[u]), to_f (z[u]), cs[i + u], sn[i + u], &r1, &r2);
          y1[u] = from_f<T> (r1);
          y2[u] = from_f<T> (r2);
        }
      T *dst = h < heads ? src : k_cache + (slot0 + (size_t) (h - heads) * capacity) * head_dim + i;
      store_vec<T, V> (dst, y1);
      store_vec<T, V> (dst + half, y2);
    }
}

/* DeepSeek's interleaved RoPE reads pairs (x0, x1), (x2, x3)… and writes the
 * halves [x0·c − x1·s, x2·c − x3·s, …, x1·c + x0·s, …]: one thread per head,
 * through a per-thread copy (rope_dim ≤ 256). */
template <typename T>
__global__ void
rope_interleaved_kernel (T *x, int heads, int row_stride, int head_stride, const int64_t *positions,
                         const float *inv_freq, int rope_dim, float scale)
{
  pdl_begin ();
  int half = rope_dim / 2;
  float pos = (float) positions[blockIdx.x];

  for (int h = threadIdx.x; h < heads; h += blockDim.x)
    {
      T *v = x + blockIdx.x * (size_t) row_stride + (size_t) h * head_stride;
      float t[256];
      for (int i = 0; i < half; i++)
        {
          float c, s;
          rope_cos_sin<T> (inv_freq, i, pos, scale, &c, &s);
          rope_rotate (to_f (v[2 * i]), to_f (v[2 * i + 1]), c, s, &t[i], &t[i + half]);
        }
      for (int i = 0; i < rope_dim; i++)
        v[i] = from_f<T> (t[i]);
    }
}

/* A block per (sequence, token): every head's key and value into the
 * cache, V elements a thread at a time (a block per head left most
 * threads idle: a head is 16 pieces of 16 bytes) */
template <typename T, int V>
__global__ void
store_kv_kernel (int n_tokens, int kv_heads,
                 const T *k1, int k1_row, int k1_head, int n1,
                 const T *k2, int k2_row, int k2_head, int n2,
                 const T *v, int v_row, int v_head, int dv,
                 T *k_cache, T *v_cache, int capacity, int past, const int *past_dev)
{
  pdl_begin ();
  const int row = blockIdx.x;
  if (past_dev != nullptr)
    past = *past_dev;
  const int b = row / n_tokens, t = row % n_tokens, dk = n1 + n2;
  /* pieces of V elements: a head's n1 of k1, n2 of k2, then dv of v */
  const int p1 = n1 / V, p2 = n2 / V, pv = dv / V, per_head = p1 + p2 + pv;

  for (int i = threadIdx.x; i < kv_heads * per_head; i += blockDim.x)
    {
      const int h = i / per_head, c = i % per_head;
      const size_t slot = ((size_t) b * kv_heads + h) * capacity + past + t;
      const T *src;
      T *dst, e[V];
      if (c < p1)
        src = k1 + (size_t) row * k1_row + (size_t) h * k1_head + c * V, dst = k_cache + slot * dk + c * V;
      else if (c < p1 + p2)
        src = k2 + (size_t) row * k2_row + (size_t) h * k2_head + (c - p1) * V,
        dst = k_cache + slot * dk + n1 + (c - p1) * V;
      else
        src = v + (size_t) row * v_row + (size_t) h * v_head + (c - p1 - p2) * V,
        dst = v_cache + slot * dv + (c - p1 - p2) * V;
      load_vec<T, V> (e, src);
      store_vec<T, V> (dst, e);
    }
}

/* The keys a decode attention launch covers (a graph's: @a.max_len,
 * whatever the step's past), and those one block holds scores for (a
 * split's): the kernel's shared memory and its launch agree through these */
__host__ __device__ inline int
attention_keys (const MoeCudaAttention &a)
{
  return a.past_dev != nullptr ? a.max_len : a.past + a.n_tokens;
}

__host__ __device__ inline int
attention_block_keys (const MoeCudaAttention &a)
{
  return a.split_keys > 0 ? a.split_keys : attention_keys (a);
}

/* attention_kernel's shared memory, in floats: the query, the block's
 * scores and, with RoPE, the row's own key; later the value groups' sums
 * (at most 128 threads × 8 elements of a 16-byte load) over all of it */
inline int
attention_smem_floats (const MoeCudaAttention &a)
{
  return max (a.dk + attention_block_keys (a) + (a.inv_freq != nullptr ? a.dk : 0), 128 * 8);
}

/* One block per (query row, head): the scores of every key in shared
 * memory, a thread per key (a key's row read as 16-byte loads all in
 * flight: one round of loads for a decode step's keys); then the softmax;
 * then a thread per output dim. With @a.split_keys, block z takes keys
 * z·split_keys … and leaves its softmax unnormalised in a.partial —
 * {max, sum, Σ p·v[dv]} — for attention_combine_kernel (a long context:
 * one block walking every key of a head was the whole step's time). */
template <typename T>
__global__ void
attention_kernel (MoeCudaAttention a)
{
  extern __shared__ float sm[];
  const int keys = attention_block_keys (a);
  float *qs = sm, *score = sm + a.dk, *k_new = score + keys;   /* attention_smem_floats () */
  int row = blockIdx.x, h = blockIdx.y;
  /* the past is the host's copy, made before the step's first kernel */
  int b = row / a.n_tokens, t = row % a.n_tokens, past = a.past_dev != nullptr ? *a.past_dev : a.past;
  int len = past + a.n_tokens, qpos = past + t;
  size_t kv_stride = a.key_valid_stride > 0 ? a.key_valid_stride : len;
  const int group = a.heads / a.kv_heads, g = h / group;
  const T *q = (const T *) a.q + (size_t) row * a.q_row_stride + (size_t) h * a.dk;
  const T *K = (const T *) a.k_cache + (size_t) (b * a.kv_heads + g) * a.capacity * a.dk;
  const T *V = (const T *) a.v_cache + (size_t) (b * a.kv_heads + g) * a.capacity * a.dv;
  T *out = (T *) a.out + ((size_t) row * a.heads + h) * a.dv;
  float *part = a.split_keys > 0
                ? a.partial + (((size_t) row * a.heads + h) * gridDim.z + blockIdx.z) * (a.dv + 2) : nullptr;
  const int j0 = a.split_keys > 0 ? blockIdx.z * a.split_keys : 0;
  const int j1 = a.split_keys > 0 ? min (len, j0 + a.split_keys) : len;
  constexpr int VE = 16 / sizeof (T);
  bool vec = a.dk % VE == 0 && (uintptr_t) K % 16 == 0;
  float mx = -INFINITY, sum = 0;
  /* with a.inv_freq, the row's own key and value (position qpos) come from
   * the projected row, not the cache (another block writes them there) */
  const bool rope = a.inv_freq != nullptr;
  /* (from q, head h of the row [q heads | k heads | v heads]: the row's
   * k head g and v head g) */
  const T *k_row = q + (size_t) (a.heads - h + g) * a.dk;
  const T *v_row = q + (size_t) (a.heads - h) * a.dk + (size_t) a.kv_heads * a.dk + (size_t) g * a.dv;

  /* the keys and values earlier steps cached, which the kernels just
   * before never write, on their way to L2 while those still run */
  pdl_release ();
  for (int j = j0 + threadIdx.x; j < min (j1, past); j += blockDim.x)
    {
      for (int o = 0; o < a.dk * (int) sizeof (T); o += 128)
        prefetch_l2 ((const char *) (K + (size_t) j * a.dk) + o);
      for (int o = 0; o < a.dv * (int) sizeof (T); o += 128)
        prefetch_l2 ((const char *) (V + (size_t) j * a.dv) + o);
    }
  pdl_wait ();

  if (rope)
    {
      /* moe_cuda_rope_store_kv ()'s expressions, rounded as it stores them */
      const int half = a.rope_dim / 2;
      for (int i = threadIdx.x; i < a.dk; i += blockDim.x)
        if (i < half)
          {
            float c, s;
            rope_cos_sin<T> (a.inv_freq, i, (float) a.positions[row], a.rope_scale, &c, &s);
            float q1, q2, k1, k2;
            rope_rotate (to_f (q[i]), to_f (q[i + half]), c, s, &q1, &q2);
            rope_rotate (to_f (k_row[i]), to_f (k_row[i + half]), c, s, &k1, &k2);
            qs[i] = rnd<T> (q1);
            qs[i + half] = rnd<T> (q2);
            k_new[i] = rnd<T> (k1);
            k_new[i + half] = rnd<T> (k2);
          }
        else if (i >= a.rope_dim)
          {
            qs[i] = to_f (q[i]);
            k_new[i] = to_f (k_row[i]);
          }
      __syncthreads ();
      /* the first head of the group (and keys' first block) caches them */
      if (h % group == 0 && blockIdx.z == 0)
        {
          T *kc = (T *) K + (size_t) qpos * a.dk, *vc = (T *) V + (size_t) qpos * a.dv;
          for (int i = threadIdx.x; i < a.dk; i += blockDim.x)
            kc[i] = from_f<T> (k_new[i]);
          for (int i = threadIdx.x; i < a.dv; i += blockDim.x)
            vc[i] = v_row[i];
        }
    }
  else
    {
      for (int d = threadIdx.x; d < a.dk; d += blockDim.x)
        qs[d] = to_f (q[d]);
      __syncthreads ();
    }

  for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x)
    {
      bool ok = j <= qpos && (a.key_valid == nullptr || a.key_valid[b * kv_stride + j]) &&
                (a.window == 0 || qpos - j < a.window);
      float s = -INFINITY;
      if (ok)
        {
          const T *kr = K + (size_t) j * a.dk;
          float acc = 0;
          if (rope && j == qpos)
            for (int d = 0; d < a.dk; d++)
              acc += qs[d] * k_new[d];
          else if (vec)
#pragma unroll 16
            for (int d = 0; d < a.dk; d += VE)
              {
                uint4 kv = __ldg ((const uint4 *) (kr + d));
                const T *ke = (const T *) &kv;
#pragma unroll
                for (int e = 0; e < VE; e++)
                  acc += qs[d + e] * to_f (ke[e]);
              }
          else
            for (int d = 0; d < a.dk; d++)
              acc += qs[d] * to_f (kr[d]);
          s = acc * a.scaling;
          if (a.eager)
            s = rnd<T> (s);
        }
      score[j - j0] = s;
      mx = fmaxf (mx, s);
    }
  mx = block_reduce<true> (mx);
  if (a.sinks != nullptr && part == nullptr)
    mx = fmaxf (mx, a.sinks[h]);
  if (mx == -INFINITY)
    {
      /* a padded query with nothing to attend to (or a split past the keys) */
      if (part != nullptr)
        {
          if (threadIdx.x == 0)
            part[0] = -INFINITY, part[1] = 0.0f;
          return;
        }
      for (int d = threadIdx.x; d < a.dv; d += blockDim.x)
        out[d] = from_f<T> (0.0f);
      return;
    }
  for (int j = threadIdx.x; j < j1 - j0; j += blockDim.x)
    {
      float p = score[j] == -INFINITY ? 0.0f : expf (score[j] - mx);
      score[j] = p;
      sum += p;
    }
  sum = block_reduce<false> (sum);   /* its barriers also publish score[] */
  if (a.sinks != nullptr && part == nullptr)
    sum += expf (a.sinks[h] - mx);

  if (a.dv % VE == 0 && a.dv / VE <= (int) blockDim.x && ((uintptr_t) V | (rope ? (uintptr_t) v_row : 0)) % 16 == 0)
    {
      /* dv / VE threads per value row, blockDim / that many rows at once:
       * 16-byte loads, all of a thread's keys in flight (a thread per
       * output dim read 2 bytes a key, one key after another); the groups'
       * sums meet in shared memory, which the scores no longer need */
      const int lanes = a.dv / VE, groups = blockDim.x / lanes;
      const int lane = threadIdx.x % lanes, grp = threadIdx.x / lanes;
      float acc[VE] = {};
      if (grp < groups)
#pragma unroll 16
        for (int j = j0 + grp; j < j1; j += groups)
          {
            /* no branch on p = 0 (masked keys' values are finite: every
             * cached row was written), so that the loads go out together */
            float p = score[j - j0];
            p = a.eager ? rnd<T> (p / sum) : p;
            const T *vr = rope && j == qpos ? v_row : V + (size_t) j * a.dv;
            uint4 vv = __ldg ((const uint4 *) (vr + lane * VE));
            const T *ve = (const T *) &vv;
#pragma unroll
            for (int e = 0; e < VE; e++)
              acc[e] += p * to_f (ve[e]);
          }
      __syncthreads ();
      if (grp < groups)
#pragma unroll
        for (int e = 0; e < VE; e++)
          sm[grp * a.dv + lane * VE + e] = acc[e];
      __syncthreads ();
      for (int d = threadIdx.x; d < a.dv; d += blockDim.x)
        {
          float o = 0;
          for (int g2 = 0; g2 < groups; g2++)
            o += sm[g2 * a.dv + d];
          if (part != nullptr)
            part[2 + d] = o;
          else
            out[d] = from_f<T> (a.eager ? o : o / sum);
        }
    }
  else
    for (int d = threadIdx.x; d < a.dv; d += blockDim.x)
      {
        float acc = 0;
#pragma unroll 8
        for (int j = j0; j < j1; j++)
          {
            float p = score[j - j0];
            const T *vr = rope && j == qpos ? v_row : V + (size_t) j * a.dv;
            acc += (a.eager ? rnd<T> (p / sum) : p) * to_f (vr[d]);
          }
        if (part != nullptr)
          part[2 + d] = acc;
        else
          out[d] = from_f<T> (a.eager ? acc : acc / sum);
      }
  if (part != nullptr && threadIdx.x == 0)
    part[0] = mx, part[1] = sum;
}

/* A split attention's blocks into its output: each block's sums rescaled
 * to the largest maximum (and the sink's term, where the model has one),
 * a thread per output dim. */
template <typename T>
__global__ void
attention_combine_kernel (MoeCudaAttention a, int splits)
{
  pdl_begin ();
  const int row = blockIdx.x, h = blockIdx.y;
  const float *part = a.partial + ((size_t) row * a.heads + h) * splits * (a.dv + 2);
  T *out = (T *) a.out + ((size_t) row * a.heads + h) * a.dv;
  float mx = a.sinks != nullptr ? a.sinks[h] : -INFINITY, sum = 0;

  for (int z = 0; z < splits; z++)
    mx = fmaxf (mx, part[z * (a.dv + 2)]);
  if (mx == -INFINITY)
    {
      for (int d = threadIdx.x; d < a.dv; d += blockDim.x)
        out[d] = from_f<T> (0.0f);
      return;
    }
  for (int z = 0; z < splits; z++)
    if (part[z * (a.dv + 2)] != -INFINITY)
      sum += part[z * (a.dv + 2) + 1] * expf (part[z * (a.dv + 2)] - mx);
  if (a.sinks != nullptr)
    sum += expf (a.sinks[h] - mx);
  for (int d = threadIdx.x; d < a.dv; d += blockDim.x)
    {
      float acc = 0;
      for (int z = 0; z < splits; z++)
        if (part[z * (a.dv + 2)] != -INFINITY)
          acc += part[z * (a.dv + 2) + 2 + d] * expf (part[z * (a.dv + 2)] - mx);
      out[d] = from_f<T> (acc / sum);
    }
}

template <typename T>
__global__ void
attention_softmax_kernel (MoeCudaSoftmax a)
{
  int r = blockIdx.x, i = r / a.rows, tt = r % a.rows;
  int b = i / a.heads, h = i % a.heads, qpos = a.past + a.t0 + tt, full = a.past + a.n_tokens;
  const float *s = a.scores + (size_t) r * a.len;
  T *p = (T *) a.probs + (size_t) r * a.len;
  const uint8_t *valid = a.key_valid != nullptr ? a.key_valid + (size_t) b * full : nullptr;
  float mx = -INFINITY, sum = 0;

  /* the key's score, or -inf where it may not be attended to */
  auto score = [&] (int j) -> float {
    if (j > qpos || (valid != nullptr && !valid[j]) || (a.window != 0 && qpos - j >= a.window))
      return -INFINITY;
    return a.eager ? rnd<T> (s[j]) : s[j];
  };
  /* the first C·blockDim scores stay in registers: one read of them */
  constexpr int C = 16;
  float v[C];
#pragma unroll
  for (int c = 0; c < C; c++)
    {
      int j = threadIdx.x + c * blockDim.x;
      v[c] = j < a.len ? score (j) : -INFINITY;
      mx = fmaxf (mx, v[c]);
    }
  for (int j = threadIdx.x + C * blockDim.x; j < a.len; j += blockDim.x)
    mx = fmaxf (mx, score (j));
  mx = block_reduce<true> (mx);
  if (a.sinks != nullptr)
    mx = fmaxf (mx, a.sinks[h]);
  if (mx == -INFINITY)
    {
      for (int j = threadIdx.x; j < a.len; j += blockDim.x)
        p[j] = from_f<T> (0.0f);
      return;
    }
#pragma unroll
  for (int c = 0; c < C; c++)
    {
      v[c] = v[c] == -INFINITY ? 0.0f : expf (v[c] - mx);
      sum += v[c];
    }
  for (int j = threadIdx.x + C * blockDim.x; j < a.len; j += blockDim.x)
    {
      float e = score (j);
      sum += e == -INFINITY ? 0.0f : expf (e - mx);
    }
  sum = block_reduce<false> (sum);
  if (a.sinks != nullptr)
    sum += expf (a.sinks[h] - mx);
  float inv = 1.0f / sum;
#pragma unroll
  for (int c = 0; c < C; c++)
    {
      int j = threadIdx.x + c * blockDim.x;
      if (j < a.len)
        p[j] = from_f<T> (v[c] * inv);
    }
  for (int j = threadIdx.x + C * blockDim.x; j < a.len; j += blockDim.x)
    {
      float e = score (j);
      p[j] = from_f<T> (e == -INFINITY ? 0.0f : expf (e - mx) * inv);
    }
}

__global__ void
attention_pointers_kernel (MoeCudaAttentionPointers a, const void **out)
{
  for (int i = threadIdx.x; i < a.n; i += blockDim.x)
    {
      int b = i / a.heads, h = i % a.heads, g = h / a.group;
      size_t kv = (size_t) b * (a.heads / a.group) + g;
      out[i] = a.k + kv * a.capacity * a.dk * a.elem;
      out[a.n + i] = a.q + ((size_t) (b * a.n_tokens + a.t0) * a.q_row_stride + (size_t) h * a.dk) * a.elem;
      out[2 * a.n + i] = a.scores + (size_t) i * a.rows * a.len * sizeof (float);
      out[3 * a.n + i] = a.v + kv * a.capacity * a.dv * a.elem;
      out[4 * a.n + i] = a.probs + (size_t) i * a.rows * a.len * a.elem;
      out[5 * a.n + i] = a.out + ((size_t) (b * a.n_tokens + a.t0) * a.heads + h) * a.dv * a.elem;
    }
}

/* The warp's top choice among @n values not yet taken: the largest, the
 * lower index on ties (torch.topk's order for the fixtures' distinct
 * values), in every lane. */
__device__ int
warp_argmax (const float *v, const unsigned char *taken, int n)
{
  int lane = threadIdx.x % 32, bi = -1;
  float best = -INFINITY;

  for (int i = lane; i < n; i += 32)
    if (!taken[i] && (bi < 0 || v[i] > best))
      {
        best = v[i];
        bi = i;
      }
  for (int o = 16; o > 0; o >>= 1)
    {
      float ob = __shfl_xor_sync (0xffffffffu, best, o);
      int oi = __shfl_xor_sync (0xffffffffu, bi, o);
      if (oi >= 0 && (bi < 0 || ob > best || (ob == best && oi < bi)))
        {
          best = ob;
          bi = oi;
        }
    }
  return bi;
}

/* The top @K of @n scores into ids[] (largest first), by the warp; the
 * chosen are marked in taken[]. */
__device__ void
warp_top_k (const float *scores, unsigned char *taken, int n, int K, int64_t *ids)
{
  for (int k = 0; k < K; k++)
    {
      int i = warp_argmax (scores, taken, n);
      if (threadIdx.x % 32 == 0)
        {
          taken[i] = 1;
          ids[k] = i;
        }
      __syncwarp ();
    }
}

/* x · w_e for the experts e of this block's share into logits[], a warp
 * per expert: the router's product for a few rows, where a GEMV kernel of
 * its own and the launch between cost more than the product. Block @rank
 * of the row's @blocks takes experts rank·warps + warp, then every
 * blocks·warps-th. Each warp's first weights go out before pdl_wait ()
 * (they never depend on the kernels before); @in a multiple of 16 bytes'
 * elements. */
template <typename T>
__device__ __forceinline__ void
router_logits (const T *w, const T *x, int E, int in, int rank, int blocks, float *logits)
{
  constexpr int VE = 16 / sizeof (T), U = 8;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int warp = rank * warps + threadIdx.x / 32, stride = blocks * warps;
  const int steps = (in / VE + 31) / 32;   /* 16-byte chunks a lane takes */
  const uint4 zero = make_uint4 (0, 0, 0, 0);
  uint4 wv[U];
  auto chunk_in = [&] (int st) { return (lane + 32 * st) * VE < in; };
  auto load = [&] (int e, int s0) {
    const uint4 *wr = (const uint4 *) (w + (size_t) e * in) + lane;
#pragma unroll
    for (int u = 0; u < U; u++)
      wv[u] = s0 + u < steps && chunk_in (s0 + u) ? __ldg (wr + 32 * (s0 + u)) : zero;
  };

  pdl_release ();
  if (warp < E)
    load (warp, 0);
  pdl_wait ();
  for (int e = warp; e < E; e += stride)
    {
      const uint4 *xr = (const uint4 *) x + lane;
      float acc = 0;
      for (int s0 = 0; s0 < steps; s0 += U)
        {
          if (s0 > 0 || e != warp)
            load (e, s0);
#pragma unroll
          for (int u = 0; u < U; u++)
            if (s0 + u < steps && chunk_in (s0 + u))
              {
                uint4 xv = __ldg (xr + 32 * (s0 + u));
                const T *we = (const T *) &wv[u], *xe = (const T *) &xv;
#pragma unroll
                for (int i = 0; i < VE; i++)
                  acc += to_f (we[i]) * to_f (xe[i]);
              }
        }
      acc = warp_sum (acc);
      if (lane == 0)
        logits[e] = acc;
    }
}

/* The choice for a row, as moe-transformer.c's route(), by its block's
 * first warp; with r.w, the row's @blocks blocks (a cluster of them; one
 * block before sm_90) first make its logits, each writing its experts'
 * into the first block's shared memory: one SM reading the whole router
 * (60 × 2048 weights, 245 KB) took ~17 µs of a decode step alone. */
template <typename T>
__global__ void __launch_bounds__ (1024)
route_kernel (MoeCudaRouter r, int blocks)
{
  extern __shared__ int64_t route_sm[];
  int E = r.num_experts, K = r.top_k;
  const int row = blockIdx.x / blocks, rank = blockIdx.x % blocks;
  /* the choice and its weights built in shared memory, written out at the
   * end: reading them back from global memory cost a round trip each */
  int64_t *ids = route_sm;
  float *w = (float *) (ids + K);
  float *logits = w + K, *choice = logits + E, *sig = choice + E;
  unsigned char *taken = (unsigned char *) (sig + E);
  int lane = threadIdx.x % 32;

  if (r.w != nullptr)
    {
      const T *x = (const T *) r.x + row * (size_t) r.ldx;
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (blocks > 1)
        {
          namespace cg = cooperative_groups;
          cg::cluster_group cluster = cg::this_cluster ();
          router_logits<T> ((const T *) r.w, x, E, r.hidden, rank, blocks, cluster.map_shared_rank (logits, 0));
          cluster.sync ();
        }
      else
#endif
        {
          router_logits<T> ((const T *) r.w, x, E, r.hidden, 0, 1, logits);
          __syncthreads ();
        }
      if (rank != 0 || threadIdx.x >= 32)
        return;
    }
  else
    pdl_begin ();
  for (int e = lane; e < E; e += 32)
    {
      float v = (r.w != nullptr ? logits[e] : r.logits[row * (size_t) E + e]) +
                (r.bias != nullptr ? r.bias[e] : 0.0f);
      /* DeepSeek routes in float32 whatever the model dtype */
      logits[e] = r.kind == MOE_CUDA_ROUTER_SIGMOID_GROUPED ? v : rnd<T> (v);
      taken[e] = 0;
    }
  __syncwarp ();

  if (r.kind == MOE_CUDA_ROUTER_SOFTMAX_TOPK)
    {
      float mx = -INFINITY, sum = 0, kept = 0;
      for (int e = lane; e < E; e += 32)
        mx = fmaxf (mx, logits[e]);
      mx = warp_max (mx);
      for (int e = lane; e < E; e += 32)
        sum += (choice[e] = expf (logits[e] - mx));
      sum = warp_sum (sum);
      __syncwarp ();
      for (int e = lane; e < E; e += 32)
        choice[e] /= sum;
      __syncwarp ();
      warp_top_k (choice, taken, E, K, ids);
      if (lane == 0)
        {
          for (int k = 0; k < K; k++)
            kept += (w[k] = choice[ids[k]]);
          for (int k = 0; k < K; k++)
            {
              if (r.norm_topk)
                w[k] /= kept;
              if (r.weights_in_act_dtype)
                w[k] = rnd<T> (w[k]);
            }
        }
    }
  else if (r.kind == MOE_CUDA_ROUTER_SIGMOID_GROUPED)
    {
      int per = E / r.n_group;
      float *group = (float *) (taken + ((E + 15) / 16) * 16);   /* see moe_cuda_route() */
      for (int e = lane; e < E; e += 32)
        {
          sig[e] = 1.0f / (1.0f + expf (-logits[e]));
          choice[e] = sig[e] + r.score_bias[e];
        }
      __syncwarp ();
      /* each group's score: the sum of its two best */
      for (int gi = lane; gi < r.n_group; gi += 32)
        {
          const float *c = choice + gi * per;
          int b0 = 0;
          for (int e = 1; e < per; e++)
            if (c[e] > c[b0])
              b0 = e;
          int b1 = b0 == 0 ? 1 : 0;
          for (int e = 0; e < per; e++)
            if (e != b0 && c[e] > c[b1])
              b1 = e;
          group[gi] = c[b0] + c[b1];
        }
      __syncwarp ();
      if (lane == 0)
        {
          /* keep the topk_group best groups; mask the rest */
          unsigned long long kept = 0;
          for (int s = 0; s < r.topk_group; s++)
            {
              int best = -1;
              for (int gi = 0; gi < r.n_group; gi++)
                if (!(kept >> gi & 1) && (best < 0 || group[gi] > group[best]))
                  best = gi;
              kept |= 1ull << best;
            }
          for (int gi = 0; gi < r.n_group; gi++)
            if (!(kept >> gi & 1))
              for (int e = 0; e < per; e++)
                choice[gi * per + e] = -INFINITY;
        }
      __syncwarp ();
      float sum = 0;
      warp_top_k (choice, taken, E, K, ids);
      if (lane == 0)
        {
          for (int k = 0; k < K; k++)
            sum += (w[k] = sig[ids[k]]);
          for (int k = 0; k < K; k++)
            {
              if (r.norm_topk)
                w[k] /= sum + 1e-20f;
              w[k] *= r.routed_scale;
            }
        }
    }
  else
    {
      /* GPT-OSS: top-k of the logits, softmax over those k */
      warp_top_k (logits, taken, E, K, ids);
      if (lane == 0)
        {
          float mx = -INFINITY, sum = 0;
          for (int k = 0; k < K; k++)
            mx = fmaxf (mx, logits[ids[k]]);
          for (int k = 0; k < K; k++)
            sum += (w[k] = expf (logits[ids[k]] - mx));
          for (int k = 0; k < K; k++)
            w[k] = rnd<T> (w[k] / sum);
        }
    }
  __syncwarp ();
  for (int k = lane; k < K; k += 32)
    {
      r.ids[row * (size_t) K + k] = ids[k];
      r.weights[row * (size_t) K + k] = w[k];
    }
}

/* acc[r] += w · x[r] for the R rows: a warp, 16-byte loads of the weight
 * row (eight in flight per lane: the memory's speed), the inputs from L1/L2 */
template <typename T, int R>
__device__ __forceinline__ void
warp_dot (const T *w, const T *x, int ldx, int in, bool vec, float *acc)
{
  constexpr int V = 16 / sizeof (T);
  int lane = threadIdx.x % 32;

  if (vec)
#pragma unroll 8
    for (int k = lane * V; k < in; k += 32 * V)
      {
        uint4 wv = __ldg ((const uint4 *) (w + k));
        const T *we = (const T *) &wv;
#pragma unroll
        for (int r = 0; r < R; r++)
          {
            uint4 xv = __ldg ((const uint4 *) (x + (size_t) r * ldx + k));
            const T *xe = (const T *) &xv;
#pragma unroll
            for (int q = 0; q < V; q++)
              acc[r] += to_f (we[q]) * to_f (xe[q]);
          }
      }
  else
    for (int k = lane; k < in; k += 32)
      {
        float wk = to_f (w[k]);
#pragma unroll
        for (int r = 0; r < R; r++)
          acc[r] += wk * to_f (x[(size_t) r * ldx + k]);
      }
#pragma unroll
  for (int r = 0; r < R; r++)
    acc[r] = warp_sum (acc[r]);
}

/* The few-row projections' epilogues, on output n of row r (acc: x·wᵀ, or
 * the gate's with GEMV_GATED, whose up is @up): GEMV_PLAIN y = x·wᵀ + b;
 * GEMV_GATED (w is [gate; up], 2·out rows) y = act(gate) · up, each rounded
 * as torch; GEMV_ADD y (+)= (sigmoid(gate) ·) x·wᵀ, a shared expert added
 * to the routed experts' output, or made apart (without @add). */
enum { GEMV_PLAIN, GEMV_GATED, GEMV_ADD };

template <typename T, int EPI>
__device__ __forceinline__ void
gemv_store (const MoeCudaGemv &a, int r, int n, float acc, float up)
{
  const T *bias = (const T *) a.bias;
  size_t o = (size_t) r * a.out + n;

  if (EPI == GEMV_GATED)
    {
      float g = rnd<T> (acc + (bias ? to_f (bias[n]) : 0.0f));
      float u = rnd<T> (up + (bias ? to_f (bias[a.out + n]) : 0.0f));
      ((T *) a.y)[o] = from_f<T> (rnd<T> (activate (a.activation, g)) * u);
    }
  else if (EPI == GEMV_ADD)
    {
      float v = rnd<T> (acc);
      if (a.gate != nullptr)
        v = rnd<T> (rnd<T> (1.0f / (1.0f + expf (-to_f (((const T *) a.gate)[(size_t) r * a.gate_stride])))) * v);
      ((T *) a.y)[o] = from_f<T> ((a.add ? to_f (((T *) a.y)[o]) : 0.0f) + v);
    }
  else
    {
      float v = acc + (bias ? to_f (bias[n]) : 0.0f);
      if (a.y_f32)
        ((float *) a.y)[o] = v;
      else
        ((T *) a.y)[o] = from_f<T> (v);
    }
}

/* A warp per output n of up to 8 rows, on the CUDA cores: float32 weights,
 * and rows the tensor-core form below cannot load 16 bytes at a time. */
template <typename T, int R, int EPI>
__global__ void __launch_bounds__ (256)
gemv_kernel (MoeCudaGemv a)
{
  constexpr int V = 16 / sizeof (T);
  int n = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const T *W = (const T *) a.w, *x = (const T *) a.x;
  bool vec = (((uintptr_t) x | (uintptr_t) W) % 16 == 0) && a.in % V == 0 && a.ldx % V == 0;
  float acc[R] = {}, up[R] = {};

  pdl_begin ();
  if (n >= a.out)
    return;
  warp_dot<T, R> (W + (size_t) n * a.in, x, a.ldx, a.in, vec, acc);
  if (EPI == GEMV_GATED)
    warp_dot<T, R> (W + (size_t) (a.out + n) * a.in, x, a.ldx, a.in, vec, up);
  if (lane != 0)
    return;
#pragma unroll
  for (int r = 0; r < R; r++)
    gemv_store<T, EPI> (a, r, n, acc[r], up[r]);
}

/* The tensor-core form, bf16/f16, up to 8·NT rows (moe-cuda-gemv.cuh) */
template <typename T, int NT, int EPI>
__global__ void __launch_bounds__ (256)
gemv_mma_kernel (MoeCudaGemv a)
{
  constexpr int M = EPI == GEMV_GATED ? 2 : 1;
  const T *w = (const T *) a.w;
  auto weight_row = [&] (int m, int n) { return w + ((size_t) m * a.out + n) * a.in; };
  float s[M];
  int n, r;

  if (gemv_mma_sums<T, NT, M> (weight_row, blockIdx.x * 16, a.out, a.in, (const T *) a.x, a.ldx, a.rows, true,
                               s, &n, &r))
    gemv_store<T, EPI> (a, r, n, s[0], s[M - 1]);
}

/* a[i] = fn (a[i], b[i]) over @n elements, by the block, V at a time */
template <typename T, int V, typename F>
__device__ __forceinline__ void
zip_vec (T *a, const T *b, int n, F fn)
{
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V)
    {
      T ae[V], be[V];
      load_vec<T, V> (ae, a + i);
      load_vec<T, V> (be, b + i);
#pragma unroll
      for (int j = 0; j < V; j++)
        ae[j] = fn (ae[j], be[j]);
      store_vec<T, V> (a + i, ae);
    }
}

/* the sigmoid gate rounded as torch's sigmoid of a model-dtype tensor */
template <typename T, int V>
__global__ void
act_mul_kernel (T *gu, int width, int row_stride, int act, const T *gate)
{
  pdl_begin ();
  T *g = gu + blockIdx.x * (size_t) row_stride;
  const float s = gate != nullptr ? rnd<T> (1.0f / (1.0f + expf (-to_f (gate[blockIdx.x])))) : 1.0f;
  zip_vec<T, V> (g, g + width, width,
                 [act, s] (T gv, T uv) { return from_f<T> (rnd<T> (activate (act, to_f (gv))) * to_f (uv) * s); });
}

/* every row of y = bias: what the projection's GEMM then adds its products
 * to (beta = 1), in float32 before its one rounding */
template <typename T, int V>
__global__ void
bias_rows_kernel (const T *bias, int width, T *y)
{
  pdl_begin ();
  copy_vec<T, V> (y + blockIdx.x * (size_t) width, bias, width);
}

template <typename T>
__global__ void
to_f32_kernel (const T *x, size_t n, float *y)
{
  for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x)
    y[i] = to_f (x[i]);
}

/* (v, i) becomes the better of itself and its partner @o lanes away:
 * the larger value, the smaller index between equals */
__device__ __forceinline__ void
argmax_step (float &v, int &i, int o)
{
  float v2 = __shfl_xor_sync (0xffffffffu, v, o);
  int i2 = __shfl_xor_sync (0xffffffffu, i, o);
  if (v2 > v || (v2 == v && i2 < i))
    v = v2, i = i2;
}

/* Each row's first index of its largest value (_moe_greedy_token's rule):
 * a block per row, each thread's next eight 16-byte loads issued before
 * it looks at any (with the bound checked inside one loop pass, the
 * compiler kept them one at a time: a round trip per 16 KB a block), then
 * the block's (value, index) pairs reduced. */
__global__ void __launch_bounds__ (1024)
argmax_kernel (const float *x, int n, int64_t *out)
{
  pdl_begin ();
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  const float *row = x + (size_t) blockIdx.x * n;
  float v = -INFINITY;
  int i = INT_MAX, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto see = [&] (float x, int j) {
    if (x > v || (x == v && j < i))
      v = x, i = j;
  };

  if (n % 4 == 0 && (uintptr_t) row % 16 == 0)
    {
      constexpr int U = 8;
      const float4 *row4 = (const float4 *) row;
      const int n4 = n / 4;
      for (int j0 = threadIdx.x; j0 < n4; j0 += U * blockDim.x)
        {
          float4 q[U];
#pragma unroll
          for (int u = 0; u < U; u++)
            if (j0 + u * (int) blockDim.x < n4)
              q[u] = __ldg (row4 + j0 + u * blockDim.x);
#pragma unroll
          for (int u = 0; u < U; u++)
            {
              const int j = j0 + u * blockDim.x;
              if (j < n4)
                see (q[u].x, 4 * j), see (q[u].y, 4 * j + 1), see (q[u].z, 4 * j + 2), see (q[u].w, 4 * j + 3);
            }
        }
    }
  else
    for (int j = threadIdx.x; j < n; j += blockDim.x)
      see (row[j], j);
  for (int o = 16; o > 0; o >>= 1)
    argmax_step (v, i, o);
  if (lane == 0)
    best_v[warp] = v, best_i[warp] = i;
  __syncthreads ();
  if (warp == 0)
    {
      v = lane < (int) blockDim.x / 32 ? best_v[lane] : -INFINITY;
      i = lane < (int) blockDim.x / 32 ? best_i[lane] : INT_MAX;
      for (int o = 16; o > 0; o >>= 1)
        argmax_step (v, i, o);
      if (lane == 0)
        out[blockIdx.x] = i == INT_MAX ? 0 : i;   /* all -inf (or NaN): the first, as on the host */
    }
}

unsigned
elementwise_blocks (size_t n)
{
  size_t b = (n + 255) / 256;
  return (unsigned) (b < 4096 ? (b > 0 ? b : 1) : 4096);
}

} /* namespace */

extern "C" void
moe_cuda_embed (int dtype, const void *table, const int64_t *ids, int rows, int width, void *out, cudaStream_t s)
{
  DISPATCH (dtype, launch_overlapped (embed_kernel<T>, rows, 256, 0, s, (const T *) table, ids, width, (T *) out));
}

extern "C" void
moe_cuda_rms_norm (int dtype, void *x, const void *h_add, const void *h_add2, int rows, int n, int groups,
                   int group_stride, int in_stride, const float *weight, float eps, int weight_last, void *y,
                   int out_stride, cudaStream_t s)
{
  /* enough threads that each holds at most NORM_PER_THREAD values */
  int threads = 128;
  while (threads < 1024 && threads * NORM_PER_THREAD < n)
    threads *= 2;
  DISPATCH (dtype, LAUNCH_VEC (fits_vec<T> ({ n, group_stride, in_stride, out_stride }, { x, h_add, h_add2, y }),
                               rms_norm_kernel, rows * groups, threads, s, (T *) x, (const T *) h_add,
                               (const T *) h_add2, n, groups, group_stride, in_stride, weight, eps, weight_last,
                               (T *) y, out_stride));
}

extern "C" void
moe_cuda_clamp (int dtype, void *x, size_t n, float limit, cudaStream_t s)
{
  DISPATCH (dtype, clamp_kernel<T><<<elementwise_blocks (n), 256, 0, s>>> ((T *) x, n, limit));
}

extern "C" void
moe_cuda_rope (int dtype, void *x, int rows, int heads, int row_stride, int head_stride,
               const int64_t *positions, const float *inv_freq, int rope_dim, float scale, int interleaved,
               cudaStream_t s)
{
  if (interleaved)
    DISPATCH (dtype, launch_overlapped (rope_interleaved_kernel<T>, rows, 32, 0, s, (T *) x, heads, row_stride,
                                        head_stride, positions, inv_freq, rope_dim, scale));
  else
    DISPATCH (dtype, launch_overlapped (rope_kernel<T>, rows, rope_dim / 2 < 256 ? rope_dim / 2 : 256, 0, s,
                                        (T *) x, heads, row_stride, head_stride, positions, inv_freq, rope_dim,
                                        scale));
}

extern "C" void
moe_cuda_rope_store_kv (int dtype, void *qkv, int batch, int n_tokens, int row_stride, int heads, int kv_heads,
                        int head_dim, const int64_t *positions, const float *inv_freq, int rope_dim, float scale,
                        void *k_cache, void *v_cache, int capacity, int past, const int *past_dev, cudaStream_t s)
{
  dim3 grid (batch * n_tokens, heads + 2 * kv_heads);
  DISPATCH (dtype, launch_overlapped (rope_store_kv_kernel<T>, grid, head_dim < 256 ? head_dim : 256, 0, s,
                                      (T *) qkv, row_stride, heads, kv_heads, head_dim, n_tokens, positions,
                                      inv_freq, rope_dim, scale, (T *) k_cache, (T *) v_cache, capacity, past,
                                      past_dev));
}

extern "C" void
moe_cuda_rope_store_kv_rows (int dtype, void *qkv, int batch, int n_tokens, int row_stride, int heads,
                             int kv_heads, int head_dim, const int64_t *positions, const float *inv_freq,
                             int rope_dim, float scale, void *k_cache, void *v_cache, int capacity, int past,
                             const int *past_dev, cudaStream_t s)
{
  const size_t smem = (size_t) (rope_dim / 2) * 2 * sizeof (float);
  DISPATCH (dtype,
            if (fits_vec<T> ({ row_stride, head_dim, rope_dim / 2 }, { qkv, k_cache, v_cache }))
              launch_overlapped (rope_store_kv_rows_kernel<T, 16 / sizeof (T)>, batch * n_tokens, 256, smem, s,
                                 (T *) qkv, row_stride, heads, kv_heads, head_dim, n_tokens, positions, inv_freq,
                                 rope_dim, scale, (T *) k_cache, (T *) v_cache, capacity, past, past_dev);
            else
              launch_overlapped (rope_store_kv_rows_kernel<T, 1>, batch * n_tokens, 256, smem, s,
                                 (T *) qkv, row_stride, heads, kv_heads, head_dim, n_tokens, positions, inv_freq,
                                 rope_dim, scale, (T *) k_cache, (T *) v_cache, capacity, past, past_dev));
}

extern "C" void
moe_cuda_store_kv (int dtype, int batch, int n_tokens, int kv_heads,
                   const void *k1, int k1_row, int k1_head, int n1,
                   const void *k2, int k2_row, int k2_head, int n2,
                   const void *v, int v_row, int v_head, int dv,
                   void *k_cache, void *v_cache, int capacity, int past, const int *past_dev, cudaStream_t s)
{
  const int grid = batch * n_tokens;
  DISPATCH (dtype,
            bool vec = fits_vec<T> ({ k1_row, k1_head, n1, k2_row, k2_head, n2, v_row, v_head, dv },
                                    { k1, n2 > 0 ? k2 : nullptr, v, k_cache, v_cache });
            LAUNCH_VEC (vec, store_kv_kernel, grid, 256, s,
                        n_tokens, kv_heads, (const T *) k1, k1_row, k1_head, n1,
                        (const T *) k2, k2_row, k2_head, n2, (const T *) v, v_row, v_head, dv,
                        (T *) k_cache, (T *) v_cache, capacity, past, past_dev));
}

extern "C" int
moe_cuda_attention_keys (const MoeCudaAttention *a)
{
  return attention_keys (*a);
}

extern "C" int
moe_cuda_attention_splits (const MoeCudaAttention *a)
{
  return a->split_keys > 0 ? (moe_cuda_attention_keys (a) + a->split_keys - 1) / a->split_keys : 1;
}

extern "C" const char *
moe_cuda_attention (const MoeCudaAttention *a, cudaStream_t s)
{
  const int splits = moe_cuda_attention_splits (a);
  size_t smem = (size_t) attention_smem_floats (*a) * sizeof (float);
  static int max_smem = 0;   /* one GPU per process (the cuda device's), read once */
  dim3 grid (a->batch * a->n_tokens, a->heads, splits);

  if (max_smem == 0)
    {
      int dev = 0;
      cudaGetDevice (&dev);
      cudaDeviceGetAttribute (&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    }
  if (smem > (size_t) max_smem - 1024)
    return "the context is longer than the attention kernel's shared memory holds";
  DISPATCH (a->dtype,
            if (smem > 48 * 1024)
              cudaFuncSetAttribute (attention_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
            launch_overlapped (attention_kernel<T>, grid, 128, smem, s, *a);
            if (a->split_keys > 0)
              launch_overlapped (attention_combine_kernel<T>, dim3 (grid.x, grid.y), 128, 0, s, *a, splits));
  return NULL;
}

extern "C" void
moe_cuda_attention_pointers (const MoeCudaAttentionPointers *a, const void **out, cudaStream_t s)
{
  attention_pointers_kernel<<<1, 256, 0, s>>> (*a, out);
}

extern "C" void
moe_cuda_attention_softmax (const MoeCudaSoftmax *a, cudaStream_t s)
{
  DISPATCH (a->dtype, attention_softmax_kernel<T><<<a->batch * a->heads * a->rows, 256, 0, s>>> (*a));
}

extern "C" void
moe_cuda_route (const MoeCudaRouter *r, cudaStream_t s)
{
  /* ids (int64), weights, logits, choice, sig (float), taken (bytes,
   * padded), group scores */
  size_t smem = (size_t) r->top_k * (sizeof (int64_t) + sizeof (float)) +
                (size_t) 3 * r->num_experts * sizeof (float) + ((r->num_experts + 15) / 16) * 16 +
                (size_t) (r->n_group > 0 ? r->n_group : 1) * sizeof (float);
  /* with the router's weights, a warp an expert over a cluster of up to 8
   * blocks a row (the portable cluster size) on sm_90+, else one block of
   * up to 32 warps; the choice itself is one warp's */
  const int blocks = r->w != NULL && device_cc () >= 90 ? std::min (8, (r->num_experts + 3) / 4) : 1;
  const int warps = r->w != NULL ? std::min (32, (r->num_experts + blocks - 1) / blocks) : 1;
  DISPATCH (r->dtype,
            if (smem > 48 * 1024)
              cudaFuncSetAttribute (route_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
            launch_overlapped_clusters (route_kernel<T>, r->rows * blocks, 32 * warps, blocks, smem, s, *r, blocks));
}

template <typename T, int EPI>
void
launch_gemv (const MoeCudaGemv *a, cudaStream_t s)
{
  unsigned blocks = (unsigned) ((a->out + 7) / 8);
  switch (a->rows)
    {
    case 1: launch_overlapped (gemv_kernel<T, 1, EPI>, blocks, 256, 0, s, *a); break;
    case 2: launch_overlapped (gemv_kernel<T, 2, EPI>, blocks, 256, 0, s, *a); break;
    case 3: launch_overlapped (gemv_kernel<T, 3, EPI>, blocks, 256, 0, s, *a); break;
    case 4: launch_overlapped (gemv_kernel<T, 4, EPI>, blocks, 256, 0, s, *a); break;
    case 5: launch_overlapped (gemv_kernel<T, 5, EPI>, blocks, 256, 0, s, *a); break;
    case 6: launch_overlapped (gemv_kernel<T, 6, EPI>, blocks, 256, 0, s, *a); break;
    case 7: launch_overlapped (gemv_kernel<T, 7, EPI>, blocks, 256, 0, s, *a); break;
    default: launch_overlapped (gemv_kernel<T, 8, EPI>, blocks, 256, 0, s, *a); break;
    }
}

template <typename T, int EPI>
void
launch_gemv_rows (const MoeCudaGemv *a, cudaStream_t s)
{
  if constexpr (!std::is_same<T, float>::value)
    if (((uintptr_t) a->w | (uintptr_t) a->x) % 16 == 0 && a->in % 8 == 0 && a->ldx % 8 == 0)
      {
        unsigned blocks = (unsigned) ((a->out + 15) / 16);
        if (a->rows <= 8)
          launch_overlapped (gemv_mma_kernel<T, 1, EPI>, blocks, 256, 0, s, *a);
        else
          launch_overlapped (gemv_mma_kernel<T, 2, EPI>, blocks, 256, 0, s, *a);
        return;
      }
  /* the CUDA-core form, 8 rows a launch */
  for (int r0 = 0; r0 < a->rows; r0 += 8)
    {
      MoeCudaGemv c = *a;
      size_t y_elem = a->y_f32 ? sizeof (float) : sizeof (T);
      c.rows = a->rows - r0 < 8 ? a->rows - r0 : 8;
      c.x = (const T *) a->x + (size_t) r0 * a->ldx;
      c.y = (char *) a->y + (size_t) r0 * a->out * y_elem;
      c.gate = a->gate != nullptr ? (const T *) a->gate + (size_t) r0 * a->gate_stride : nullptr;
      launch_gemv<T, EPI> (&c, s);
    }
}

extern "C" void
moe_cuda_gemv (const MoeCudaGemv *a, cudaStream_t s)
{
  DISPATCH (a->dtype,
            if (a->gated)
              launch_gemv_rows<T, GEMV_GATED> (a, s);
            else if (a->add || a->gate != nullptr)
              launch_gemv_rows<T, GEMV_ADD> (a, s);
            else
              launch_gemv_rows<T, GEMV_PLAIN> (a, s));
}

extern "C" void
moe_cuda_act_mul (int dtype, void *gu, int rows, int width, int row_stride, int activation, const void *gate,
                  cudaStream_t s)
{
  DISPATCH (dtype, LAUNCH_VEC (fits_vec<T> ({ width, row_stride }, { gu }), act_mul_kernel,
                               rows, 256, s, (T *) gu, width, row_stride, activation, (const T *) gate));
}

extern "C" void
moe_cuda_bias_rows (int dtype, const void *bias, int rows, int width, void *y, cudaStream_t s)
{
  DISPATCH (dtype, LAUNCH_VEC (fits_vec<T> ({ width }, { bias, y }), bias_rows_kernel,
                               rows, 256, s, (const T *) bias, width, (T *) y));
}

extern "C" void
moe_cuda_to_f32 (int dtype, const void *x, size_t n, float *y, cudaStream_t s)
{
  DISPATCH (dtype, to_f32_kernel<T><<<elementwise_blocks (n), 256, 0, s>>> ((const T *) x, n, y));
}

extern "C" void
moe_cuda_argmax (const float *x, int rows, int n, int64_t *out, cudaStream_t s)
{
  launch_overlapped (argmax_kernel, rows, 1024, 0, s, x, n, out);
}
