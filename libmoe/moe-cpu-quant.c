/* moe-cpu-quant.c: FP8 block-scaled and FP4-packed expert weights on the CPU
 *
 * Formats (transformers' fine-grained FP8, DeepSeek's checkpoints):
 *  - FP8: e4m3 ("fn": no infinities, 0x7f/0xff NaN) weights [n, k], one
 *    scale per 128×128 block, F32 or UE8M0; the weight is value × scale.
 *  - FP4: e2m1 codes packed two per byte along k (element 2j in the low
 *    nibble), sign in bit 3, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; one
 *    UE8M0 scale per row and 32 values along k.
 *
 * The activations are quantized dynamically (transformers' "dynamic"
 * scheme): per row and 128-wide group, scale = amax / 448, value rounded to
 * e4m3; the products are then those of the dequantized values, summed in
 * float32.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>
#include <string.h>
#include <cblas.h>

#include "moe-cpu-kernels.h"
#include "moe-private.h"

#define FP8_MAX 448.0f
#define FP8_BLOCK 128
#define FP4_GROUP 32
#define ACT_GROUP 128

static float e4m3_table[256];

static void
init_e4m3_table (void)
{
  static gsize done;

  if (!g_once_init_enter (&done))
    return;
  for (guint b = 0; b < 256; b++)
    {
      guint e = (b >> 3) & 15, m = b & 7;
      float v;

      if (e == 15 && m == 7)
        v = NAN;
      else if (e == 0)
        v = ldexpf ((float) m / 8.0f, -6);
      else
        v = ldexpf (1.0f + (float) m / 8.0f, (int) e - 7);
      e4m3_table[b] = (b & 0x80) ? -v : v;
    }
  g_once_init_leave (&done, 1);
}

/**
 * moe_e4m3_to_f32: (skip)
 * @v: an e4m3 ("fn") byte
 *
 * Returns: its value
 */
float
moe_e4m3_to_f32 (guint8 v)
{
  init_e4m3_table ();
  return e4m3_table[v];
}

/**
 * moe_e8m0_to_f32: (skip)
 * @v: a UE8M0 byte
 *
 * Returns: 2^(v − 127), NaN for 255
 */
float
moe_e8m0_to_f32 (guint8 v)
{
  return v == 255 ? NAN : ldexpf (1.0f, (int) v - 127);
}

/**
 * moe_fp4_to_f32: (skip)
 * @code: an e2m1 code (low four bits)
 *
 * Returns: its value
 */
float
moe_fp4_to_f32 (guint8 code)
{
  static const float magnitude[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };
  float v = magnitude[code & 7];
  return (code & 8) ? -v : v;
}

/**
 * moe_f32_round_to_e4m3: (skip)
 * @v: a value
 *
 * Returns: @v rounded to the nearest e4m3 value (ties to even), saturated
 *   at ±448
 */
float
moe_f32_round_to_e4m3 (float v)
{
  float a = fabsf (v), r;

  if (isnan (v))
    return v;
  if (a >= FP8_MAX)
    r = FP8_MAX;
  else if (a < 0.015625f)
    r = rintf (a * 512.0f) / 512.0f;      /* subnormals: steps of 2^-9 */
  else
    {
      union { float f; guint32 u; } c = { .f = a };
      c.u += 0x7ffff + ((c.u >> 20) & 1);   /* keep 3 mantissa bits, ties to even */
      c.u &= 0xfff00000u;
      r = MIN (c.f, FP8_MAX);
    }
  return copysignf (r, v);
}

static float
load_scale (MoeDType dtype, gconstpointer scale, gsize i)
{
  if (dtype == MOE_DTYPE_E8M0)
    return moe_e8m0_to_f32 (((const guint8 *) scale)[i]);
  return ((const float *) scale)[i];
}

/**
 * moe_cpu_matrix_is_quantized: (skip)
 * @w: a matrix
 *
 * Returns: %TRUE for FP8 (F8E4M3) and FP4-packed (I8) weights
 */
gboolean
moe_cpu_matrix_is_quantized (const MoeCpuMatrix *w)
{
  return _moe_dtype_is_quantized_weight (w->dtype);
}

/* The scale row of weight row r: blocks over all rows, or over each half
 * of a gate/up weight quantized as two matrices. */
static gsize
fp8_scale_row (const MoeCpuMatrix *w, gsize r)
{
  gsize s = w->scale_split;
  if (s == 0)
    return r / FP8_BLOCK;
  return r < s ? r / FP8_BLOCK : (s + FP8_BLOCK - 1) / FP8_BLOCK + (r - s) / FP8_BLOCK;
}

/**
 * moe_cpu_dequantize_rows: (skip)
 * @w: a quantized matrix stored `[n, k]`
 * @row0: the first row
 * @rows: how many rows
 * @dst: `[rows, k]` float32 output
 *
 * Multiplies rows of a quantized weight out to float32.
 */
void
moe_cpu_dequantize_rows (const MoeCpuMatrix *w,
                         gsize               row0,
                         gsize               rows,
                         float              *dst)
{
  gsize k = w->k;

  init_e4m3_table ();
  for (gsize r = 0; r < rows; r++)
    {
      gsize row = row0 + r;
      float *o = dst + r * k;

      if (w->dtype == MOE_DTYPE_F8E4M3)
        {
          const guint8 *q = (const guint8 *) w->data + row * k;
          gsize cols = (k + FP8_BLOCK - 1) / FP8_BLOCK, srow = fp8_scale_row (w, row);
          for (gsize b = 0; b < cols; b++)
            {
              float s = load_scale (w->scale_dtype, w->scale, srow * cols + b);
              gsize end = MIN (k, (b + 1) * FP8_BLOCK);
              for (gsize j = b * FP8_BLOCK; j < end; j++)
                o[j] = e4m3_table[q[j]] * s;
            }
        }
      else
        {
          const guint8 *q = (const guint8 *) w->data + row * (k / 2);
          gsize groups = k / FP4_GROUP;
          for (gsize g = 0; g < groups; g++)
            {
              float s = load_scale (w->scale_dtype, w->scale, row * groups + g);
              for (gsize j = g * FP4_GROUP; j < (g + 1) * FP4_GROUP; j += 2)
                {
                  guint8 byte = q[j / 2];
                  o[j] = moe_fp4_to_f32 (byte & 15) * s;
                  o[j + 1] = moe_fp4_to_f32 (byte >> 4) * s;
                }
            }
        }
    }
}

/**
 * moe_cpu_quantize_activations: (skip)
 * @x: `[m, k]` activations
 * @m: rows
 * @k: columns
 * @dst: `[m, k]` output (may be @x)
 *
 * The dynamic activation scheme, as values: each row's 128-wide groups
 * scaled by amax / 448 (1 for an all-zero group), rounded to e4m3 and
 * scaled back.
 */
void
moe_cpu_quantize_activations (const float *x,
                              gsize        m,
                              gsize        k,
                              float       *dst)
{
  for (gsize r = 0; r < m; r++)
    for (gsize g = 0; g < k; g += ACT_GROUP)
      {
        gsize end = MIN (k, g + ACT_GROUP);
        float amax = 0.0f, s;

        for (gsize j = g; j < end; j++)
          amax = MAX (amax, fabsf (x[r * k + j]));
        s = amax > 0.0f ? amax / FP8_MAX : 1.0f;
        for (gsize j = g; j < end; j++)
          dst[r * k + j] = moe_f32_round_to_e4m3 (x[r * k + j] / s) * s;
      }
}

/* y[m, n] = quantize(x)[m, k] · dequantize(W)ᵀ, 64 weight rows at a time:
 * no dequantized copy of the whole weight is made. */
void
_moe_cpu_matmul_quantized (const float        *x,
                           gsize               m,
                           const MoeCpuMatrix *w,
                           float              *y)
{
  enum { PANEL = 64 };
  gsize n = w->n, k = w->k;
  g_autofree float *xq = g_new (float, m * k);
  g_autofree float *panel = g_new (float, PANEL * k);

  moe_cpu_quantize_activations (x, m, k, xq);
  for (gsize n0 = 0; n0 < n; n0 += PANEL)
    {
      gsize rows = MIN ((gsize) PANEL, n - n0);

      moe_cpu_dequantize_rows (w, n0, rows, panel);
      if (m == 1)
        cblas_sgemv (CblasRowMajor, CblasNoTrans, rows, k, 1.0f, panel, k, xq, 1, 0.0f, y + n0, 1);
      else
        cblas_sgemm (CblasRowMajor, CblasNoTrans, CblasTrans, m, rows, k, 1.0f, xq, k,
                     panel, k, 0.0f, y + n0, n);
    }
}

/* [.., n, k] quantized (F8E4M3 or I8) with [.., rows, cols] scales -> dtype */
MoeTensor *
_moe_dequantize (MoeTensor  *weight,
                 MoeTensor  *scale,
                 gsize       split,
                 MoeDType    dtype,
                 GError    **error)
{
  guint nd = moe_tensor_get_n_dims (weight);
  const gint64 *ws = moe_tensor_get_shape (weight, NULL);
  gsize E = nd == 3 ? (gsize) ws[0] : 1, n = ws[nd - 2];
  gboolean fp4 = moe_tensor_get_dtype (weight) == MOE_DTYPE_I8;
  gsize k = fp4 ? 2 * (gsize) ws[nd - 1] : (gsize) ws[nd - 1];
  gsize srows = moe_tensor_get_dim (scale, moe_tensor_get_n_dims (scale) - 2);
  gsize scols = moe_tensor_get_dim (scale, moe_tensor_get_n_dims (scale) - 1);
  gint64 shape[3] = { (gint64) E, (gint64) n, (gint64) k };
  g_autoptr(MoeTensor) out = moe_tensor_new_empty (NULL, dtype, nd == 3 ? shape : shape + 1, nd, error);
  g_autofree float *rows = NULL;
  gsize esz = moe_dtype_get_size (dtype);

  if (out == NULL)
    return NULL;
  rows = g_new (float, MAX (k, 1));
  for (gsize e = 0; e < E; e++)
    {
      MoeCpuMatrix w = {
        .dtype = moe_tensor_get_dtype (weight),
        .data = (const guint8 *) moe_tensor_get_data (weight) + e * n * (fp4 ? k / 2 : k),
        .n = n, .k = k,
        .scale = (const guint8 *) moe_tensor_get_data (scale) + e * srows * scols * moe_dtype_get_size (moe_tensor_get_dtype (scale)),
        .scale_dtype = moe_tensor_get_dtype (scale), .scale_rows = srows, .scale_split = split,
      };
      for (gsize r = 0; r < n; r++)
        {
          moe_cpu_dequantize_rows (&w, r, 1, rows);
          moe_cpu_convert (MOE_DTYPE_F32, rows, dtype,
                           (guint8 *) moe_tensor_get_mutable_data (out) + (e * n + r) * k * esz, k);
        }
    }
  return g_steal_pointer (&out);
}
