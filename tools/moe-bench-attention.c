/* moe-bench-attention.c: the two prefill flash-attention kernels side by
 * side in one run (GPU machine): µs a call (median of CUDA-event timings)
 * and TFLOP/s (causal products counted once: 2·(dk + dv) a query and key
 * it attends to) for prompts of T tokens, one sequence.
 *
 *   moe-bench-attention [-t 512,2048,4096] [--heads 16] [--kv-heads 16] [--dk 128] [--dv 128] [--repeats 20]
 *
 * Correctness is tests/gpu/test-cuda-attention.c's; this only times.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <glib.h>
#include <cuda_runtime_api.h>

#include "moe-cuda-decoder.h"
#include "moe-cuda-experts.h"   /* MOE_CUDA_BF16, MOE_CUDA_F16 */

static int
compare_float (const void *a, const void *b)
{
  float x = *(const float *) a, y = *(const float *) b;
  return (x > y) - (x < y);
}

/* random bf16 values in [-1, 1) on the device (never zeros: they run faster) */
static void *
random_bf16 (GRand *rand, gsize n)
{
  g_autofree guint16 *host = g_new (guint16, n);
  void *dev = NULL;

  for (gsize i = 0; i < n; i++)
    {
      float f = (float) g_rand_double_range (rand, -1.0, 1.0);
      guint32 u;
      memcpy (&u, &f, 4);
      host[i] = (guint16) (u >> 16);
    }
  if (cudaMalloc (&dev, n * 2) != cudaSuccess || cudaMemcpy (dev, host, n * 2, cudaMemcpyHostToDevice) != cudaSuccess)
    g_error ("cuda: could not allocate and fill %" G_GSIZE_FORMAT " values", n);
  return dev;
}

/* median µs of @repeats calls of @kernel, or NAN where it does not run @a */
static double
time_kernel (const MoeCudaAttention *a, MoeCudaFlashKernel kernel, int repeats)
{
  g_autofree float *ms = g_new (float, repeats);
  cudaEvent_t start, stop;

  for (int i = 0; i < 3; i++)
    if (!moe_cuda_flash_attention_with (a, kernel, 0))
      return NAN;
  cudaEventCreate (&start);
  cudaEventCreate (&stop);
  for (int i = 0; i < repeats; i++)
    {
      cudaEventRecord (start, 0);
      moe_cuda_flash_attention_with (a, kernel, 0);
      cudaEventRecord (stop, 0);
      cudaEventSynchronize (stop);
      cudaEventElapsedTime (&ms[i], start, stop);
    }
  if (cudaGetLastError () != cudaSuccess)
    g_error ("cuda: the kernel failed");
  cudaEventDestroy (start);
  cudaEventDestroy (stop);
  qsort (ms, repeats, sizeof *ms, compare_float);
  return ms[repeats / 2] * 1000.0;
}

int
main (int argc, char *argv[])
{
  g_autofree char *tokens = NULL;
  int heads = 16, kv_heads = 16, dk = 128, dv = 128, repeats = 20, n = 0;
  GOptionEntry entries[] = {
    { "tokens", 't', 0, G_OPTION_ARG_STRING, &tokens, "prompt lengths (default 512,2048,4096)", "T,…" },
    { "heads", 0, 0, G_OPTION_ARG_INT, &heads, "query heads (16)", "N" },
    { "kv-heads", 0, 0, G_OPTION_ARG_INT, &kv_heads, "key/value heads (16)", "N" },
    { "dk", 0, 0, G_OPTION_ARG_INT, &dk, "key dims (128)", "N" },
    { "dv", 0, 0, G_OPTION_ARG_INT, &dv, "value dims (128)", "N" },
    { "repeats", 0, 0, G_OPTION_ARG_INT, &repeats, "timed calls (20)", "N" },
    { NULL }
  };
  g_autoptr(GOptionContext) ctx = g_option_context_new ("- time the prefill flash-attention kernels");
  g_autoptr(GError) error = NULL;
  g_autoptr(GRand) rand = g_rand_new_with_seed (1);
  g_auto(GStrv) list = NULL;

  g_option_context_add_main_entries (ctx, entries, NULL);
  if (!g_option_context_parse (ctx, &argc, &argv, &error))
    {
      g_printerr ("%s\n", error->message);
      return 2;
    }
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || dk <= 0 || dv <= 0 || repeats <= 0)
    {
      g_printerr ("--heads must be a positive multiple of --kv-heads; --dk, --dv, --repeats positive\n");
      return 2;
    }
  if (cudaGetDeviceCount (&n) != cudaSuccess || n == 0)
    {
      g_printerr ("no CUDA device\n");
      return 77;
    }
  list = g_strsplit (tokens ? tokens : "512,2048,4096", ",", -1);
  g_print ("| T | heads (kv) | dk, dv | mma.sync µs | wgmma µs | mma.sync TFLOP/s | wgmma TFLOP/s | speed-up |\n");
  g_print ("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int i = 0; list[i] != NULL; i++)
    {
      int t = atoi (list[i]);
      MoeCudaAttention a;
      double flops, mma, wg;

      if (t <= 0)
        {
          g_printerr ("-t: '%s' is not a positive token count\n", list[i]);
          return 2;
        }
      a = (MoeCudaAttention) {
        .dtype = MOE_CUDA_BF16, .batch = 1, .n_tokens = t, .heads = heads, .kv_heads = kv_heads, .dk = dk, .dv = dv,
        .q_row_stride = heads * dk, .capacity = t, .scaling = 1.0f / sqrtf ((float) dk),
        .q = random_bf16 (rand, (gsize) t * heads * dk),
        .k_cache = random_bf16 (rand, (gsize) kv_heads * t * dk),
        .v_cache = random_bf16 (rand, (gsize) kv_heads * t * dv),
        .out = random_bf16 (rand, (gsize) t * heads * dv),
      };
      flops = 2.0 * (dk + dv) * heads * ((double) t * (t + 1) / 2);
      mma = time_kernel (&a, MOE_CUDA_FLASH_MMA_SYNC, repeats);
      wg = time_kernel (&a, MOE_CUDA_FLASH_WGMMA, repeats);
      g_print ("| %d | %d (%d) | %d, %d | %.1f | %.1f | %.0f | %.0f | %.2f× |\n", t, heads, kv_heads, dk, dv, mma, wg,
               flops / mma * 1e-6, flops / wg * 1e-6, mma / wg);
      cudaFree ((void *) a.q);
      cudaFree ((void *) a.k_cache);
      cudaFree ((void *) a.v_cache);
      cudaFree (a.out);
    }
  return 0;
}
