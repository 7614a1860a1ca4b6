/* moe-bench-cuda-experts.c: time the experts backends on the "cuda" device
 *
 * Usage:
 *   moe-bench-cuda-experts --shape H,I,E,K --tokens 1,8,64 [--backend NAME ...]
 *                          [--weights bf16|fp8|fp4] [--batches N] [--max-call-ms MS] [--seed N]
 *                          [--skew S]
 *
 * Random bf16 weights (a 32 MiB block of seeded uniform values, tiled over
 * the weights at shifting offsets: random data, not zeros, without minutes
 * of host work for DeepSeek-sized layers), random routing to K distinct
 * experts per token — uniform, or with --skew S expert e drawn with
 * probability ∝ 1/(e+1)^S (S = 1.25 on 60 experts, top-4, 2048 tokens: the
 * busiest expert ~1,700 rows and 128-row m-tiles ~63% full, near the
 * random-weight Qwen1.5-MoE checkpoint's 1,608 and 68% under
 * MOE_CUDA_TRACE, though its median expert gets 13 rows, not ~50, and a
 * third get none) — softmax-like positive weights. With --weights
 * fp8 or fp4 the experts are quantized instead: random e4m3 bytes (no NaN)
 * with float32 block scales, or random e2m1 nibbles with UE8M0 scales; the
 * hidden states stay bf16.
 *
 * Each backend gets one untimed call first (deepgemm compiles its kernels
 * then). Each (backend, T): three warm-up calls, then --batches batches of back-to-
 * back moe_experts_forward() calls (as many as fill about 20 ms) closed by a
 * device synchronize; the time per call is the batch's wall time over its
 * calls, and the median over batches is printed. That counts everything a
 * caller pays: the core's input checks (which read the ids on the host),
 * allocation from the device's cache, every launch. A backend whose first
 * call takes longer than --max-call-ms is skipped for that and larger T.
 *
 * Besides the time, each row prints the relative difference of the output
 * from the first backend's (eager, cuBLAS), a cross-check of independent
 * code paths; correctness against transformers is the GPU test suite's job.
 *
 * One JSON object per line on stdout.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libmoe.h>
#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

static char *opt_shape;
static char *opt_tokens;
static char **opt_backends;
static int opt_batches = 7;
static double opt_max_call_ms = 2000.0;
static int opt_seed = 1234;
static char *opt_weights;
static double opt_skew;

static const GOptionEntry entries[] = {
  { "shape", 's', 0, G_OPTION_ARG_STRING, &opt_shape, "hidden, intermediate, experts, top-k", "H,I,E,K" },
  { "tokens", 't', 0, G_OPTION_ARG_STRING, &opt_tokens, "Comma-separated token counts", "T,..." },
  { "backend", 'b', 0, G_OPTION_ARG_STRING_ARRAY, &opt_backends, "A backend (repeatable; default eager, batched_mm, grouped_mm)", "NAME" },
  { "batches", 0, 0, G_OPTION_ARG_INT, &opt_batches, "Timed batches per row (default 7)", "N" },
  { "max-call-ms", 0, 0, G_OPTION_ARG_DOUBLE, &opt_max_call_ms, "Skip a backend whose first call is slower (default 2000)", "MS" },
  { "seed", 0, 0, G_OPTION_ARG_INT, &opt_seed, "Random seed (default 1234)", "N" },
  { "weights", 'w', 0, G_OPTION_ARG_STRING, &opt_weights, "Expert weights: bf16 (default), fp8 or fp4", "FORMAT" },
  { "skew", 0, 0, G_OPTION_ARG_DOUBLE, &opt_skew, "Routing skew: expert e drawn ∝ 1/(e+1)^S (default 0: uniform)", "S" },
  { NULL }
};

static guint64 rng_state;

static guint64
rng_next (void)
{
  /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}

static float
rng_uniform (void)
{
  return (float) ((rng_next () >> 11) * (1.0 / 9007199254740992.0));
}

/* an expert drawn from the cumulative weights cdf[E] (binary search) */
static gint64
draw_expert (const double *cdf, gint64 E)
{
  const double u = ((rng_next () >> 11) * (1.0 / 9007199254740992.0)) * cdf[E - 1];
  gint64 lo = 0, hi = E - 1;

  while (lo < hi)
    {
      gint64 mid = (lo + hi) / 2;
      if (cdf[mid] > u)
        hi = mid;
      else
        lo = mid + 1;
    }
  return lo;
}

static MoeTensor *
random_bf16 (MoeDevice *cuda, const gint64 *shape, guint n_dims, float scale)
{
  enum { BLOCK = 16 << 20 };
  static guint16 *block;
  g_autoptr(GError) error = NULL;
  MoeTensor *t = moe_tensor_new_empty (cuda, MOE_DTYPE_BF16, shape, n_dims, &error);
  gsize n = (gsize) moe_tensor_get_n_elements (t), done = 0, chunk = 0;
  guint8 *dst = moe_tensor_get_mutable_data (t);

  g_assert_no_error (error);
  if (block == NULL)
    block = g_new (guint16, BLOCK);
  for (gsize i = 0; i < BLOCK; i++)
    block[i] = moe_f32_to_bf16 ((rng_uniform () * 2.0f - 1.0f) * scale);
  while (done < n)
    {
      gsize len = MIN (n - done, (gsize) BLOCK / 2);
      gsize start = (chunk++ * 7919u) % (BLOCK - len + 1);
      if (!MOE_DEVICE_GET_CLASS (cuda)->copy_from_host (cuda, dst + done * 2, block + start, len * 2, &error))
        g_error ("%s", error->message);
      done += len;
    }
  return t;
}

/* Random bytes of a one-byte dtype on the device; for F8E4M3 never a NaN
 * (0x7f, 0xff), for E8M0 exponents around @center. */
static MoeTensor *
random_bytes (MoeDevice *cuda, MoeDType dtype, const gint64 *shape, guint n_dims, int center)
{
  g_autoptr(GError) error = NULL;
  MoeTensor *t = moe_tensor_new_empty (cuda, dtype, shape, n_dims, &error);
  gsize n, chunk = 1 << 24;
  g_autofree guint8 *buf = NULL;

  g_assert_no_error (error);
  n = moe_tensor_get_n_bytes (t);
  buf = g_malloc (MIN (n, chunk));
  for (gsize done = 0; done < n; done += chunk)
    {
      gsize len = MIN (chunk, n - done);
      for (gsize i = 0; i < len; i++)
        {
          guint8 b = (guint8) rng_next ();
          if (dtype == MOE_DTYPE_F8E4M3 && (b & 0x7f) == 0x7f)
            b &= 0xf7;
          if (dtype == MOE_DTYPE_E8M0)
            b = (guint8) (center + (int) (b % 5) - 2);
          buf[i] = b;
        }
      if (!MOE_DEVICE_GET_CLASS (cuda)->copy_from_host (cuda, (guint8 *) moe_tensor_get_mutable_data (t) + done, buf, len, &error))
        g_error ("%s", error->message);
    }
  return t;
}

/* float32 block scales: uniform in [0.5, 1.5) × @scale */
static MoeTensor *
random_f32 (MoeDevice *cuda, const gint64 *shape, guint n_dims, float scale)
{
  gint64 n = 1;
  float *v;
  for (guint i = 0; i < n_dims; i++)
    n *= shape[i];
  v = g_new (float, n);
  for (gint64 i = 0; i < n; i++)
    v[i] = (0.5f + rng_uniform ()) * scale;
  {
    g_autoptr(GBytes) bytes = g_bytes_new_take (v, n * sizeof (float));
    g_autoptr(MoeTensor) host = moe_tensor_new_from_bytes (MOE_DTYPE_F32, shape, n_dims, bytes, NULL);
    return moe_tensor_to_device (host, cuda, NULL);
  }
}

static MoeTensor *
host_tensor (MoeDevice *cuda, MoeDType dtype, const gint64 *shape, gpointer data, gsize size)
{
  g_autoptr(GBytes) bytes = g_bytes_new_take (data, size);
  g_autoptr(MoeTensor) host = moe_tensor_new_from_bytes (dtype, shape, 2, bytes, NULL);
  return moe_tensor_to_device (host, cuda, NULL);
}

static double
rel_diff (MoeTensor *a, MoeTensor *b)
{
  g_autoptr(MoeTensor) a32 = moe_tensor_to_dtype (a, MOE_DTYPE_F64, NULL);
  g_autoptr(MoeTensor) b32 = moe_tensor_to_dtype (b, MOE_DTYPE_F64, NULL);
  const double *x = moe_tensor_get_data (a32), *y = moe_tensor_get_data (b32);
  double num = 0, den = 0;

  for (gint64 i = 0; i < moe_tensor_get_n_elements (a32); i++)
    {
      if (isnan (x[i]))
        return INFINITY;
      num += (x[i] - y[i]) * (x[i] - y[i]);
      den += y[i] * y[i];
    }
  return den > 0 ? sqrt (num / den) : 0.0;
}

static int
compare_double (const void *a, const void *b)
{
  double x = *(const double *) a, y = *(const double *) b;
  return x < y ? -1 : x > y;
}

int
main (int argc, char *argv[])
{
  g_autoptr(GOptionContext) ctx = g_option_context_new ("— time the experts backends on CUDA");
  g_autoptr(GError) error = NULL;
  g_auto(GStrv) dims = NULL, token_list = NULL;
  const char *default_backends[] = { "eager", "batched_mm", "grouped_mm", NULL };
  const char *const *backends;
  gboolean skipped[16] = { FALSE, };
  gboolean prepared[16] = { FALSE, };
  gint64 H, I, E, K;
  g_autofree double *cdf = NULL;   /* cumulative routing weights of the experts */
  MoeDevice *cuda;
  g_autoptr(MoeTensor) up = NULL, down = NULL;
  g_autoptr(MoeExperts) experts = NULL;

  g_option_context_add_main_entries (ctx, entries, NULL);
  if (!g_option_context_parse (ctx, &argc, &argv, &error) || opt_shape == NULL || opt_tokens == NULL)
    {
      g_printerr ("%s\n", error ? error->message : "--shape and --tokens are required");
      return 2;
    }
  dims = g_strsplit (opt_shape, ",", -1);
  if (g_strv_length (dims) != 4)
    {
      g_printerr ("--shape wants H,I,E,K\n");
      return 2;
    }
  H = g_ascii_strtoll (dims[0], NULL, 10);
  I = g_ascii_strtoll (dims[1], NULL, 10);
  E = g_ascii_strtoll (dims[2], NULL, 10);
  K = g_ascii_strtoll (dims[3], NULL, 10);
  backends = opt_backends ? (const char *const *) opt_backends : default_backends;
  g_assert_cmpuint (g_strv_length ((char **) backends), <=, G_N_ELEMENTS (skipped));
  rng_state = 0x9E3779B97F4A7C15ull ^ (guint64) opt_seed;
  if (E < 1 || K < 1 || K > E)
    {
      g_printerr ("--shape: E >= 1 experts and 1 <= K <= E a token\n");
      return 2;
    }
  if (!(opt_skew >= 0 && opt_skew <= 8))
    {
      g_printerr ("--skew wants 0 (uniform) to 8\n");
      return 2;
    }
  cdf = g_new (double, E);
  for (gint64 e = 0; e < E; e++)
    cdf[e] = (e ? cdf[e - 1] : 0) + pow ((double) (e + 1), -opt_skew);

  cuda = moe_device_get_for_name ("cuda", &error);
  if (cuda == NULL)
    {
      g_printerr ("%s\n", error->message);
      return 77;
    }

  if (opt_weights == NULL || g_str_equal (opt_weights, "bf16"))
    {
      gint64 us[3] = { E, 2 * I, H }, ds[3] = { E, H, I };
      /* about 1/sqrt(fan-in), so activations stay O(1) through both projections */
      up = random_bf16 (cuda, us, 3, 1.7f / sqrtf ((float) H));
      down = random_bf16 (cuda, ds, 3, 1.7f / sqrtf ((float) I));
      experts = moe_experts_new (up, down);
    }
  else if (g_str_equal (opt_weights, "fp8"))
    {
      gint64 us[3] = { E, 2 * I, H }, ds[3] = { E, H, I };
      gint64 uss[3] = { E, (2 * I + 127) / 128, (H + 127) / 128 }, dss[3] = { E, (H + 127) / 128, (I + 127) / 128 };
      g_autoptr(MoeTensor) su = random_f32 (cuda, uss, 3, 1.0f / (64.0f * sqrtf ((float) H)));
      g_autoptr(MoeTensor) sd = random_f32 (cuda, dss, 3, 1.0f / (64.0f * sqrtf ((float) I)));
      up = random_bytes (cuda, MOE_DTYPE_F8E4M3, us, 3, 0);
      down = random_bytes (cuda, MOE_DTYPE_F8E4M3, ds, 3, 0);
      experts = moe_experts_new (up, down);
      moe_experts_set_up_weight_scale (experts, su);
      moe_experts_set_down_weight_scale (experts, sd);
    }
  else if (g_str_equal (opt_weights, "fp4"))
    {
      gint64 us[3] = { E, 2 * I, H / 2 }, ds[3] = { E, H, I / 2 };
      gint64 uss[3] = { E, 2 * I, H / 32 }, dss[3] = { E, H, I / 32 };
      g_autoptr(MoeTensor) su = random_bytes (cuda, MOE_DTYPE_E8M0, uss, 3, 127 - 2 - (int) log2f ((float) H) / 2);
      g_autoptr(MoeTensor) sd = random_bytes (cuda, MOE_DTYPE_E8M0, dss, 3, 127 - 2 - (int) log2f ((float) I) / 2);
      up = random_bytes (cuda, MOE_DTYPE_I8, us, 3, 0);
      down = random_bytes (cuda, MOE_DTYPE_I8, ds, 3, 0);
      experts = moe_experts_new (up, down);
      moe_experts_set_up_weight_scale (experts, su);
      moe_experts_set_down_weight_scale (experts, sd);
    }
  else
    {
      g_printerr ("--weights wants bf16, fp8 or fp4\n");
      return 2;
    }
  moe_experts_set_device (experts, "cuda");
  if (!moe_experts_validate (experts, &error))
    {
      g_printerr ("%s\n", error->message);
      return 2;
    }

  token_list = g_strsplit (opt_tokens, ",", -1);
  for (guint ti = 0; token_list[ti] != NULL; ti++)
    {
      gint64 T = g_ascii_strtoll (token_list[ti], NULL, 10);
      gint64 xs[2] = { T, H }, ks[2] = { T, K };
      g_autoptr(MoeTensor) x = random_bf16 (cuda, xs, 2, 1.0f);
      g_autoptr(MoeTensor) ids = NULL, wts = NULL, first_out = NULL;

      {
        gint64 *id = g_new (gint64, T * K);
        float *w = g_new (float, T * K);
        for (gint64 t = 0; t < T; t++)
          {
            float sum = 0;
            for (gint64 k = 0; k < K; k++)
              {
                gint64 e;
                gboolean dup;
                do
                  {
                    e = opt_skew > 0 ? draw_expert (cdf, E) : (gint64) (rng_next () % (guint64) E);
                    dup = FALSE;
                    for (gint64 j = 0; j < k; j++)
                      dup |= id[t * K + j] == e;
                  }
                while (dup);
                id[t * K + k] = e;
                w[t * K + k] = 0.1f + rng_uniform ();
                sum += w[t * K + k];
              }
            for (gint64 k = 0; k < K; k++)
              w[t * K + k] /= sum;
          }
        ids = host_tensor (cuda, MOE_DTYPE_I64, ks, id, T * K * sizeof (gint64));
        wts = host_tensor (cuda, MOE_DTYPE_F32, ks, w, T * K * sizeof (float));
      }

      for (guint b = 0; backends[b] != NULL; b++)
        {
          g_autoptr(MoeTensor) out = NULL;
          g_autofree double *per_call = NULL;
          gint64 t0, t1;
          double first_ms, diff;
          int calls;

          if (skipped[b])
            {
              printf ("{\"backend\": \"%s\", \"T\": %" G_GINT64_FORMAT ", \"skipped\": \"a smaller T took over %.0f ms\"}\n",
                      backends[b], T, opt_max_call_ms);
              continue;
            }
          moe_experts_set_implementation (experts, backends[b]);
          if (!prepared[b])
            {
              /* one untimed call first: deepgemm compiles its kernels on its
               * first forward, which is not the time of a call */
              g_autoptr(MoeTensor) warm = moe_experts_forward (experts, x, ids, wts, &error);
              if (warm == NULL)
                g_error ("%s T=%" G_GINT64_FORMAT ": %s", backends[b], T, error->message);
              prepared[b] = TRUE;
            }
          moe_device_synchronize (cuda, NULL);
          t0 = g_get_monotonic_time ();
          out = moe_experts_forward (experts, x, ids, wts, &error);
          if (out == NULL)
            g_error ("%s T=%" G_GINT64_FORMAT ": %s", backends[b], T, error->message);
          moe_device_synchronize (cuda, NULL);
          t1 = g_get_monotonic_time ();
          first_ms = (t1 - t0) / 1000.0;
          diff = first_out != NULL ? rel_diff (out, first_out) : 0.0;
          if (first_out == NULL)
            first_out = g_object_ref (out);
          if (first_ms > opt_max_call_ms)
            {
              skipped[b] = TRUE;
              printf ("{\"backend\": \"%s\", \"T\": %" G_GINT64_FORMAT ", \"skipped\": \"one call took %.0f ms\"}\n",
                      backends[b], T, first_ms);
              fflush (stdout);
              continue;
            }
          for (int i = 0; i < 2; i++)
            g_object_unref (moe_experts_forward (experts, x, ids, wts, NULL));
          moe_device_synchronize (cuda, NULL);

          calls = (int) CLAMP (20.0 / MAX (first_ms, 0.001), 1, 200);
          per_call = g_new (double, opt_batches);
          for (int bt = 0; bt < opt_batches; bt++)
            {
              t0 = g_get_monotonic_time ();
              for (int i = 0; i < calls; i++)
                g_object_unref (moe_experts_forward (experts, x, ids, wts, NULL));
              moe_device_synchronize (cuda, NULL);
              t1 = g_get_monotonic_time ();
              per_call[bt] = (double) (t1 - t0) / calls;
            }
          qsort (per_call, opt_batches, sizeof (double), compare_double);
          printf ("{\"backend\": \"%s\", \"T\": %" G_GINT64_FORMAT ", \"median_us\": %.1f, \"min_us\": %.1f, "
                  "\"calls\": %d, \"batches\": %d, \"skew\": %g, \"rel_diff_vs_%s\": %.3g}\n",
                  backends[b], T, per_call[opt_batches / 2], per_call[0], calls, opt_batches, opt_skew,
                  backends[0], diff);
          fflush (stdout);
        }
    }
  return 0;
}
