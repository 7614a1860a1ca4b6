/* test-cuda-sampling.c: do_sample on the device (moe_cuda_sample) against
 * the host's rule (libmoe/moe-sampling.c, built in): the same draws must
 * give the same tokens — on vocabularies that take one block a row and
 * that spread a row over a cluster, sharp and flat rows and rows full of
 * ties, each filter alone and together, a row with no draw among them.
 * A row the kernel leaves to the host (-1) must be one it may leave: a
 * top-k past MOE_CUDA_SAMPLE_MAX_KEPT.
 *
 * Links the kernels directly. Exits 77 (skipped) where there is no CUDA
 * device.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <string.h>

#include "moe-cuda-decoder.h"
#include "moe-sampling-private.h"
#include "moe-test-cuda-kernels.h"
#include "moe-test-logits.h"

typedef struct {
  double temperature;
  guint  top_k;
  double top_p;
} Filters;

static const Filters filters[] = {
  { 1.0, 0, 1.0 },     /* neither: the draw over the whole row */
  { 0.7, 20, 1.0 },    /* top-k */
  { 1.0, 1, 1.0 },     /* top-k 1: greedy */
  { 1.0, 300, 1.0 },
  { 1.0, MOE_CUDA_SAMPLE_MAX_KEPT, 1.0 },       /* the most the device keeps */
  { 1.0, MOE_CUDA_SAMPLE_MAX_KEPT + 1, 1.0 },   /* the host's past a small vocabulary */
  { 0.7, 0, 0.9 },     /* top-p */
  { 2.0, 0, 0.95 },    /* top-p over a flatter distribution: most tokens kept */
  { 0.6, 0, 0.999 },
  { 0.7, 20, 0.8 },    /* Qwen's: both */
  { 0.6, 50, 0.95 },   /* transformers' default top-k with a top-p */
  { 1.0, 0, 0.0 },     /* top-p 0: the best token alone */
};

static const guint vocabularies[] = { 7, 1000, 20000, 151936, 201088 };

/* Whether the device may leave this row to the host: a top-k it cannot
 * hold */
static gboolean
left_to_host_allowed (const Filters *f, guint V)
{
  return f->top_k > MOE_CUDA_SAMPLE_MAX_KEPT && f->top_k < V;
}

static void
test_vocabulary (gconstpointer data)
{
  const guint V = GPOINTER_TO_UINT (data), B = 9;
  g_autoptr(GRand) rand = g_rand_new_with_seed (31 + V);
  g_autofree float *x = g_new (float, (gsize) B * V);
  float *x_dev;
  double *draws_dev;
  gint64 *out_dev;
  guint compared = 0, left = 0;

  /* sharp, flat, tied and very sharp rows in turn (where a top-p alone
   * is held by few tokens of a large vocabulary) */
  for (guint r = 0; r < B; r++)
    {
      static const double spread[4] = { 3.0, 0.5, 3.0, 10.0 };
      g_autofree float *row = moe_test_random_logits (rand, V, spread[r % 4], r % 4 == 2 ? 4 : 0);
      memcpy (x + (gsize) r * V, row, V * sizeof (float));
    }
  x_dev = moe_test_to_device (x, (gsize) B * V * sizeof (float));
  g_assert_cmpint (cudaMalloc ((void **) &draws_dev, B * sizeof (double)), ==, cudaSuccess);
  g_assert_cmpint (cudaMalloc ((void **) &out_dev, B * sizeof (gint64)), ==, cudaSuccess);

  for (guint i = 0; i < G_N_ELEMENTS (filters); i++)
    for (guint round = 0; round < 3; round++)
      {
        const Filters *f = &filters[i];
        const gboolean skip[9] = { FALSE, FALSE, FALSE, FALSE, TRUE, FALSE, FALSE, FALSE, FALSE };
        g_autoptr(GRand) rng = g_rand_new_with_seed (1000 * i + round);
        double draws[9];
        const MoeSampling sampling = { f->temperature, f->top_k, f->top_p, draws };
        MoeCudaSampling s = { x_dev, (int) B, (int) V, (float) f->temperature, (int) f->top_k, f->top_p, draws_dev,
                              out_dev };
        gint64 want[9];
        g_autofree gint64 *got = NULL;

        _moe_sample_draws (rng, B, skip, draws);
        _moe_sample_tokens (x, B, V, &sampling, want);
        g_assert_cmpint (cudaMemcpy (draws_dev, draws, sizeof draws, cudaMemcpyHostToDevice), ==, cudaSuccess);
        moe_cuda_sample (&s, NULL);
        g_assert_cmpint (cudaGetLastError (), ==, cudaSuccess);
        g_assert_cmpint (cudaDeviceSynchronize (), ==, cudaSuccess);
        got = moe_test_to_host (out_dev, B * sizeof (gint64));

        for (guint r = 0; r < B; r++)
          {
            if (skip[r])
              {
                g_assert_cmpint (got[r], ==, -1);
                continue;
              }
            if (got[r] == -1 && left_to_host_allowed (f, V))
              {
                left++;
                continue;
              }
            if (got[r] != want[r])
              g_error ("V %u, temperature %g, top-k %u, top-p %g, row %u, draw %.17g: the device's token %"
                       G_GINT64_FORMAT ", the host's %" G_GINT64_FORMAT, V, f->temperature, f->top_k, f->top_p, r,
                       draws[r], got[r], want[r]);
            compared++;
          }
      }
  g_test_message ("V %u: %u tokens the same, %u rows left to the host", V, compared, left);
  /* most rows sampled on the device */
  g_assert_cmpuint (compared, >, left);
  cudaFree (x_dev);
  cudaFree (draws_dev);
  cudaFree (out_dev);
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);
  if (!moe_test_have_cuda_device ())
    return 77;
  for (gsize i = 0; i < G_N_ELEMENTS (vocabularies); i++)
    {
      g_autofree char *path = g_strdup_printf ("/cuda/sample/vocabulary-%u", vocabularies[i]);
      g_test_add_data_func (path, GUINT_TO_POINTER (vocabularies[i]), test_vocabulary);
    }
  return g_test_run ();
}
