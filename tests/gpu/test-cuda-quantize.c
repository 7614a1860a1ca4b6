/* test-cuda-quantize.c: the FP8 grouped GEMMs' activation quantizer
 * (moe_cuda_quantize_fp8) against the dynamic scheme's rule, byte for byte
 * and scale for scale: per row and 128-wide group, s = amax / 448 (1 for
 * an all-zero group) and each value the e4m3 of v / s — the float
 * division, rounded to nearest even, saturated at ±448 (transformers-
 * experts.md §5). The kernel divides by a product and two FMAs; the rows
 * here hold quotients that fall on e4m3's rounding midpoints, groups
 * whose scale is too small or too large for that form, partial last
 * groups and all-zero ones. The fixtures check the layers within their
 * tolerance; this checks the rounding exactly.
 *
 * Links the kernels directly. Exits 77 (skipped) where there is no CUDA
 * device.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <string.h>

#include "moe-test-cuda-kernels.h"
#include "moe-cuda-experts.h"

typedef struct {
  const char *name;
  int dtype;
  int rows, K;
} Problem;

static const Problem problems[] = {
  { "bf16-2048", MOE_CUDA_BF16, 67, 2048 },
  { "f32-2048", MOE_CUDA_F32, 67, 2048 },
  { "f16-768", MOE_CUDA_F16, 33, 768 },
  { "bf16-partial-200", MOE_CUDA_BF16, 45, 200 },   /* groups of 128 and 72 */
  { "f32-8", MOE_CUDA_F32, 9, 8 },
};

/* |v| as e4m3's bits 0-6: the nearest of its 127 finite values, ties to
 * the even code, saturated at 448 (code 126); NaN as 127 */
static guint8
e4m3_magnitude (float v)
{
  double a = fabs ((double) v), best = INFINITY;
  guint8 code = 0;

  if (isnan (v))
    return 0x7f;
  if (a > 448.0)
    return 126;
  for (int c = 0; c < 127; c++)
    {
      int e = c >> 3, m = c & 7;
      double value = e == 0 ? ldexp (m / 8.0, -6) : ldexp (1.0 + m / 8.0, e - 7), d = fabs (a - value);
      if (d < best || (d == best && c % 2 == 0))
        best = d, code = (guint8) c;
    }
  return code;
}

/* one group's values (@n of them) in @v, of amax 2^e-ish; kind 0:
 * random, 1: quotients on the rounding midpoints, 2: all zero */
static void
fill_group (GRand *rand, float *v, int n, int e, int kind)
{
  float amax = ldexpf ((float) g_rand_double_range (rand, 1.0, 2.0), e);

  for (int i = 0; i < n; i++)
    {
      if (kind == 2)
        v[i] = 0.0f;
      else if (kind == 1 && i > 0)
        {
          /* a midpoint between two normal e4m3 values, times the scale */
          int m = g_rand_int_range (rand, 0, 8), ex = g_rand_int_range (rand, -6, 8);
          float mid = ldexpf (1.0f + (2 * m + 1) / 16.0f, ex);
          v[i] = (g_rand_boolean (rand) ? 1.0f : -1.0f) * mid * (amax / 448.0f);
          v[i] = fminf (fmaxf (v[i], -amax), amax);
        }
      else
        v[i] = amax * (float) g_rand_double_range (rand, -1.0, 1.0);
    }
  if (kind != 2)
    v[g_rand_int_range (rand, 0, n)] = g_rand_boolean (rand) ? amax : -amax;
}

static void
test_problem (gconstpointer data)
{
  const Problem *p = data;
  const int G = (p->K + 127) / 128;
  const gsize n = (gsize) p->rows * p->K, elem = p->dtype == MOE_CUDA_F32 ? 4 : 2;
  g_autoptr(GRand) rand = g_rand_new_with_seed (1234 + p->K);
  g_autofree float *v = g_new (float, n);
  g_autofree guint8 *in = g_malloc (n * elem);
  g_autofree guint8 *q = NULL;
  g_autofree float *scale = NULL;
  void *d_in, *d_q = NULL, *d_scale = NULL;
  gsize bad = 0;

  for (int r = 0; r < p->rows; r++)
    for (int g = 0; g < G; g++)
      {
        const int k0 = g * 128, width = MIN (128, p->K - k0), kind = (r + g) % 7 == 3 ? 2 : (r + g) % 3 == 1;
        /* exponents past the reciprocal form's range (s < 2^-80 or > 2^100) in some groups */
        const int e = (r + g) % 11 == 5 ? g_rand_int_range (rand, -110, -90)
                      : (r + g) % 11 == 7 ? g_rand_int_range (rand, 109, 120)
                      : g_rand_int_range (rand, -20, 20);
        float *gv = v + (gsize) r * p->K + k0;

        fill_group (rand, gv, width, p->dtype == MOE_CUDA_F16 ? CLAMP (e, -8, 8) : e, kind);
        for (int i = 0; i < width; i++)
          {
            if (elem == 2)
              {
                /* the value as the kernel sees it */
                guint16 h = moe_test_to_16 (p->dtype, gv[i]);
                gv[i] = (float) moe_test_from_16 (p->dtype, h);
                memcpy (in + ((gsize) r * p->K + k0 + i) * 2, &h, 2);
              }
            else
              memcpy (in + ((gsize) r * p->K + k0 + i) * 4, &gv[i], 4);
          }
      }

  d_in = moe_test_to_device (in, n * elem);
  g_assert_cmpint (cudaMalloc (&d_q, n), ==, cudaSuccess);
  g_assert_cmpint (cudaMalloc (&d_scale, (gsize) G * p->rows * sizeof (float)), ==, cudaSuccess);
  g_assert_null (moe_cuda_quantize_fp8 (p->dtype, d_in, p->rows, p->K, d_q, d_scale, 0));
  g_assert_cmpint (cudaDeviceSynchronize (), ==, cudaSuccess);
  q = moe_test_to_host (d_q, n);
  scale = moe_test_to_host (d_scale, (gsize) G * p->rows * sizeof (float));

  for (int r = 0; r < p->rows; r++)
    for (int g = 0; g < G; g++)
      {
        const int k0 = g * 128, width = MIN (128, p->K - k0);
        const float *gv = v + (gsize) r * p->K + k0;
        float amax = 0.0f, s, got = scale[(gsize) g * p->rows + r];

        for (int i = 0; i < width; i++)
          amax = fmaxf (amax, fabsf (gv[i]));
        s = amax > 0.0f ? amax / 448.0f : 1.0f;
        if (memcmp (&s, &got, 4) != 0)
          g_error ("%s: row %d group %d: scale %a, want %a", p->name, r, g, got, s);
        for (int i = 0; i < width; i++)
          {
            const float t = gv[i] / s;
            const guint8 want = (signbit (t) ? 0x80 : 0) | e4m3_magnitude (t), have = q[(gsize) r * p->K + k0 + i];
            if (have != want && bad++ < 8)
              g_printerr ("%s: row %d column %d: %a / %a = %a: byte %#x, want %#x\n", p->name, r, k0 + i, gv[i], s, t,
                          have, want);
          }
      }
  g_assert_cmpuint (bad, ==, 0);
  cudaFree (d_in);
  cudaFree (d_q);
  cudaFree (d_scale);
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);
  if (!moe_test_have_cuda_device ())
    return 77;
  for (gsize i = 0; i < G_N_ELEMENTS (problems); i++)
    {
      g_autofree char *path = g_strdup_printf ("/cuda/quantize-fp8/%s", problems[i].name);
      g_test_add_data_func (path, &problems[i], test_problem);
    }
  return g_test_run ();
}
