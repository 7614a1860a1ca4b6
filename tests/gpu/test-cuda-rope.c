/* test-cuda-rope.c: a prefill's RoPE + KV-cache write in one kernel
 * (moe_cuda_rope_store_kv_rows) against the two kernels it replaces
 * (moe_cuda_rope on q's and k's heads, then moe_cuda_store_kv): on the same
 * random rows, q in the projected rows, v there, and both caches (every
 * slot, the untouched ones too) must come out byte for byte the same. The
 * model test's prefill-rows cases reach it with 9-token prompts only.
 *
 * Links the kernels directly. Exits 77 (skipped) where there is no CUDA
 * device.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <string.h>

#include "moe-cuda-decoder.h"
#include "moe-test-cuda-kernels.h"
#include "moe-cuda-experts.h"   /* MOE_CUDA_BF16, MOE_CUDA_F16, MOE_CUDA_F32 */

typedef struct {
  const char *name;
  int dtype;
  int batch, n_tokens, past;
  int heads, kv_heads, head_dim, rope_dim;
  float scale;                 /* the cos/sin scaling (YaRN's attention factor) */
  gboolean past_dev;           /* past read on the device (a CUDA graph's) */
} Problem;

static const Problem problems[] = {
  { "qwen-t300", MOE_CUDA_BF16, 1, 300, 0, 16, 16, 128, 128, 1.0f, FALSE },
  { "gqa-32-4", MOE_CUDA_BF16, 1, 300, 0, 32, 4, 128, 128, 1.0f, FALSE },
  { "partial-64-of-128", MOE_CUDA_BF16, 1, 200, 0, 16, 16, 128, 64, 1.0f, FALSE },
  { "batch2-past5", MOE_CUDA_BF16, 2, 40, 5, 8, 2, 128, 128, 1.0f, FALSE },
  { "batch2-past-dev", MOE_CUDA_BF16, 2, 33, 7, 8, 4, 64, 64, 1.2f, TRUE },
  { "f16", MOE_CUDA_F16, 1, 300, 0, 16, 4, 128, 128, 1.0f, FALSE },
  { "f32", MOE_CUDA_F32, 1, 100, 3, 8, 2, 128, 64, 1.0f, FALSE },
  /* half of 36 rotated dims is not a multiple of 8: one element a thread */
  { "scalar-36-of-96", MOE_CUDA_BF16, 1, 120, 0, 6, 2, 96, 36, 1.0f, FALSE },
};

/* @n random values in [-2, 2] in @dtype (any element size) */
static void *
random_values (GRand *rand, int dtype, gsize n, gsize elem)
{
  guint8 *v = g_malloc (n * elem);

  for (gsize i = 0; i < n; i++)
    {
      float f = (float) g_rand_double_range (rand, -2.0, 2.0);
      guint16 h = moe_test_to_16 (dtype, f);
      memcpy (v + i * elem, elem == 4 ? (const void *) &f : (const void *) &h, elem);
    }
  return v;
}

/* the first differing element of @n (@elem bytes each) of @what, or none */
static void
assert_same (const Problem *p, const char *what, const guint8 *want, const guint8 *got, gsize n, gsize elem)
{
  for (gsize i = 0; i < n; i++)
    if (memcmp (want + i * elem, got + i * elem, elem) != 0)
      g_error ("%s: %s differs at element %" G_GSIZE_FORMAT " of %" G_GSIZE_FORMAT, p->name, what, i, n);
}

static void
test_problem (gconstpointer data)
{
  const Problem *p = data;
  const gsize elem = p->dtype == MOE_CUDA_F32 ? 4 : 2;
  const int rows = p->batch * p->n_tokens, qn = p->heads * p->head_dim, kn = p->kv_heads * p->head_dim;
  const int n = qn + 2 * kn, capacity = p->past + p->n_tokens + 3;
  const gsize qkv_n = (gsize) rows * n, cache_n = (gsize) p->batch * p->kv_heads * capacity * p->head_dim;
  g_autoptr(GRand) rand = g_rand_new_with_seed (11 + p->n_tokens + p->heads + p->rope_dim);
  g_autofree void *qkv = random_values (rand, p->dtype, qkv_n, elem);
  /* the caches start the same, not zero: slots written by neither must match too */
  g_autofree void *k_init = random_values (rand, p->dtype, cache_n, elem);
  g_autofree void *v_init = random_values (rand, p->dtype, cache_n, elem);
  g_autofree gint64 *positions = g_new (gint64, rows);
  g_autofree float *inv_freq = g_new (float, p->rope_dim / 2);
  g_autofree guint8 *qkv_a = NULL, *qkv_b = NULL, *k_a = NULL, *k_b = NULL, *v_a = NULL, *v_b = NULL;
  void *qkv_dev[2], *k_dev[2], *v_dev[2], *pos_dev, *freq_dev, *past_dev = NULL;

  for (int r = 0; r < rows; r++)
    positions[r] = p->past + r % p->n_tokens + (r / p->n_tokens) * 1000;   /* sequence 1 far on */
  for (int i = 0; i < p->rope_dim / 2; i++)
    inv_freq[i] = (float) (1.0 / pow (1e6, 2.0 * i / p->rope_dim));
  for (int s = 0; s < 2; s++)
    {
      qkv_dev[s] = moe_test_to_device (qkv, qkv_n * elem);
      k_dev[s] = moe_test_to_device (k_init, cache_n * elem);
      v_dev[s] = moe_test_to_device (v_init, cache_n * elem);
    }
  pos_dev = moe_test_to_device (positions, rows * sizeof (gint64));
  freq_dev = moe_test_to_device (inv_freq, p->rope_dim / 2 * sizeof (float));
  if (p->past_dev)
    past_dev = moe_test_to_device (&p->past, sizeof (int));

  /* as attention_gqa does for more rows before (past_dev: the host's past is stale) */
  moe_cuda_rope (p->dtype, qkv_dev[0], rows, p->heads + p->kv_heads, n, p->head_dim, pos_dev, freq_dev,
                 p->rope_dim, p->scale, 0, 0);
  moe_cuda_store_kv (p->dtype, p->batch, p->n_tokens, p->kv_heads,
                     (guint8 *) qkv_dev[0] + qn * elem, n, p->head_dim, p->head_dim, NULL, 0, 0, 0,
                     (guint8 *) qkv_dev[0] + (qn + kn) * elem, n, p->head_dim, p->head_dim,
                     k_dev[0], v_dev[0], capacity, p->past_dev ? 0 : p->past, past_dev, 0);
  moe_cuda_rope_store_kv_rows (p->dtype, qkv_dev[1], p->batch, p->n_tokens, n, p->heads, p->kv_heads,
                               p->head_dim, pos_dev, freq_dev, p->rope_dim, p->scale, k_dev[1], v_dev[1],
                               capacity, p->past_dev ? 0 : p->past, past_dev, 0);
  g_assert_cmpint (cudaGetLastError (), ==, cudaSuccess);
  g_assert_cmpint (cudaDeviceSynchronize (), ==, cudaSuccess);

  qkv_a = moe_test_to_host (qkv_dev[0], qkv_n * elem);
  qkv_b = moe_test_to_host (qkv_dev[1], qkv_n * elem);
  k_a = moe_test_to_host (k_dev[0], cache_n * elem);
  k_b = moe_test_to_host (k_dev[1], cache_n * elem);
  v_a = moe_test_to_host (v_dev[0], cache_n * elem);
  v_b = moe_test_to_host (v_dev[1], cache_n * elem);
  /* q rotated, k's part of the rows not read after (the new kernel leaves it), v as it was */
  for (int r = 0; r < rows; r++)
    {
      gsize q0 = (gsize) r * n * elem, v0 = q0 + (gsize) (qn + kn) * elem;
      assert_same (p, "q", qkv_a + q0, qkv_b + q0, qn, elem);
      assert_same (p, "v in the rows", qkv_a + v0, qkv_b + v0, kn, elem);
    }
  assert_same (p, "the key cache", k_a, k_b, cache_n, elem);
  assert_same (p, "the value cache", v_a, v_b, cache_n, elem);
  /* and the rotation did something: the keys' cache differs from its start */
  g_assert_true (memcmp (k_a, k_init, cache_n * elem) != 0);

  for (int s = 0; s < 2; s++)
    {
      cudaFree (qkv_dev[s]);
      cudaFree (k_dev[s]);
      cudaFree (v_dev[s]);
    }
  cudaFree (pos_dev);
  cudaFree (freq_dev);
  cudaFree (past_dev);
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);
  if (!moe_test_have_cuda_device ())
    return 77;
  for (gsize i = 0; i < G_N_ELEMENTS (problems); i++)
    {
      g_autofree char *path = g_strdup_printf ("/cuda/rope-store-kv-rows/%s", problems[i].name);
      g_test_add_data_func (path, &problems[i], test_problem);
    }
  return g_test_run ();
}
