/* moe-cuda-sampling.cu: do_sample's token choice where the logits are —
 * libmoe/moe-sampling.c's rule (temperature, top-k, top-p, one draw walked
 * over the kept tokens in id order) with no sort of the vocabulary: the
 * k-th best logit is found by a radix select, the few kept tokens are
 * sorted in shared memory; a top-p alone's cut is found by a radix select
 * over the weights; and with no filter or a top-p alone the draw is found
 * by a scan of the row in id order.
 *
 * A row is spread over a cluster of up to 8 blocks on sm_90+ (one block
 * before): each block takes a slice, each thread a run of consecutive ids
 * in it, so that sums run in id order a run at a time. The weights are
 * float32 exponentials summed in float64 (the host's are float64
 * throughout): a token differs from the host's only where the draw falls
 * within rounding of a boundary between two tokens.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "moe-cuda-decoder.h"
#include "moe-cuda-elements.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <climits>

namespace {

constexpr int THREADS = MOE_CUDA_SAMPLE_MAX_KEPT;   /* a block's; one kept token a thread */
constexpr int MAX_CLUSTER = 8;                      /* the portable cluster size */
constexpr int BLOCK_LOGITS = 16384;                 /* a row spreads over a cluster past this */

/* The blocks that share a row: a cluster on sm_90+, else one block */
struct Group {
  int size, rank;

  __device__ void
  sync () const
  {
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size > 1)
      {
        cooperative_groups::this_cluster ().sync ();
        return;
      }
#endif
    __syncthreads ();
  }

  /* @p's twin in block @r's shared memory */
  template <typename T>
  __device__ T *
  at (T *p, int r) const
  {
#if defined (__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size > 1)
      return cooperative_groups::this_cluster ().map_shared_rank (p, r);
#endif
    (void) r;
    return p;
  }
};

/* a float's bits as an unsigned integer in the floats' order */
__device__ __forceinline__ unsigned
order_key (float x)
{
  unsigned b = __float_as_uint (x);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}

__device__ __forceinline__ float
key_value (unsigned k)
{
  return __uint_as_float (k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

template <typename T>
__device__ __forceinline__ T
warp_inclusive (T v)
{
  const int lane = threadIdx.x % 32;

  for (int o = 1; o < 32; o <<= 1)
    {
      T u = __shfl_up_sync (0xffffffffu, v, o);
      if (lane >= o)
        v += u;
    }
  return v;
}

/* The sum of the block's @v before this thread's, and all of them in
 * @total (blocks of THREADS threads) */
template <typename T>
__device__ T
block_exclusive (T v, T &total)
{
  __shared__ T part[32];
  __shared__ T sum;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inc = warp_inclusive (v), ex = __shfl_up_sync (0xffffffffu, inc, 1);

  if (lane == 31)
    part[warp] = inc;
  __syncthreads ();
  if (warp == 0)
    {
      T p = part[lane], pi = warp_inclusive (p), pe = __shfl_up_sync (0xffffffffu, pi, 1);
      part[lane] = lane > 0 ? pe : T (0);
      if (lane == 31)
        sum = pi;
    }
  __syncthreads ();
  ex = part[warp] + (lane > 0 ? ex : T (0));
  total = sum;
  __syncthreads ();
  return ex;
}

__device__ float
block_max (float v)
{
  __shared__ float part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf (v, __shfl_xor_sync (0xffffffffu, v, o));
  if (lane == 0)
    part[warp] = v;
  __syncthreads ();
  v = part[lane];
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf (v, __shfl_xor_sync (0xffffffffu, v, o));
  __syncthreads ();
  return v;
}

/* @a's first @n values (one a thread) sorted largest first, bitonically
 * (the rest of the next power of two padded with 0) */
__device__ void
block_sort_descending (unsigned long long *a, int n)
{
  int p = 1;

  while (p < n)
    p <<= 1;
  if ((int) threadIdx.x < p && (int) threadIdx.x >= n)
    a[threadIdx.x] = 0;
  __syncthreads ();
  for (int k = 2; k <= p; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1)
      {
        const int i = threadIdx.x, l = i ^ j;
        if (i < p && l > i)
          {
            unsigned long long x = a[i], y = a[l];
            if ((i & k) == 0 ? x < y : x > y)
              a[i] = y, a[l] = x;
          }
        __syncthreads ();
      }
}

/* The first thread (of those with @w > 0) whose run ends past @r — where
 * the draw falls — or, should rounding leave none, the last with w > 0 */
__device__ int
block_pick (double ex, double w, double r)
{
  __shared__ int first, last;

  if (threadIdx.x == 0)
    first = INT_MAX, last = -1;
  __syncthreads ();
  if (w > 0)
    {
      if (ex + w > r)
        atomicMin (&first, (int) threadIdx.x);
      atomicMax (&last, (int) threadIdx.x);
    }
  __syncthreads ();
  int pick = first != INT_MAX ? first : last;
  __syncthreads ();
  return pick;
}

/* A per-thread @run summed over the group in id order: the sum of the
 * block's runs before this thread's, the block's own, the blocks' before
 * this block and the group's, each added run by run, block by block.
 * @slot: a __shared__ the group reads this block's sum from (one a use) */
template <typename T>
struct GroupSum {
  T in_block_before, block, blocks_before, total;
};

template <typename T>
__device__ GroupSum<T>
group_sum (const Group &g, T run, T *slot)
{
  GroupSum<T> s;

  s.in_block_before = block_exclusive (run, s.block);
  if (threadIdx.x == 0)
    *slot = s.block;
  g.sync ();
  s.blocks_before = s.total = T (0);
  for (int r = 0; r < g.size; r++)
    {
      const T t = *g.at (slot, r);
      if (r < g.rank)
        s.blocks_before += t;
      s.total += t;
    }
  return s;
}

/* The last id of the group's rows in [@lo, @hi) (this thread's run) that
 * @match holds for, or −1; @slot: a __shared__ the group reads (one a
 * use). The caller syncs the group before its blocks may exit. */
template <typename F>
__device__ int
group_last (const Group &g, int lo, int hi, F match, int *slot)
{
  int last = -1;

  if (threadIdx.x == 0)
    *slot = -1;
  __syncthreads ();
  for (int i = hi - 1; i >= lo; i--)
    if (match (i))
      {
        atomicMax (slot, i);
        break;
      }
  g.sync ();
  for (int r = 0; r < g.size; r++)
    last = max (last, *g.at (slot, r));
  return last;
}

__global__ void __launch_bounds__ (THREADS)
sample_kernel (MoeCudaSampling s, int group_size)
{
  __shared__ unsigned hist[2][256], counts[256];
  __shared__ unsigned long long kept[THREADS];   /* the candidates, in the group's first block */
  __shared__ float part_max;                     /* this block's, read by the group */
  __shared__ double part_sum;
  __shared__ unsigned long long part_count;
  __shared__ unsigned digit, digit_need;
  __shared__ double walk_sum, part_tie, digit_above;
  __shared__ int walk_last, cut_first, cut_last;
  __shared__ struct {
    double warp[32][64], stage[32][32], block[2][64], total[64];
    unsigned warp_count[32][64], block_count[2][64], total_count[64];
  } mass;                                        /* top-p alone's radix select */
  const Group g = { group_size, (int) (blockIdx.x % group_size) };
  const int row = blockIdx.x / group_size, tid = threadIdx.x;
  const bool top_k = s.top_k > 0 && s.top_k < s.n, top_p = s.top_p < 1.0;

  pdl_begin ();
  const double u = s.draws[row];
  /* (each return before the group's first sync is the whole group's) */
  if (u < 0 || (top_k && s.top_k > THREADS))
    {
      /* not sampled, or more kept tokens than threads: the host's */
      if (g.rank == 0 && tid == 0)
        s.out[row] = -1;
      return;
    }
  const float *x = s.logits + (size_t) row * s.n;
  const int slice = (s.n + g.size - 1) / g.size, end = std::min ((g.rank + 1) * slice, s.n);
  const int per = (slice + THREADS - 1) / THREADS, lo = g.rank * slice + tid * per, hi = std::min (lo + per, end);
  const float T = s.temperature;

  /* the largest logit, and each token's weight exp (l/T − max/T) */
  float m = -INFINITY;
  for (int i = lo; i < hi; i++)
    m = fmaxf (m, x[i]);
  m = block_max (m);
  if (tid == 0)
    part_max = m;
  g.sync ();
  for (int r = 0; r < g.size; r++)
    m = fmaxf (m, *g.at (&part_max, r));
  const float top = m / T;
  auto weight = [&] (float l) { return (double) expf (l / T - top); };

  /* The draw over the tokens kept (i) keeps, walked in id order: to the
   * block whose share holds it, that block's run, that run's token; the
   * sums of their weights run by run, block by block, the blocks' before
   * this one and all, added in that order. */
  auto walk = [&] (auto kept) {
    double run = 0;
    for (int i = lo; i < hi; i++)
      if (kept (i))
        run += weight (x[i]);
    const GroupSum<double> sum = group_sum (g, run, &walk_sum);
    const double r = u * sum.total;
    if (!(r < sum.total))
      {
        /* r rounded up to the total (or no weights): the last kept token */
        const int last = group_last (g, lo, hi, kept, &walk_last);
        if (g.rank == 0 && tid == 0)
          s.out[row] = last >= 0 ? last : s.n - 1;
        g.sync ();   /* every block's walk_last read */
        return;
      }
    g.sync ();   /* every block has read the others' sums */
    if (!(sum.blocks_before <= r && r < sum.blocks_before + sum.block))
      return;
    const double rb = r - sum.blocks_before;
    if (tid != block_pick (sum.in_block_before, run, rb))
      return;
    double acc = sum.in_block_before;
    int last = lo;
    for (int i = lo; i < hi; i++)
      if (kept (i))
        {
          double w = weight (x[i]);
          acc += w;
          if (rb < acc)
            {
              s.out[row] = i;
              return;
            }
          if (w > 0)
            last = i;
        }
    s.out[row] = last;
  };

  if (!top_k && !top_p)
    {
      walk ([] (int) { return true; });
      return;
    }

  if (!top_k)
    {
      /* top-p alone: the fewest best tokens that hold top_p of the row's
       * weight M — its key by a radix select over the weights (6 bits a
       * round from the top: the weight of each next digit among the keys
       * that start as the cut's), then, of the tokens with that key, the
       * first in id order where the weight reaches M — and the draw over
       * them in id order */
      double above = 0;
      unsigned prefix = 0;
      double row_run = 0;
      for (int i = lo; i < hi; i++)
        row_run += weight (x[i]);
      const double M = s.top_p * group_sum (g, row_run, &part_sum).total;
      const int lane = tid % 32, warp = tid / 32;
      for (int d = 0; d < 6; d++)
        {
          const int width = d < 5 ? 6 : 2, shift = d < 5 ? 26 - 6 * d : 0;
          const unsigned same_top = d == 0 ? 0u : ~0u << (shift + width);
          double *bm = mass.block[d & 1];
          unsigned *bc = mass.block_count[d & 1];

          /* each warp's own histogram, each digit's weights added by the
           * first lane that has it, in lane order: no atomics */
          mass.warp[warp][lane] = mass.warp[warp][lane + 32] = 0;
          mass.warp_count[warp][lane] = mass.warp_count[warp][lane + 32] = 0;
          __syncwarp ();
          for (int j = 0; j < per; j++)
            {
              const int i = lo + j;
              const unsigned k = i < hi ? order_key (x[i]) : 0;
              const bool in = i < hi && ((k ^ prefix) & same_top) == 0;
              const unsigned b = in ? (k >> shift) & ((1u << width) - 1) : 64u;
              mass.stage[warp][lane] = in ? weight (x[i]) : 0.0;
              const unsigned alike = __match_any_sync (0xffffffffu, b);
              __syncwarp ();
              if (in && lane == __ffs (alike) - 1)
                {
                  double sum = 0;
                  for (unsigned a = alike; a != 0; a &= a - 1)
                    sum += mass.stage[warp][__ffs (a) - 1];
                  mass.warp[warp][b] += sum;
                  mass.warp_count[warp][b] += __popc (alike);
                }
              __syncwarp ();
            }
          __syncthreads ();
          if (tid < 64)
            {
              double m_ = 0;
              unsigned c_ = 0;
              for (int w = 0; w < 32; w++)
                m_ += mass.warp[w][tid], c_ += mass.warp_count[w][tid];
              bm[tid] = m_, bc[tid] = c_;
            }
          g.sync ();
          if (tid < 64)
            {
              double m_ = 0;
              unsigned c_ = 0;
              for (int r = 0; r < g.size; r++)
                m_ += g.at (bm, r)[tid], c_ += g.at (bc, r)[tid];
              mass.total[tid] = m_, mass.total_count[tid] = c_;
            }
          __syncthreads ();
          if (warp == 0)
            {
              /* lane l holds digits 63 − 2l and 62 − 2l: the first (from
               * the top) where the weight reaches M; should rounding leave
               * none, the last with tokens */
              const int b0 = 63 - 2 * lane, b1 = b0 - 1;
              const double m0 = mass.total[b0], m1 = mass.total[b1];
              const unsigned c0 = mass.total_count[b0], c1 = mass.total_count[b1];
              const double inc = warp_inclusive (m0 + m1), up = __shfl_up_sync (0xffffffffu, inc, 1);
              const double ex = lane > 0 ? up : 0.0;
              const bool hit0 = c0 > 0 && above + (ex + m0) >= M, hit1 = c1 > 0 && above + ((ex + m0) + m1) >= M;
              const unsigned hits = __ballot_sync (0xffffffffu, hit0 || hit1);
              const unsigned any = __ballot_sync (0xffffffffu, c0 > 0 || c1 > 0);
              const int at = hits != 0 ? __ffs (hits) - 1 : 31 - __clz (any);
              if (lane == at)
                {
                  const bool first = hits != 0 ? hit0 : c1 == 0;
                  digit = first ? b0 : b1;
                  digit_above = above + (first ? ex : ex + m0);
                }
            }
          __syncthreads ();
          prefix |= digit << shift;
          above = digit_above;
        }

      /* of the tokens with the cut's key, the first in id order where the
       * weight reaches M (or the last of them) */
      {
        auto tied = [&] (int i) { return order_key (x[i]) == prefix; };
        double run = 0;
        for (int i = lo; i < hi; i++)
          if (tied (i))
            run += weight (x[i]);
        if (tid == 0)
          cut_first = INT_MAX;
        const GroupSum<double> tie = group_sum (g, run, &part_tie);
        double acc = tie.in_block_before + tie.blocks_before;
        for (int i = lo; i < hi; i++)
          if (order_key (x[i]) == prefix)
            {
              acc += weight (x[i]);
              if (above + acc >= M)
                {
                  atomicMin (&cut_first, i);
                  break;
                }
            }
        const int last = group_last (g, lo, hi, tied, &cut_last);   /* (its sync ends cut_first's atomics) */
        int first = INT_MAX;
        for (int r = 0; r < g.size; r++)
          first = min (first, *g.at (&cut_first, r));
        const int cut = first != INT_MAX ? first : last;
        walk ([&] (int i) {
          const unsigned k = order_key (x[i]);
          return k > prefix || (k == prefix && i <= cut);
        });
      }
      return;
    }

  /* top-k: the k best tokens (ties in id order) */
  const unsigned want = s.top_k;
  unsigned prefix = 0, need = want;
  for (int d = 0; d < 4; d++)
    {
      /* radix select, 8 bits a round from the top: how many tokens of the
       * keys that start as the m-th best's does so far have each next
       * digit */
      const int shift = 24 - 8 * d;
      const unsigned same_top = d == 0 ? 0u : ~0u << (shift + 8);
      unsigned *h = hist[d & 1];   /* (two: the group reads one while the next fills) */

      if (tid < 256)
        h[tid] = 0;
      __syncthreads ();
      for (int j = 0; j < per; j++)
        {
          const int i = lo + j;
          const unsigned k = i < hi ? order_key (x[i]) : 0;
          const bool in = i < hi && ((k ^ prefix) & same_top) == 0;
          const unsigned b = in ? (k >> shift) & 255u : 256u;
          const unsigned alike = __match_any_sync (0xffffffffu, b);
          if (in && tid % 32 == __ffs (alike) - 1)
            atomicAdd (&h[b], __popc (alike));
        }
      g.sync ();
      if (tid < 256)
        {
          unsigned c = 0;
          for (int r = 0; r < g.size; r++)
            c += g.at (h, r)[tid];
          counts[tid] = c;
        }
      __syncthreads ();
      if (tid < 32)
        {
          /* lane l holds digits 255 − 8l down to 248 − 8l */
          unsigned c[8], sum = 0;
          for (int q = 0; q < 8; q++)
            sum += c[q] = counts[255 - 8 * tid - q];
          const unsigned inc = warp_inclusive (sum);
          unsigned acc = inc - sum;
          if (acc < need && need <= inc)
            for (int q = 0; q < 8; q++)
              {
                if (acc + c[q] >= need)
                  {
                    digit = 255 - 8 * tid - q;
                    digit_need = need - acc;
                    break;
                  }
                acc += c[q];
              }
        }
      __syncthreads ();
      prefix |= digit << shift;
      need = digit_need;
    }

  /* the candidates, into the first block: those above the m-th best's
   * key, and of those equal to it the first `need` in id order; each as
   * (key, ~id): largest first is best first */
  {
    const unsigned above = want - need;
    unsigned a = 0, e = 0;
    for (int i = lo; i < hi; i++)
      {
        const unsigned k = order_key (x[i]);
        a += k > prefix;
        e += k == prefix;
      }
    const GroupSum<unsigned long long> count = group_sum (g, (unsigned long long) a << 32 | e, &part_count);
    const unsigned long long at = count.in_block_before + count.blocks_before;
    unsigned long long *dst = g.at (kept, 0);
    unsigned a_at = (unsigned) (at >> 32), e_at = (unsigned) at;
    for (int i = lo; i < hi; i++)
      {
        const unsigned k = order_key (x[i]);
        const unsigned long long c = (unsigned long long) k << 32 | ~(unsigned) i;
        if (k > prefix)
          dst[a_at++] = c;
        else if (k == prefix && e_at < need)
          dst[above + e_at++] = c;
      }
    g.sync ();
  }
  if (g.rank != 0)
    return;

  /* best first; top-p keeps the fewest that hold top_p of the k's
   * probability */
  int n = (int) want;
  block_sort_descending (kept, n);
  if (top_p)
    {
      const double w = tid < n ? weight (key_value ((unsigned) (kept[tid] >> 32))) : 0.0;
      double sum, ex = block_exclusive (w, sum);
      __shared__ int cut;
      if (tid == 0)
        cut = INT_MAX;
      __syncthreads ();
      if (tid < n && (ex + w) / sum >= s.top_p)
        atomicMin (&cut, tid);
      __syncthreads ();
      n = cut == INT_MAX ? n : cut + 1;
      __syncthreads ();
    }

  /* the draw over the kept tokens in id order: (~id, key), largest first */
  if (tid < n)
    kept[tid] = kept[tid] << 32 | kept[tid] >> 32;
  __syncthreads ();
  block_sort_descending (kept, n);
  const double w = tid < n ? weight (key_value ((unsigned) kept[tid])) : 0.0;
  double sum, ex = block_exclusive (w, sum);
  const int pick = block_pick (ex, w, u * sum);
  if (tid == (pick >= 0 ? pick : n - 1))
    s.out[row] = ~(unsigned) (kept[tid] >> 32);
}

} /* namespace */

extern "C" void
moe_cuda_sample (const MoeCudaSampling *s, cudaStream_t stream)
{
  const int group = device_cc () >= 90 ? std::clamp ((s->n + BLOCK_LOGITS - 1) / BLOCK_LOGITS, 1, MAX_CLUSTER) : 1;

  launch_overlapped_clusters (sample_kernel, s->rows * group, THREADS, group, 0, stream, *s, group);
}
