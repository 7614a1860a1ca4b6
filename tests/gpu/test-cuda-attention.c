/* test-cuda-attention.c: the prefill flash-attention kernels (mma.sync, and
 * Hopper's wgmma one) on prompts long enough to span many query and key
 * tiles, against attention computed from its definition in double
 * precision on the host — softmax(scale · q·kᵀ + mask) · v, with the
 * causal, padding and sliding-window masks and gpt-oss's sinks — on the
 * same bf16/f16 inputs. The model fixtures' 9-token prompts reach one tile
 * and small heads only.
 *
 * Links the kernels directly. Exits 77 (skipped) where there is no CUDA
 * device; the wgmma cases skip where the device is not a Hopper.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <string.h>

#include "moe-cuda-decoder.h"
#include "moe-test-cuda-kernels.h"
#include "moe-cuda-experts.h"   /* MOE_CUDA_BF16, MOE_CUDA_F16 */

typedef struct {
  const char *name;
  int dtype;                   /* MOE_CUDA_BF16 or MOE_CUDA_F16 */
  int batch, n_tokens, past, heads, kv_heads, dk, dv;
  int window;                  /* 0: none */
  gboolean sinks, padding;     /* per-head sink logits; invalid keys in sequence 1 */
} Problem;

static const Problem problems[] = {
  { "causal-t300", MOE_CUDA_BF16, 1, 300, 0, 4, 4, 128, 128, 0, FALSE, FALSE },
  { "causal-t2048", MOE_CUDA_BF16, 1, 2048, 0, 2, 2, 128, 128, 0, FALSE, FALSE },
  { "gqa-past77", MOE_CUDA_BF16, 1, 200, 77, 4, 2, 128, 128, 0, FALSE, FALSE },
  { "window-sinks", MOE_CUDA_BF16, 1, 260, 0, 2, 1, 128, 128, 100, TRUE, FALSE },
  { "padded-batch", MOE_CUDA_BF16, 2, 150, 0, 2, 2, 128, 128, 0, FALSE, TRUE },
  { "mla-192-128", MOE_CUDA_BF16, 1, 257, 0, 2, 2, 192, 128, 0, FALSE, FALSE },
  { "dims-96-80", MOE_CUDA_BF16, 1, 140, 0, 2, 2, 96, 80, 0, FALSE, FALSE },
  { "f16-causal", MOE_CUDA_F16, 1, 300, 0, 2, 2, 128, 128, 0, FALSE, FALSE },
};

static guint16 *
random_16 (GRand *rand, int dtype, gsize n, double spread)
{
  guint16 *v = g_new (guint16, n);
  for (gsize i = 0; i < n; i++)
    v[i] = moe_test_to_16 (dtype, (float) g_rand_double_range (rand, -spread, spread));
  return v;
}

static void
check_problem (gconstpointer data, MoeCudaFlashKernel kernel)
{
  const Problem *p = data;
  const int keys = p->past + p->n_tokens, capacity = keys + 5, q_stride = p->heads * p->dk + 16;
  const gsize rows = (gsize) p->batch * p->n_tokens, out_n = rows * p->heads * p->dv;
  const double scaling = 1.0 / sqrt (p->dk);
  g_autoptr(GRand) rand = g_rand_new_with_seed (7 + p->n_tokens + p->dk);
  g_autofree guint16 *q = random_16 (rand, p->dtype, rows * q_stride, 2.0);
  g_autofree guint16 *k = random_16 (rand, p->dtype, (gsize) p->batch * p->kv_heads * capacity * p->dk, 2.0);
  g_autofree guint16 *v = random_16 (rand, p->dtype, (gsize) p->batch * p->kv_heads * capacity * p->dv, 1.0);
  g_autofree guint16 *out = g_new (guint16, out_n);
  g_autofree float *sinks = g_new (float, p->heads);
  g_autofree guint8 *valid = g_new (guint8, (gsize) p->batch * keys);
  g_autofree double *score = g_new (double, keys);
  double err = 0.0, norm = 0.0;
  void *q_dev, *k_dev, *v_dev, *out_dev, *sinks_dev = NULL, *valid_dev = NULL;
  MoeCudaAttention a;

  for (int h = 0; h < p->heads; h++)
    sinks[h] = (float) g_rand_double_range (rand, -1.0, 3.0);
  /* sequence 1 of a padded batch: its first 37 positions are padding */
  for (int b = 0; b < p->batch; b++)
    for (int j = 0; j < keys; j++)
      valid[b * keys + j] = !(p->padding && b == 1 && j < 37);

  q_dev = moe_test_to_device (q, rows * q_stride * 2);
  k_dev = moe_test_to_device (k, (gsize) p->batch * p->kv_heads * capacity * p->dk * 2);
  v_dev = moe_test_to_device (v, (gsize) p->batch * p->kv_heads * capacity * p->dv * 2);
  g_assert_cmpint (cudaMalloc (&out_dev, out_n * 2), ==, cudaSuccess);
  /* poisoned: every output must be written */
  g_assert_cmpint (cudaMemset (out_dev, 0xFF, out_n * 2), ==, cudaSuccess);
  if (p->sinks)
    sinks_dev = moe_test_to_device (sinks, p->heads * sizeof (float));
  if (p->padding)
    valid_dev = moe_test_to_device (valid, (gsize) p->batch * keys);

  a = (MoeCudaAttention) {
    .dtype = p->dtype, .batch = p->batch, .n_tokens = p->n_tokens, .past = p->past,
    .heads = p->heads, .kv_heads = p->kv_heads, .dk = p->dk, .dv = p->dv,
    .q = q_dev, .q_row_stride = q_stride, .k_cache = k_dev, .v_cache = v_dev, .capacity = capacity,
    .key_valid = valid_dev, .window = p->window, .sinks = sinks_dev, .scaling = (float) scaling, .out = out_dev,
  };

  if (!moe_cuda_flash_attention_with (&a, kernel, 0))
    {
      g_test_skip ("this kernel does not run this problem on this device");
      goto out;
    }
  g_assert_cmpint (cudaGetLastError (), ==, cudaSuccess);
  g_assert_cmpint (cudaDeviceSynchronize (), ==, cudaSuccess);
  g_assert_cmpint (cudaMemcpy (out, out_dev, out_n * 2, cudaMemcpyDeviceToHost), ==, cudaSuccess);

  for (int b = 0; b < p->batch; b++)
    for (int t = 0; t < p->n_tokens; t++)
      for (int h = 0; h < p->heads; h++)
        {
          const int kvh = h / (p->heads / p->kv_heads), qpos = p->past + t;
          const guint16 *qv = q + (gsize) (b * p->n_tokens + t) * q_stride + (gsize) h * p->dk;
          const gsize kv = (gsize) (b * p->kv_heads + kvh) * capacity;
          double top = p->sinks ? sinks[h] : -INFINITY, sum = 0.0;

          for (int j = 0; j < keys; j++)
            {
              gboolean ok = j <= qpos && valid[b * keys + j] && (p->window == 0 || qpos - j < p->window);
              double dot = 0.0;
              for (int d = 0; ok && d < p->dk; d++)
                dot += moe_test_from_16 (p->dtype, qv[d]) * moe_test_from_16 (p->dtype, k[(kv + j) * p->dk + d]);
              score[j] = ok ? dot * scaling : -INFINITY;
              top = fmax (top, score[j]);
            }
          for (int j = 0; j < keys; j++)
            {
              score[j] = score[j] == -INFINITY ? 0.0 : exp (score[j] - top);   /* now the weight */
              sum += score[j];
            }
          if (p->sinks)
            sum += exp (sinks[h] - top);
          for (int d = 0; d < p->dv; d++)
            {
              double ref = 0.0, got;
              for (int j = 0; j < keys; j++)
                ref += score[j] * moe_test_from_16 (p->dtype, v[(kv + j) * p->dv + d]);
              ref = sum > 0.0 ? ref / sum : 0.0;
              got = moe_test_from_16 (p->dtype, out[((gsize) (b * p->n_tokens + t) * p->heads + h) * p->dv + d]);
              if (!isfinite (got))
                g_error ("%s: output (b %d, t %d, head %d, dim %d) is %g: not written, or not finite",
                         p->name, b, t, h, d, got);
              err += (got - ref) * (got - ref);
              norm += ref * ref;
            }
        }
  g_test_message ("%s: relative error %.3g", p->name, sqrt (err / norm));
  /* the output's one rounding to 16 bits is ~2e-3 (bf16) */
  g_assert_cmpfloat (sqrt (err / norm), <, 1e-2);

out:
  cudaFree (q_dev);
  cudaFree (k_dev);
  cudaFree (v_dev);
  cudaFree (out_dev);
  cudaFree (sinks_dev);
  cudaFree (valid_dev);
}

static void
test_mma_sync (gconstpointer data)
{
  check_problem (data, MOE_CUDA_FLASH_MMA_SYNC);
}

static void
test_wgmma (gconstpointer data)
{
  check_problem (data, MOE_CUDA_FLASH_WGMMA);
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);
  if (!moe_test_have_cuda_device ())
    return 77;
  for (gsize i = 0; i < G_N_ELEMENTS (problems); i++)
    {
      g_autofree char *mma = g_strdup_printf ("/cuda/flash-attention/mma-sync/%s", problems[i].name);
      g_autofree char *wg = g_strdup_printf ("/cuda/flash-attention/wgmma/%s", problems[i].name);
      g_test_add_data_func (mma, &problems[i], test_mma_sync);
      g_test_add_data_func (wg, &problems[i], test_wgmma);
    }
  return g_test_run ();
}
