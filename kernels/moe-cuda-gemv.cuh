/* moe-cuda-gemv.cuh: the few-row product on the tensor cores, shared by
 * the decoder's projections and the experts' per-row form
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include "moe-cuda-elements.cuh"

namespace {

/* y[r][n] = x[r] · w_n for up to 8·NT rows of x (bf16/f16, @ldx apart; @in
 * a multiple of 8, rows and weight rows 16-byte aligned), by a block of 8
 * warps for outputs @n0 … @n0 + 15: M = 1, or M = 2 for a
 * gate and an up weight row per output. @weight_row (m, n) gives where
 * weight row m of output n starts.
 *
 * Warp w takes the 32-wide chunks w, w + 8, … of in as m16n8k16 products
 * with the weights as A and the rows as B. A product's k order is free, so
 * a lane loads 8 consecutive weights of its output (16 bytes, coalesced by
 * 4 lanes into 64) and the same 8 of its row of x: its A and B fragments
 * for two k16 steps. With @weights_first the first chunks' weight loads go
 * out between pdl_release () and pdl_wait (): weights that never depend on
 * the kernels before are on their way while a short kernel before still
 * runs (else the caller has waited, and @weight_row may read what they
 * wrote).
 *
 * Then the warps' partial sums meet in shared memory and thread (n, r)
 * gets its sums in @s: TRUE where it has an output to store. */
template <typename T, int NT, int M, typename WeightRow>
__device__ __forceinline__ bool
gemv_mma_sums (WeightRow weight_row, int n0, int out, int in, const T *x, int ldx, int rows, bool weights_first,
               float s[M], int *n_out, int *r_out)
{
  constexpr int WARPS = 8, U = 8 / M;
  __shared__ float red[WARPS][M][16][8 * NT];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int chunks = (in + 31) / 32;
  const uint4 zero = make_uint4 (0, 0, 0, 0);
  const uint4 *wrow[M][2], *xrow[NT];
  bool wok[2], xok[NT];
  float acc[M][NT][4] = {};
  uint4 wv[U][M][2], xv[U][NT];

  /* chunk j0 + u of this warp: its index, and whether the lane's 8 lie in @in */
  auto chunk = [&] (int j0, int u) { return warp + WARPS * (j0 + u); };
  auto lane_in = [&] (int c) { return c * 32 + 8 * q < in; };
  auto load_weights = [&] (int j0) {
#pragma unroll
    for (int u = 0; u < U; u++)
      {
        const int c = chunk (j0, u);
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
          for (int h = 0; h < 2; h++)
            wv[u][m][h] = lane_in (c) && wok[h] ? __ldg (wrow[m][h] + 4 * c) : zero;
      }
  };

  if (weights_first)
    pdl_release ();
#pragma unroll
  for (int h = 0; h < 2; h++)
    {
      const int n = n0 + g + 8 * h;
      wok[h] = n < out;
#pragma unroll
      for (int m = 0; m < M; m++)
        wrow[m][h] = (const uint4 *) (weight_row (m, wok[h] ? n : n0) + 8 * q);
    }
#pragma unroll
  for (int t = 0; t < NT; t++)
    {
      xok[t] = g + 8 * t < rows;
      xrow[t] = (const uint4 *) (x + (size_t) (xok[t] ? g + 8 * t : 0) * ldx + 8 * q);
    }
  load_weights (0);
  if (weights_first)
    pdl_wait ();
  for (int j0 = 0; chunk (j0, 0) < chunks; j0 += U)
    {
      if (j0 > 0)
        load_weights (j0);
#pragma unroll
      for (int u = 0; u < U; u++)
#pragma unroll
        for (int t = 0; t < NT; t++)
          xv[u][t] = lane_in (chunk (j0, u)) && xok[t] ? __ldg (xrow[t] + 4 * chunk (j0, u)) : zero;
#pragma unroll
      for (int u = 0; u < U; u++)
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
          for (int t = 0; t < NT; t++)
            {
              const uint4 &w0 = wv[u][m][0], &w1 = wv[u][m][1], &xx = xv[u][t];
              const unsigned a0[4] = { w0.x, w1.x, w0.y, w1.y }, b0[2] = { xx.x, xx.y };
              const unsigned a1[4] = { w0.z, w1.z, w0.w, w1.w }, b1[2] = { xx.z, xx.w };
              mma16816<T> (acc[m][t], a0, b0);
              mma16816<T> (acc[m][t], a1, b1);
            }
    }

  /* the 8 warps' partial sums, then a thread per (output, row) */
#pragma unroll
  for (int m = 0; m < M; m++)
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
      for (int i = 0; i < 4; i++)
        red[warp][m][g + 8 * (i / 2)][8 * t + 2 * q + i % 2] = acc[m][t][i];
  __syncthreads ();
  const int o = threadIdx.x % 16, r = threadIdx.x / 16;
  if (r >= rows || r >= 8 * NT || n0 + o >= out)
    return false;
#pragma unroll
  for (int m = 0; m < M; m++)
    {
      s[m] = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; w++)
        s[m] += red[w][m][o][r];
    }
  *n_out = n0 + o;
  *r_out = r;
  return true;
}

} /* namespace */
