/* moe-bench-experts.c: time moe_experts_forward on one case file
 *
 * Usage:
 *   moe-bench-experts --case FILE.safetensors [--backend NAME ...]
 *                     [--dtype f32|bf16] [--warmup N] [--repeat N]
 *                     [--min-repeat N] [--budget-s S] [--tokens T,T,...]
 *
 * The case file holds hidden_states [T,H] F32, top_k_index [T,K] I64,
 * top_k_weights [T,K] F32, up_weight [E,2I,H] F32, down_weight [E,H,I] F32
 * and optionally output_f64 [T,H] (the float64 reference), up_bias and
 * down_bias; its metadata may say act, has_gate, is_transposed and
 * interleaved_clamped_swiglu (values may be JSON-quoted: '"silu"').
 *
 * For each backend (default: every registered one that runs on the CPU) it warms up, times
 * --repeat calls of moe_experts_forward() with g_get_monotonic_time() and
 * prints one JSON object per line: backend, dtype, T, median_us, min_us,
 * runs, rel_err (‖out − ref‖ / ‖ref‖ in float64, null without a reference),
 * blas_core (the kernels OpenBLAS runs in this process, as libmoe left it;
 * null where the BLAS is another).
 *
 * --tokens runs the first T rows of the case for each listed T (tokens are
 * independent, so the first T rows of the reference are the reference).
 * The tensors are copied out of the memory-mapped file first (unless
 * --mmap): file pages can be evicted between calls (memory pressure,
 * DAMON-style proactive reclaim) and re-read from disk inside a timed call,
 * and transformers' side holds its weights in anonymous memory too.
 * --budget-s stops repeating a row once that many seconds were spent on it
 * and at least --min-repeat runs were timed, and cuts the warm-up short
 * after a quarter of it (so slow rows stay bounded).
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gmodule.h>
#include <libmoe.h>

/* The kernels OpenBLAS runs in this process (libmoe may have chosen them
 * as it loaded), or NULL */
static const char *
blas_core (void)
{
  static const char *core;
  static gsize once = 0;

  if (g_once_init_enter (&once))
    {
      GModule *self = g_module_open (NULL, G_MODULE_BIND_LAZY);
      char *(*corename) (void);

      if (self != NULL && g_module_symbol (self, "openblas_get_corename", (gpointer *) &corename))
        core = g_intern_string (corename ());
      if (self != NULL)
        g_module_close (self);
      g_once_init_leave (&once, 1);
    }
  return core;
}

static char *opt_case;
static char **opt_backends;
static char *opt_dtype;
static char *opt_tokens;
static int opt_warmup = 3;
static int opt_repeat = 20;
static int opt_min_repeat = 3;
static double opt_budget_s = 0.0;
static gboolean opt_mmap = FALSE;

static const GOptionEntry entries[] = {
  { "case", 'c', 0, G_OPTION_ARG_FILENAME, &opt_case, "The case file (safetensors)", "FILE" },
  { "backend", 'b', 0, G_OPTION_ARG_STRING_ARRAY, &opt_backends, "A backend to time (repeatable; default: all)", "NAME" },
  { "dtype", 'd', 0, G_OPTION_ARG_STRING, &opt_dtype, "Weights and hidden states dtype: f32 (default) or bf16", "DTYPE" },
  { "warmup", 'w', 0, G_OPTION_ARG_INT, &opt_warmup, "Untimed calls first (default 3)", "N" },
  { "repeat", 'r', 0, G_OPTION_ARG_INT, &opt_repeat, "Timed calls (default 20)", "N" },
  { "min-repeat", 0, 0, G_OPTION_ARG_INT, &opt_min_repeat, "With --budget-s, time at least this many calls (default 3)", "N" },
  { "budget-s", 0, 0, G_OPTION_ARG_DOUBLE, &opt_budget_s, "Stop repeating a row after this many seconds (default: no limit)", "S" },
  { "mmap", 0, 0, G_OPTION_ARG_NONE, &opt_mmap, "Run on the memory-mapped file instead of a private copy", NULL },
  { "tokens", 't', 0, G_OPTION_ARG_STRING, &opt_tokens, "Comma-separated token counts: run the first T rows (default: all rows)", "T,..." },
  { NULL }
};

/* "\"silu\"" -> "silu"; "silu" -> "silu" */
static char *
unquote (const char *v)
{
  gsize n;

  if (v == NULL)
    return NULL;
  n = strlen (v);
  if (n >= 2 && v[0] == '"' && v[n - 1] == '"')
    return g_strndup (v + 1, n - 2);
  return g_strdup (v);
}

static gboolean
meta_bool (MoeCheckpoint *ckpt,
           const char    *key,
           gboolean       fallback)
{
  g_autofree char *v = unquote (moe_checkpoint_get_metadata_value (ckpt, key));

  if (v == NULL)
    return fallback;
  return g_ascii_strcasecmp (v, "true") == 0 || g_str_equal (v, "1");
}

/* The first @rows rows of a CPU tensor, as a new tensor (a copy). */
static MoeTensor *
take_rows (MoeTensor  *t,
           gint64      rows,
           GError    **error)
{
  guint n_dims;
  const gint64 *shape = moe_tensor_get_shape (t, &n_dims);
  gint64 new_shape[MOE_TENSOR_MAX_DIMS];
  g_autoptr(GBytes) all = NULL;
  g_autoptr(GBytes) part = NULL;
  gsize row_bytes;

  if (shape[0] == rows)
    return g_object_ref (t);
  if (rows > shape[0] || rows <= 0)
    {
      g_set_error (error, G_OPTION_ERROR, G_OPTION_ERROR_BAD_VALUE,
                   "Cannot take %" G_GINT64_FORMAT " rows of a tensor with %" G_GINT64_FORMAT,
                   rows, shape[0]);
      return NULL;
    }
  all = moe_tensor_dup_bytes (t, error);
  if (all == NULL)
    return NULL;
  row_bytes = moe_tensor_get_n_bytes (t) / (gsize) shape[0];
  part = g_bytes_new_from_bytes (all, 0, row_bytes * (gsize) rows);
  memcpy (new_shape, shape, n_dims * sizeof (gint64));
  new_shape[0] = rows;
  return moe_tensor_new_from_bytes (moe_tensor_get_dtype (t), new_shape, n_dims, part, error);
}

/* Replaces *t by a copy in anonymous (heap) memory. */
static gboolean
to_heap (MoeTensor **t,
         GError    **error)
{
  g_autoptr(GBytes) mapped = moe_tensor_dup_bytes (*t, error);
  GBytes *copy;
  gsize size;
  gconstpointer data;
  MoeTensor *c;

  if (mapped == NULL)
    return FALSE;
  data = g_bytes_get_data (mapped, &size);
  copy = g_bytes_new_take (g_memdup2 (data, size), size);
  c = moe_tensor_new_from_bytes (moe_tensor_get_dtype (*t), moe_tensor_get_shape (*t, NULL),
                                 moe_tensor_get_n_dims (*t), copy, error);
  g_bytes_unref (copy);
  if (c == NULL)
    return FALSE;
  g_object_unref (*t);
  *t = c;
  return TRUE;
}

static int
cmp_gint64 (gconstpointer a,
            gconstpointer b)
{
  gint64 x = *(const gint64 *) a, y = *(const gint64 *) b;
  return (x > y) - (x < y);
}

/* ‖out − ref‖ / ‖ref‖ in float64; NAN if the shapes differ */
static double
relative_error (MoeTensor  *out,
                MoeTensor  *ref,
                GError    **error)
{
  g_autoptr(MoeTensor) ref64 = NULL;
  g_autoptr(MoeTensor) out64 = NULL;
  g_autoptr(GBytes) rb = NULL;
  g_autoptr(GBytes) ob = NULL;
  const double *r, *o;
  gsize n;
  double num = 0.0, den = 0.0;

  if (moe_tensor_get_n_elements (out) != moe_tensor_get_n_elements (ref))
    return NAN;
  ref64 = moe_tensor_to_dtype (ref, MOE_DTYPE_F64, error);
  if (ref64 == NULL)
    return NAN;
  out64 = moe_tensor_to_dtype (out, MOE_DTYPE_F64, error);
  if (out64 == NULL)
    return NAN;
  rb = moe_tensor_dup_bytes (ref64, error);
  ob = rb != NULL ? moe_tensor_dup_bytes (out64, error) : NULL;
  if (ob == NULL)
    return NAN;
  r = g_bytes_get_data (rb, &n);
  o = g_bytes_get_data (ob, NULL);
  n /= sizeof (double);
  for (gsize i = 0; i < n; i++)
    {
      double d = o[i] - r[i];
      num += d * d;
      den += r[i] * r[i];
    }
  return den > 0.0 ? sqrt (num / den) : sqrt (num);
}

static void
print_double (const char *key,
              double      v,
              const char *fmt)
{
  char buf[G_ASCII_DTOSTR_BUF_SIZE];

  if (isfinite (v))
    printf (", \"%s\": %s", key, g_ascii_formatd (buf, sizeof buf, fmt, v));
  else
    printf (", \"%s\": null", key);
}

/* Runs one (backend, T) row; prints its JSON line. */
static gboolean
bench_one (MoeExperts  *experts,
           const char  *backend,
           const char  *dtype_name,
           MoeTensor   *hidden,
           MoeTensor   *index,
           MoeTensor   *weights,
           MoeTensor   *ref,
           GError     **error)
{
  g_autoptr(GArray) times = g_array_new (FALSE, FALSE, sizeof (gint64));
  g_autoptr(MoeTensor) last = NULL;
  gint64 T = moe_tensor_get_dim (hidden, 0);
  gint64 started = g_get_monotonic_time ();
  double rel = NAN;
  g_autofree char *escaped = g_strescape (backend, NULL);

  moe_experts_set_implementation (experts, backend);

  for (int i = 0; i < opt_warmup; i++)
    {
      g_autoptr(MoeTensor) out = moe_experts_forward (experts, hidden, index, weights, error);
      if (out == NULL)
        return FALSE;
      if (last == NULL)
        last = g_object_ref (out);
      /* a slow row needs one warm-up call, not all of them */
      if (opt_budget_s > 0.0 && (double) (g_get_monotonic_time () - started) > opt_budget_s * 0.25e6)
        break;
    }

  started = g_get_monotonic_time ();
  for (int i = 0; i < opt_repeat; i++)
    {
      gint64 t0, t1;
      MoeTensor *out;

      t0 = g_get_monotonic_time ();
      out = moe_experts_forward (experts, hidden, index, weights, error);
      t1 = g_get_monotonic_time ();
      if (out == NULL)
        return FALSE;
      g_array_append_val (times, (gint64) { t1 - t0 });
      g_clear_object (&last);
      last = out;
      if (opt_budget_s > 0.0 && i + 1 >= opt_min_repeat &&
          (double) (t1 - started) > opt_budget_s * 1e6)
        break;
    }

  if (ref != NULL && last != NULL)
    {
      rel = relative_error (last, ref, error);
      if (isnan (rel) && error != NULL && *error != NULL)
        return FALSE;
    }

  printf ("{\"backend\": \"%s\", \"dtype\": \"%s\", \"T\": %" G_GINT64_FORMAT, escaped, dtype_name, T);
  if (times->len > 0)
    {
      gint64 median_us, min_us;
      guint n = times->len;

      g_array_sort (times, cmp_gint64);
      min_us = g_array_index (times, gint64, 0);
      median_us = n % 2 ? g_array_index (times, gint64, n / 2)
                        : (g_array_index (times, gint64, n / 2 - 1) + g_array_index (times, gint64, n / 2)) / 2;
      printf (", \"median_us\": %" G_GINT64_FORMAT ", \"min_us\": %" G_GINT64_FORMAT, median_us, min_us);
    }
  else
    printf (", \"median_us\": null, \"min_us\": null");
  printf (", \"runs\": %u", times->len);
  print_double ("rel_err", rel, "%.3e");
  printf (", \"blas_core\": ");
  if (blas_core () != NULL)
    printf ("\"%s\"", blas_core ());
  else
    printf ("null");
  printf ("}\n");
  fflush (stdout);
  return TRUE;
}

int
main (int    argc,
      char **argv)
{
  g_autoptr(GOptionContext) ctx = NULL;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeCheckpoint) ckpt = NULL;
  g_autoptr(MoeTensor) hidden = NULL;
  g_autoptr(MoeTensor) index = NULL;
  g_autoptr(MoeTensor) weights = NULL;
  g_autoptr(MoeTensor) up = NULL;
  g_autoptr(MoeTensor) down = NULL;
  g_autoptr(MoeTensor) ref = NULL;
  g_autoptr(MoeExperts) experts = NULL;
  g_auto(GStrv) all_backends = NULL;
  g_autofree char *act = NULL;
  g_autoptr(GArray) token_counts = g_array_new (FALSE, FALSE, sizeof (gint64));
  MoeDType dtype = MOE_DTYPE_F32;
  const char *dtype_name = "f32";
  char **backends;
  gint64 T_full;

  setlocale (LC_ALL, "");
  ctx = g_option_context_new ("- time the experts backends on one case file");
  g_option_context_add_main_entries (ctx, entries, NULL);
  if (!g_option_context_parse (ctx, &argc, &argv, &error))
    goto fail;
  if (opt_case == NULL)
    {
      g_set_error (&error, G_OPTION_ERROR, G_OPTION_ERROR_BAD_VALUE, "--case FILE is required");
      goto fail;
    }
  if (opt_dtype == NULL || g_str_equal (opt_dtype, "f32"))
    ;
  else if (g_str_equal (opt_dtype, "bf16"))
    {
      dtype = MOE_DTYPE_BF16;
      dtype_name = "bf16";
    }
  else
    {
      g_set_error (&error, G_OPTION_ERROR, G_OPTION_ERROR_BAD_VALUE,
                   "--dtype must be f32 or bf16, not “%s”", opt_dtype);
      goto fail;
    }
  if (opt_warmup < 0 || opt_repeat < 1 || opt_min_repeat < 1)
    {
      g_set_error (&error, G_OPTION_ERROR, G_OPTION_ERROR_BAD_VALUE,
                   "--warmup must be ≥ 0, --repeat and --min-repeat ≥ 1");
      goto fail;
    }

  ckpt = moe_checkpoint_open (opt_case, &error);
  if (ckpt == NULL)
    goto fail;
  if ((hidden = moe_checkpoint_get_tensor (ckpt, "hidden_states", &error)) == NULL ||
      (index = moe_checkpoint_get_tensor (ckpt, "top_k_index", &error)) == NULL ||
      (weights = moe_checkpoint_get_tensor (ckpt, "top_k_weights", &error)) == NULL ||
      (up = moe_checkpoint_get_tensor (ckpt, "up_weight", &error)) == NULL ||
      (down = moe_checkpoint_get_tensor (ckpt, "down_weight", &error)) == NULL)
    goto fail;
  if (moe_checkpoint_has_tensor (ckpt, "output_f64") &&
      (ref = moe_checkpoint_get_tensor (ckpt, "output_f64", &error)) == NULL)
    goto fail;

  if (!opt_mmap)
    {
      MoeTensor **all[] = { &hidden, &index, &weights, &up, &down, &ref };
      for (guint i = 0; i < G_N_ELEMENTS (all); i++)
        if (*all[i] != NULL && !to_heap (all[i], &error))
          goto fail;
    }

  if (dtype != MOE_DTYPE_F32)
    {
      MoeTensor **conv[] = { &hidden, &up, &down };
      for (guint i = 0; i < G_N_ELEMENTS (conv); i++)
        {
          MoeTensor *c = moe_tensor_to_dtype (*conv[i], dtype, &error);
          if (c == NULL)
            goto fail;
          g_object_unref (*conv[i]);
          *conv[i] = c;
        }
    }

  experts = moe_experts_new (up, down);
  act = unquote (moe_checkpoint_get_metadata_value (ckpt, "act"));
  if (act != NULL)
    moe_experts_set_activation (experts, act);
  moe_experts_set_has_gate (experts, meta_bool (ckpt, "has_gate", TRUE));
  moe_experts_set_is_transposed (experts, meta_bool (ckpt, "is_transposed", FALSE));
  if (meta_bool (ckpt, "interleaved_clamped_swiglu", FALSE))
    moe_experts_set_gate_layout (experts, MOE_GATE_LAYOUT_INTERLEAVED);
  {
    const char *bias_names[] = { "up_bias", "down_bias" };
    for (guint i = 0; i < G_N_ELEMENTS (bias_names); i++)
      if (moe_checkpoint_has_tensor (ckpt, bias_names[i]))
        {
          g_autoptr(MoeTensor) b = moe_checkpoint_get_tensor (ckpt, bias_names[i], &error);
          g_autoptr(MoeTensor) bc = NULL;
          if (b == NULL || (bc = moe_tensor_to_dtype (b, dtype, &error)) == NULL)
            goto fail;
          if (i == 0)
            moe_experts_set_up_bias (experts, bc);
          else
            moe_experts_set_down_bias (experts, bc);
        }
  }
  if (!moe_experts_validate (experts, &error))
    goto fail;

  T_full = moe_tensor_get_dim (hidden, 0);
  if (opt_tokens != NULL)
    {
      g_auto(GStrv) parts = g_strsplit (opt_tokens, ",", -1);
      for (guint i = 0; parts[i] != NULL; i++)
        {
          guint64 v;
          if (!g_ascii_string_to_unsigned (g_strstrip (parts[i]), 10, 1, (guint64) T_full, &v, &error))
            {
              g_prefix_error (&error, "--tokens: ");
              goto fail;
            }
          g_array_append_val (token_counts, (gint64) { (gint64) v });
        }
    }
  else
    g_array_append_val (token_counts, T_full);

  if (opt_backends != NULL && opt_backends[0] != NULL)
    backends = opt_backends;
  else
    {
      all_backends = moe_plugin_registry_list_backends_for_device (moe_plugin_registry_get_default (), "cpu");
      backends = all_backends;
      if (backends == NULL || backends[0] == NULL)
        {
          g_set_error (&error, G_IO_ERROR, G_IO_ERROR_NOT_FOUND,
                       "No experts backends are registered (check MOE_PLUGIN_PATH)");
          goto fail;
        }
    }

  for (guint ti = 0; ti < token_counts->len; ti++)
    {
      gint64 T = g_array_index (token_counts, gint64, ti);
      g_autoptr(MoeTensor) h = take_rows (hidden, T, &error);
      g_autoptr(MoeTensor) ix = h ? take_rows (index, T, &error) : NULL;
      g_autoptr(MoeTensor) w = ix ? take_rows (weights, T, &error) : NULL;
      g_autoptr(MoeTensor) r = NULL;

      if (w == NULL)
        goto fail;
      if (ref != NULL && (r = take_rows (ref, T, &error)) == NULL)
        goto fail;
      for (guint i = 0; backends[i] != NULL; i++)
        if (!bench_one (experts, backends[i], dtype_name, h, ix, w, r, &error))
          {
            g_prefix_error (&error, "%s, T=%" G_GINT64_FORMAT ": ", backends[i], T);
            goto fail;
          }
    }

  g_free (opt_case);
  g_free (opt_dtype);
  g_free (opt_tokens);
  g_strfreev (opt_backends);
  return EXIT_SUCCESS;

fail:
  g_printerr ("moe-bench-experts: %s\n", error != NULL ? error->message : "failed");
  return EXIT_FAILURE;
}
