/* moe-bench-model.c: time a whole model: prefill and decode tokens/s
 *
 * Usage:
 *   moe-bench-model --model DIR [--device cuda|cpu] [--dtype bfloat16]
 *                   [--backend grouped_mm] [--prefill 2048] [--batches 1,8]
 *                   [--decode-steps 64] [--decode-prompt 16] [--repeats 3]
 *                   [--seed N] [--generate-only]
 *
 * Only the public API: the model is loaded once, then
 *
 *   prefill           moe_model_forward() of a [1, P] random-id prompt;
 *                     tok/s = P / time. That includes producing the whole
 *                     [1, P, vocab] F32 logits on the host, as the call
 *                     returns them. --generate-only skips it (on a large
 *                     vocabulary it is the slow part of a comparison run).
 *   prefill-generate  moe_model_generate() of the same prompt with
 *                     max-new-tokens 1: the prefill as generation pays it
 *                     (logits of the last position only).
 *   decode            for each batch size B, moe_model_generate() of a
 *                     [B, 16] prompt (--decode-prompt: another length, to
 *                     time decode over a long context), greedy, no end
 *                     token (a fresh config
 *                     has none, so nothing stops early; checked on the
 *                     output): tok/s = B·S / (time(1 + S new) − time(1 new)),
 *                     so the prefill and the first token cancel out.
 *
 * Each measurement gets one untimed call first, then --repeats timed
 * calls; the median is reported. forward and generate are synchronous and
 * return host tensors, so wall time covers all the device work.
 *
 * stdout: one line per measurement, "KIND key=value ...", then a markdown
 * table. Errors: the GError's message on stderr and exit 1.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <locale.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libmoe.h>

static char *opt_model;
static char *opt_device;
static char *opt_dtype;
static char *opt_backend;
static int opt_prefill = 2048;
static char *opt_batches;
static int opt_decode_steps = 64;
static int opt_decode_prompt = 16;
static int opt_repeats = 3;
static gboolean opt_generate_only;
static int opt_seed = 1234;
static char *opt_sample;
/* --sample's filters, parsed */
static double sample_temperature = 1.0, sample_top_p = 1.0;
static guint sample_top_k;

static const GOptionEntry entries[] = {
  { "model", 'm', 0, G_OPTION_ARG_FILENAME, &opt_model, "The checkpoint directory", "DIR" },
  { "device", 0, 0, G_OPTION_ARG_STRING, &opt_device, "Device (default cpu)", "NAME" },
  { "dtype", 'd', 0, G_OPTION_ARG_STRING, &opt_dtype, "Weights dtype (default: the checkpoint's)", "DTYPE" },
  { "backend", 'e', 0, G_OPTION_ARG_STRING, &opt_backend, "Experts backend (default: the library's)", "NAME" },
  { "prefill", 'p', 0, G_OPTION_ARG_INT, &opt_prefill, "Prefill prompt length; 0 skips (default 2048)", "P" },
  { "batches", 'b', 0, G_OPTION_ARG_STRING, &opt_batches, "Decode batch sizes; empty skips (default 1,8)", "B,..." },
  { "decode-steps", 's', 0, G_OPTION_ARG_INT, &opt_decode_steps, "Timed decode steps (default 64)", "S" },
  { "decode-prompt", 0, 0, G_OPTION_ARG_INT, &opt_decode_prompt, "Decode prompt length (default 16)", "N" },
  { "repeats", 'r', 0, G_OPTION_ARG_INT, &opt_repeats, "Timed calls per measurement (default 3)", "N" },
  { "generate-only", 0, 0, G_OPTION_ARG_NONE, &opt_generate_only,
    "Time the prefill only as generation pays it (no all-logits forward)", NULL },
  { "seed", 0, 0, G_OPTION_ARG_INT, &opt_seed, "Seed of the random prompts (default 1234)", "N" },
  { "sample", 0, 0, G_OPTION_ARG_STRING, &opt_sample,
    "Generate by do_sample with this temperature, top-k and top-p (default: greedy)", "T,K,P" },
  { NULL }
};

/* one row of the final table */
typedef struct {
  char   *what;
  double  tok_s;
  double  ms;
  char   *ms_unit;
} Row;

static void
row_clear (gpointer p)
{
  Row *r = p;
  g_free (r->what);
  g_free (r->ms_unit);
}

static GRand *rng;   /* the prompts' ids */

/* [B, T] I64 host tensor of uniform random ids below @vocab */
static MoeTensor *
random_ids (gint64 B, gint64 T, gint64 vocab, GError **error)
{
  gint64 shape[2] = { B, T };
  gint64 *ids = g_new (gint64, B * T);
  g_autoptr(GBytes) bytes = NULL;

  for (gint64 i = 0; i < B * T; i++)
    ids[i] = g_rand_int_range (rng, 0, (gint32) vocab);
  bytes = g_bytes_new_take (ids, B * T * sizeof (gint64));
  return moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 2, bytes, error);
}

static int
cmp_double (gconstpointer a, gconstpointer b)
{
  double x = *(const double *) a, y = *(const double *) b;
  return (x > y) - (x < y);
}

static double
median (double *v, guint n)
{
  qsort (v, n, sizeof (double), cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* One forward of @ids; its wall time in seconds, < 0 on error. */
static double
time_forward (MoeModel *model, MoeTensor *ids, GError **error)
{
  gint64 t0 = g_get_monotonic_time ();
  g_autoptr(MoeTensor) logits = moe_model_forward (model, ids, error);

  if (logits == NULL)
    return -1.0;
  return (g_get_monotonic_time () - t0) * 1e-6;
}

/* One generation of @max_new tokens after @ids; its wall time in seconds,
 * < 0 on error, also when it stopped before @max_new (the timing would be
 * wrong). */
static double
time_generate (MoeModel *model, MoeTensor *ids, guint max_new, GError **error)
{
  g_autoptr(MoeGenerationConfig) config = moe_generation_config_new ();
  g_autoptr(MoeTensor) out = NULL;
  gint64 t0, want = moe_tensor_get_dim (ids, 1) + max_new;

  /* greedy (or --sample's), and no end token: every sequence runs max_new steps */
  g_object_set (config, "max-new-tokens", max_new, "do-sample", opt_sample != NULL, NULL);
  if (opt_sample != NULL)
    g_object_set (config, "temperature", sample_temperature, "top-k", sample_top_k, "top-p", sample_top_p, NULL);
  moe_generation_config_set_eos_token_ids (config, NULL, 0);
  t0 = g_get_monotonic_time ();
  out = moe_model_generate (model, ids, config, NULL, error);
  if (out == NULL)
    return -1.0;
  if (moe_tensor_get_dim (out, 1) != want)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                   "generate returned %" G_GINT64_FORMAT " tokens per row, expected %" G_GINT64_FORMAT,
                   moe_tensor_get_dim (out, 1), want);
      return -1.0;
    }
  return (g_get_monotonic_time () - t0) * 1e-6;
}

/* The median of --repeats timed forwards (@max_new == 0) or generations,
 * after one untimed call. */
static gboolean
measure (MoeModel *model, MoeTensor *ids, guint max_new, double *out_s, GError **error)
{
  g_autofree double *t = g_new (double, opt_repeats);

  for (int i = -1; i < opt_repeats; i++)
    {
      double s = max_new == 0 ? time_forward (model, ids, error) : time_generate (model, ids, max_new, error);
      if (s < 0)
        return FALSE;
      if (i >= 0)
        t[i] = s;
    }
  *out_s = median (t, opt_repeats);
  return TRUE;
}

static gboolean
parse_batches (const char *spec, GArray *out, GError **error)
{
  g_auto(GStrv) parts = g_strsplit (spec, ",", -1);

  for (guint i = 0; parts[i] != NULL; i++)
    {
      guint64 v;
      if (*g_strstrip (parts[i]) == '\0')
        continue;
      if (!g_ascii_string_to_unsigned (parts[i], 10, 1, 65536, &v, error))
        {
          g_prefix_error (error, "--batches: ");
          return FALSE;
        }
      g_array_append_val (out, (gint64) { (gint64) v });
    }
  return TRUE;
}

int
main (int    argc,
      char **argv)
{
  g_autoptr(GOptionContext) ctx = NULL;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeLoadOptions) options = NULL;
  g_autoptr(MoeModel) model = NULL;
  g_autoptr(GArray) batches = g_array_new (FALSE, FALSE, sizeof (gint64));
  g_autoptr(GArray) rows = g_array_new (FALSE, TRUE, sizeof (Row));
  g_autofree char *backend = NULL;
  gint64 vocab, t0;

  setlocale (LC_ALL, "");
  g_array_set_clear_func (rows, row_clear);
  ctx = g_option_context_new ("- time a whole model's prefill and decode");
  g_option_context_add_main_entries (ctx, entries, NULL);
  if (!g_option_context_parse (ctx, &argc, &argv, &error))
    goto fail;
  if (opt_model == NULL)
    {
      g_set_error (&error, G_OPTION_ERROR, G_OPTION_ERROR_BAD_VALUE, "--model DIR is required");
      goto fail;
    }
  if (opt_prefill < 0 || opt_decode_steps < 1 || opt_decode_prompt < 1 || opt_repeats < 1)
    {
      g_set_error (&error, G_OPTION_ERROR, G_OPTION_ERROR_BAD_VALUE,
                   "--prefill must be ≥ 0, --decode-steps, --decode-prompt and --repeats ≥ 1");
      goto fail;
    }
  if (opt_sample != NULL)
    {
      char *end = NULL;
      gint64 k = -1;

      sample_temperature = g_ascii_strtod (opt_sample, &end);
      if (end != NULL && *end == ',')
        k = g_ascii_strtoll (end + 1, &end, 10);
      if (end != NULL && *end == ',')
        sample_top_p = g_ascii_strtod (end + 1, &end);
      if (end == NULL || *end != '\0' || !(sample_temperature > 0) || k < 0 || k > G_MAXUINT ||
          !(sample_top_p >= 0 && sample_top_p <= 1))
        {
          g_set_error (&error, G_OPTION_ERROR, G_OPTION_ERROR_BAD_VALUE,
                       "--sample takes TEMPERATURE,TOP_K,TOP_P: a temperature > 0, a top-k ≥ 0 (0: all) and a "
                       "top-p in [0, 1], as 0.7,20,0.8; not “%s”", opt_sample);
          goto fail;
        }
      sample_top_k = (guint) k;
    }
  if (!parse_batches (opt_batches != NULL ? opt_batches : "1,8", batches, &error))
    goto fail;
  rng = g_rand_new_with_seed ((guint32) opt_seed);

  options = moe_load_options_new ();
  if (opt_device != NULL)
    moe_load_options_set_device (options, opt_device);
  if (opt_dtype != NULL)
    moe_load_options_set_dtype (options, opt_dtype);
  if (opt_backend != NULL)
    moe_load_options_set_experts_implementation (options, opt_backend);
  t0 = g_get_monotonic_time ();
  model = moe_model_new_from_pretrained (opt_model, options, NULL, &error);
  if (model == NULL)
    goto fail;
  vocab = moe_model_get_vocab_size (model);
  backend = moe_model_dup_experts_implementation_name (model);
  printf ("load device=%s dtype=%s backend=%s vocab=%" G_GINT64_FORMAT " s=%.1f\n",
          moe_model_get_device (model), moe_model_get_dtype (model), backend ? backend : "?",
          vocab, (g_get_monotonic_time () - t0) * 1e-6);
  fflush (stdout);

  if (opt_prefill > 0)
    {
      g_autoptr(MoeTensor) ids = random_ids (1, opt_prefill, vocab, &error);
      double s;

      if (ids == NULL)
        goto fail;
      /* the forward (all logits; max_new 0), then the generation of one token */
      for (int max_new = opt_generate_only ? 1 : 0; max_new <= 1; max_new++)
        {
          if (!measure (model, ids, max_new, &s, &error))
            goto fail;
          printf ("%s P=%d tok/s=%.1f ms=%.2f\n", max_new ? "prefill-generate" : "prefill", opt_prefill,
                  opt_prefill / s, s * 1e3);
          fflush (stdout);
          g_array_append_val (rows, ((Row) { g_strdup_printf ("prefill P=%d (%s)", opt_prefill,
                                                              max_new ? "generate 1 token" : "forward, all logits"),
                                             opt_prefill / s, s * 1e3, g_strdup ("ms") }));
        }
    }

  for (guint i = 0; i < batches->len; i++)
    {
      gint64 B = g_array_index (batches, gint64, i);
      g_autoptr(MoeTensor) ids = random_ids (B, opt_decode_prompt, vocab, &error);
      double s1, sS, dt;

      if (ids == NULL ||
          !measure (model, ids, 1, &s1, &error) ||
          !measure (model, ids, 1 + opt_decode_steps, &sS, &error))
        {
          g_prefix_error (&error, "decode B=%" G_GINT64_FORMAT ": ", B);
          goto fail;
        }
      /* a noisy run can make this ≤ 0 on tiny models; print it as is */
      dt = sS - s1;
      printf ("decode B=%" G_GINT64_FORMAT " S=%d prompt=%d%s%s tok/s=%.1f ms/step=%.3f\n",
              B, opt_decode_steps, opt_decode_prompt, opt_sample ? " sample=" : "", opt_sample ? opt_sample : "",
              B * opt_decode_steps / dt, dt * 1e3 / opt_decode_steps);
      fflush (stdout);
      g_array_append_val (rows, ((Row) { g_strdup_printf ("decode B=%" G_GINT64_FORMAT " after %d tokens", B,
                                                          opt_decode_prompt),
                                         B * opt_decode_steps / dt, dt * 1e3 / opt_decode_steps,
                                         g_strdup ("ms/step") }));
    }

  printf ("\n| %s, %s, %s | tok/s | ms |\n|---|---:|---:|\n",
          moe_model_get_device (model), moe_model_get_dtype (model), backend ? backend : "?");
  for (guint i = 0; i < rows->len; i++)
    {
      Row *r = &g_array_index (rows, Row, i);
      printf ("| %s | %.1f | %.3f %s |\n", r->what, r->tok_s, r->ms, r->ms_unit);
    }

  g_free (opt_model);
  g_free (opt_device);
  g_free (opt_dtype);
  g_free (opt_backend);
  g_free (opt_batches);
  return EXIT_SUCCESS;

fail:
  g_printerr ("moe-bench-model: %s\n", error != NULL ? error->message : "failed");
  return EXIT_FAILURE;
}
