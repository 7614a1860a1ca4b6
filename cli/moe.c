/* moe.c: the libmoe command-line tool
 *
 *   moe [OPTIONS] [CHECKPOINT]          generate (the demo model by default)
 *   moe experts [OPTIONS] [CHECKPOINT]  run the expert layers through every CPU backend
 *   moe quantize [--format F] SRC DST   write SRC with its experts quantized (FP8, FP4)
 *
 * Generation loads a checkpoint directory, prints the experts map, and
 * streams the new tokens (as text for byte-level models such as the shipped
 * demo, as ids otherwise) with tokens/s at the end. The experts job routes
 * real activations (the prompt's embeddings, RMS-normalised, through each
 * layer's router), times every backend that runs on the CPU on them and
 * checks they agree.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <locale.h>
#include <stdio.h>
#include <unistd.h>

#include <libmoe.h>
#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

#define AGREEMENT_F32 1e-5
#define AGREEMENT_HALF 2e-2

static char *opt_prompt = NULL;
static char *opt_format = NULL;
static char *opt_dtype = NULL;
static char **opt_backends = NULL;
static char *opt_device = NULL;
static char *opt_ids = NULL;
static int opt_repeat = 20;
static int opt_max_new = 160;
static gboolean opt_sample = FALSE;
static double opt_temperature = 1.0;
static int opt_top_k = 50;
static double opt_top_p = 1.0;
static gint64 opt_seed = 0;
static gboolean opt_list = FALSE;
static gboolean opt_version = FALSE;
static char **opt_rest = NULL;

static const GOptionEntry entries[] = {
  { "prompt", 'p', 0, G_OPTION_ARG_STRING, &opt_prompt, "Prompt text (byte-level models such as the demo)", "TEXT" },
  { "ids", 0, 0, G_OPTION_ARG_STRING, &opt_ids, "Prompt as comma-separated token ids", "ID,ID,…" },
  { "experts-implementation", 'e', 0, G_OPTION_ARG_STRING_ARRAY, &opt_backends,
    "Experts backend: a name, or key=name,… per sub-config (\"\" is the top level); with “experts”, a backend to run (repeatable)", "SPEC" },
  { "device", 'd', 0, G_OPTION_ARG_STRING, &opt_device, "Device: cpu (default) or one a plugin provides", "DEVICE" },
  { "dtype", 0, 0, G_OPTION_ARG_STRING, &opt_dtype, "auto (the checkpoint's), float32, bfloat16, float16", "DTYPE" },
  { "max-new-tokens", 'n', 0, G_OPTION_ARG_INT, &opt_max_new, "Tokens to generate (default 160)", "N" },
  { "sample", 's', 0, G_OPTION_ARG_NONE, &opt_sample, "Sample instead of greedy decoding", NULL },
  { "temperature", 't', 0, G_OPTION_ARG_DOUBLE, &opt_temperature, "Sampling temperature", "T" },
  { "top-k", 0, 0, G_OPTION_ARG_INT, &opt_top_k, "Sample among the k most likely tokens (0: all)", "K" },
  { "top-p", 0, 0, G_OPTION_ARG_DOUBLE, &opt_top_p, "Nucleus sampling threshold", "P" },
  { "seed", 0, 0, G_OPTION_ARG_INT64, &opt_seed, "Sampling seed", "SEED" },
  { "repeat", 'r', 0, G_OPTION_ARG_INT, &opt_repeat, "experts: timed runs per backend and layer", "N" },
  { "list-backends", 'l', 0, G_OPTION_ARG_NONE, &opt_list, "List the experts backends found and exit", NULL },
  { "version", 0, 0, G_OPTION_ARG_NONE, &opt_version, "Print the version and exit", NULL },
  { "format", 0, 0, G_OPTION_ARG_STRING, &opt_format,
    "quantize: fp8 (float scales, the default), fp8-ue8m0 (power-of-two scales) or fp4", "FORMAT" },
  { G_OPTION_REMAINING, 0, 0, G_OPTION_ARG_FILENAME_ARRAY, &opt_rest, NULL, "[experts|quantize] [CHECKPOINT…]" },
  { NULL }
};

/* The shipped demo model: next to the installed data, or in the source tree
 * when run from a build directory. */
static char *
find_demo_model (void)
{
  const char *env = g_getenv ("MOE_DEMO_MODEL");
  const char *candidates[] = { MOE_DEMO_MODEL_INSTALLED, MOE_DEMO_MODEL_SOURCE };

  if (env != NULL && *env != '\0')
    return g_strdup (env);
  for (guint i = 0; i < G_N_ELEMENTS (candidates); i++)
    {
      g_autofree char *cfg = g_build_filename (candidates[i], "config.json", NULL);
      if (g_file_test (cfg, G_FILE_TEST_IS_REGULAR))
        return g_strdup (candidates[i]);
    }
  return NULL;
}

typedef struct {
  gint64 hidden, experts, top_k, layers, vocab;
  double eps;
  gboolean norm_topk;
  char *act;
  const char *moe_module;   /* "mlp", or Mixtral's "block_sparse_moe" */
} Shape;

static gboolean
read_shape (MoeConfig *config, MoeCheckpoint *ck, Shape *s, GError **error)
{
  g_autoptr(GError) local = NULL;
  const char *type = moe_config_get_model_type (config);

  s->hidden = moe_config_get_int (config, "hidden_size", &local);
  if (local == NULL)
    s->layers = moe_config_get_int (config, "num_hidden_layers", &local);
  if (local == NULL)
    s->top_k = moe_config_get_int (config, "num_experts_per_tok", &local);
  if (local == NULL)
    s->eps = moe_config_get_double_or (config, "rms_norm_eps", 1e-6, &local);
  if (local == NULL)
    s->norm_topk = moe_config_get_boolean_or (config, "norm_topk_prob",
                                              g_strcmp0 (type, "mixtral") == 0, &local);
  if (local == NULL)
    s->act = moe_config_dup_string_or (config, "hidden_act", "silu", &local);
  if (local != NULL)
    {
      g_propagate_error (error, g_steal_pointer (&local));
      return FALSE;
    }
  /* transformers writes num_experts under its attribute-mapped name too */
  s->experts = moe_config_get_int_or (config, "num_experts", 0, NULL);
  if (s->experts == 0)
    s->experts = moe_config_get_int_or (config, "num_local_experts", 0, NULL);
  if (s->experts == 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_MISSING_KEY,
                   "config: neither num_experts nor num_local_experts is set");
      return FALSE;
    }
  if (moe_checkpoint_has_tensor (ck, "model.layers.0.block_sparse_moe.gate.weight"))
    s->moe_module = "block_sparse_moe";
  else
    s->moe_module = "mlp";
  return TRUE;
}

/* x = RMSNorm(embed(ids)) with the layer's post-attention norm weight. */
static float *
normed_embeddings (MoeCheckpoint *ck, const Shape *s, int layer, const guint8 *ids, gsize T, GError **error)
{
  g_autoptr(MoeTensor) embed = moe_checkpoint_get_tensor (ck, "model.embed_tokens.weight", error);
  g_autofree char *norm_name = g_strdup_printf ("model.layers.%d.post_attention_layernorm.weight", layer);
  g_autoptr(MoeTensor) norm = NULL;
  g_autofree float *table = NULL, *w = NULL;
  float *x;
  gsize H = s->hidden;

  if (embed == NULL || !(norm = moe_checkpoint_get_tensor (ck, norm_name, error)))
    return NULL;
  table = moe_cpu_tensor_dup_f32 (embed);
  w = moe_cpu_tensor_dup_f32 (norm);
  x = g_new (float, T * H);
  for (gsize t = 0; t < T; t++)
    {
      const float *e = table + (gsize) (ids[t] % moe_tensor_get_dim (embed, 0)) * H;
      double ss = 0;
      for (gsize j = 0; j < H; j++)
        ss += (double) e[j] * e[j];
      float r = (float) (1.0 / sqrt (ss / H + s->eps));
      for (gsize j = 0; j < H; j++)
        x[t * H + j] = e[j] * r * w[j];
    }
  return x;
}

/* Softmax over all experts in fp32, top-k, optional renormalisation: the
 * Qwen/Mixtral router. */
static void
route (MoeCheckpoint *ck, const Shape *s, int layer, const float *x, gsize T,
       gint64 *ids, float *weights, GError **error)
{
  g_autofree char *name = g_strdup_printf ("model.layers.%d.%s.gate.weight", layer, s->moe_module);
  g_autoptr(MoeTensor) gate = moe_checkpoint_get_tensor (ck, name, error);
  g_autofree float *wg = NULL;
  g_autofree float *p = g_new (float, s->experts);
  gsize H = s->hidden, E = s->experts, K = s->top_k;

  if (gate == NULL)
    return;
  wg = moe_cpu_tensor_dup_f32 (gate);
  for (gsize t = 0; t < T; t++)
    {
      float max = -INFINITY, sum = 0, kept = 0;
      for (gsize e = 0; e < E; e++)
        {
          float l = 0;
          for (gsize j = 0; j < H; j++)
            l += x[t * H + j] * wg[e * H + j];
          p[e] = l;
          max = MAX (max, l);
        }
      for (gsize e = 0; e < E; e++)
        sum += (p[e] = expf (p[e] - max));
      for (gsize k = 0; k < K; k++)
        {
          gsize best = 0;
          for (gsize e = 1; e < E; e++)
            if (p[e] > p[best])
              best = e;
          ids[t * K + k] = (gint64) best;
          weights[t * K + k] = p[best] / sum;
          kept += p[best] / sum;
          p[best] = -1;
        }
      if (s->norm_topk)
        for (gsize k = 0; k < K; k++)
          weights[t * K + k] /= kept;
    }
}

static int
compare_gint64 (gconstpointer a, gconstpointer b)
{
  gint64 x = *(const gint64 *) a, y = *(const gint64 *) b;
  return x < y ? -1 : x > y;
}

static double
rel_diff (MoeTensor *a, MoeTensor *b)
{
  g_autofree float *x = moe_cpu_tensor_dup_f32 (a);
  g_autofree float *y = moe_cpu_tensor_dup_f32 (b);
  double num = 0, den = 0;

  for (gint64 i = 0; i < moe_tensor_get_n_elements (a); i++)
    {
      num += ((double) x[i] - y[i]) * ((double) x[i] - y[i]);
      den += (double) y[i] * y[i];
    }
  return den > 0 ? sqrt (num / den) : sqrt (num);
}

static int
run_experts_job (const char *path, GError **error)
{
  MoePluginRegistry *registry = moe_plugin_registry_get_default ();
  g_auto(GStrv) found = moe_plugin_registry_list_backends_for_device (registry, "cpu");
  g_autofree char *config_path = g_build_filename (path, "config.json", NULL);
  g_autoptr(MoeConfig) config = NULL;
  g_autoptr(MoeCheckpoint) ck = NULL;
  const char *prompt = opt_prompt ? opt_prompt : "def read_config(path):\n    ";
  const char * const *backends;
  Shape s = { 0, };
  gsize T = strlen (prompt);
  double worst = 0, tolerance;
  gboolean have_dtype = FALSE;
  MoeDType dtype = MOE_DTYPE_F32;
  int status = 0;

  backends = opt_backends ? (const char * const *) opt_backends : (const char * const *) found;
  if (opt_repeat < 1)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT, "--repeat must be at least 1");
      return 1;
    }
  if (backends[0] == NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND,
                   "No experts backends found; set MOE_PLUGIN_PATH or install libmoe's plugins");
      return 1;
    }
  if (opt_dtype != NULL && !g_str_equal (opt_dtype, "auto"))
    {
      if (!moe_dtype_from_name (opt_dtype, &dtype) || !moe_dtype_is_float (dtype) || dtype == MOE_DTYPE_F64)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                       "Unknown dtype “%s”; valid: auto, float32, bfloat16, float16", opt_dtype);
          return 1;
        }
      have_dtype = TRUE;
    }
  if (T == 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT, "The prompt is empty");
      return 1;
    }

  config = moe_config_new_from_file (config_path, error);
  if (config == NULL || !(ck = moe_checkpoint_open (path, error)) || !read_shape (config, ck, &s, error))
    return 1;

  g_print ("libmoe %s — the experts layers of %s\n", MOE_VERSION_S, path);
  g_print ("model_type %s: %" G_GINT64_FORMAT " layers, %" G_GINT64_FORMAT " experts, top-%" G_GINT64_FORMAT
           ", hidden %" G_GINT64_FORMAT "\n",
           moe_config_get_model_type (config), s.layers, s.experts, s.top_k, s.hidden);
  {
    g_autofree char *escaped = g_strescape (prompt, NULL);
    g_print ("routing the %" G_GSIZE_FORMAT " bytes of \"%s\" (embeddings → RMSNorm → router) through each layer\n\n",
             T, escaped);
  }
  g_print ("%-5s  %-14s  %-6s  %12s  %12s  %s\n", "layer", "backend", "dtype", "median µs", "tokens/s", "rel. diff vs first");

  for (int layer = 0; layer < s.layers; layer++)
    {
      g_autofree char *prefix = g_strdup_printf ("model.layers.%d.%s.experts", layer, s.moe_module);
      g_autoptr(MoeExperts) experts = moe_checkpoint_load_experts (ck, prefix, error);
      g_autofree float *x = NULL;
      g_autofree gint64 *ids = g_new (gint64, T * s.top_k);
      g_autofree float *w = g_new (float, T * s.top_k);
      g_autoptr(MoeTensor) hidden = NULL, index = NULL, weights = NULL, first = NULL;
      gint64 hs[2] = { (gint64) T, s.hidden }, ks[2] = { (gint64) T, s.top_k };

      if (experts == NULL)
        return 1;
      moe_experts_set_activation (experts, s.act);
      if (!have_dtype)
        dtype = moe_tensor_get_dtype (moe_experts_get_up_weight (experts));
      else if (dtype != moe_tensor_get_dtype (moe_experts_get_up_weight (experts)))
        {
          g_autoptr(MoeTensor) up = moe_tensor_to_dtype (moe_experts_get_up_weight (experts), dtype, error);
          g_autoptr(MoeTensor) down = moe_tensor_to_dtype (moe_experts_get_down_weight (experts), dtype, error);
          g_autoptr(MoeExperts) converted = NULL;
          if (up == NULL || down == NULL)
            return 1;
          converted = moe_experts_new (up, down);
          moe_experts_set_activation (converted, s.act);
          g_set_object (&experts, converted);
        }

      x = normed_embeddings (ck, &s, layer, (const guint8 *) prompt, T, error);
      if (x == NULL)
        return 1;
      route (ck, &s, layer, x, T, ids, w, error);
      if (error != NULL && *error != NULL)
        return 1;
      hidden = moe_cpu_tensor_from_f32 (x, dtype, hs, 2, error);
      g_autoptr(GBytes) ids_bytes = g_bytes_new_take (g_steal_pointer (&ids), T * s.top_k * 8);
      g_autoptr(GBytes) w_bytes = g_bytes_new_take (g_steal_pointer (&w), T * s.top_k * 4);
      index = moe_tensor_new_from_bytes (MOE_DTYPE_I64, ks, 2, ids_bytes, error);
      weights = moe_tensor_new_from_bytes (MOE_DTYPE_F32, ks, 2, w_bytes, error);
      if (hidden == NULL || index == NULL || weights == NULL)
        return 1;

      for (guint b = 0; backends[b] != NULL; b++)
        {
          g_autoptr(GArray) times = g_array_new (FALSE, FALSE, sizeof (gint64));
          g_autoptr(MoeTensor) out = NULL;
          double diff = 0, median;

          moe_experts_set_implementation (experts, backends[b]);
          out = moe_experts_forward (experts, hidden, index, weights, error);   /* warm-up */
          if (out == NULL)
            return 1;
          for (int r = 0; r < MAX (opt_repeat, 1); r++)
            {
              gint64 t0 = g_get_monotonic_time ();
              g_autoptr(MoeTensor) o = moe_experts_forward (experts, hidden, index, weights, error);
              gint64 dt = g_get_monotonic_time () - t0;
              if (o == NULL)
                return 1;
              g_array_append_val (times, dt);
            }
          g_array_sort (times, compare_gint64);
          median = g_array_index (times, gint64, times->len / 2);
          if (first == NULL)
            first = g_object_ref (out);
          else
            diff = rel_diff (out, first);
          worst = MAX (worst, diff);
          g_print ("%-5d  %-14s  %-6s  %12.1f  %12.0f  %.2e\n", layer, backends[b],
                   moe_dtype_get_name (dtype), median, T / (MAX (median, 1) * 1e-6), diff);
        }
    }

  tolerance = dtype == MOE_DTYPE_F32 ? AGREEMENT_F32 : AGREEMENT_HALF;
  g_print ("\n");
  if (worst <= tolerance)
    g_print ("The %u backends agree: largest relative difference %.2e (tolerance %.0e).\n",
             g_strv_length ((char **) backends), worst, tolerance);
  else
    {
      g_printerr ("The backends DISAGREE: largest relative difference %.2e exceeds %.0e.\n", worst, tolerance);
      status = 2;
    }
  g_free (s.act);
  return status;
}

/* --experts-implementation: "name" for every entry, or "key=name,key=name" */
static gboolean
parse_experts_spec (const char *spec, MoeLoadOptions *opts, GError **error)
{
  g_auto(GStrv) parts = NULL;
  g_autoptr(GHashTable) map = NULL;

  if (strchr (spec, '=') == NULL)
    {
      moe_load_options_set_experts_implementation (opts, spec);
      return TRUE;
    }
  map = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, g_free);
  parts = g_strsplit (spec, ",", -1);
  for (guint i = 0; parts[i]; i++)
    {
      char *eq = strchr (parts[i], '=');
      if (eq == NULL || eq[1] == '\0')
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                       "--experts-implementation: “%s” is not key=name (use =name for the top level)", parts[i]);
          return FALSE;
        }
      g_hash_table_insert (map, g_strndup (parts[i], eq - parts[i]), g_strdup (eq + 1));
    }
  moe_load_options_set_experts_implementation_map (opts, map);
  return TRUE;
}

static MoeTensor *
prompt_ids (gboolean byte_level, GError **error)
{
  g_autoptr(GArray) ids = g_array_new (FALSE, FALSE, sizeof (gint64));
  gint64 shape[2] = { 1, 0 };

  if (opt_ids != NULL)
    {
      g_auto(GStrv) parts = g_strsplit (opt_ids, ",", -1);
      for (guint i = 0; parts[i]; i++)
        {
          gint64 v;
          if (!g_ascii_string_to_signed (g_strstrip (parts[i]), 10, 0, G_MAXINT64, &v, NULL))
            {
              g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                           "--ids: “%s” is not a token id", parts[i]);
              return NULL;
            }
          g_array_append_val (ids, v);
        }
    }
  else if (byte_level)
    {
      const char *text = opt_prompt ? opt_prompt : "def read_config(path):\n    ";
      for (const guchar *p = (const guchar *) text; *p; p++)
        {
          gint64 v = *p;
          g_array_append_val (ids, v);
        }
    }
  else
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "This model has a tokenizer libmoe does not read; give the prompt as --ids 1,2,3");
      return NULL;
    }
  if (ids->len == 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT, "The prompt is empty");
      return NULL;
    }
  shape[1] = ids->len;
  {
    g_autoptr(GBytes) bytes = g_bytes_new (ids->data, ids->len * sizeof (gint64));
    return moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 2, bytes, error);
  }
}

typedef struct {
  GMainLoop *loop;
  MoeModel  *model;
  MoeTensor *result;
  GError    *error;
  gboolean   byte_level;
  guint      tokens;
  gint64     started, first_token;
} Run;

static void
on_loaded (GObject *source, GAsyncResult *res, gpointer data)
{
  Run *r = data;
  r->model = moe_model_new_from_pretrained_finish (res, &r->error);
  g_main_loop_quit (r->loop);
}

static gboolean
on_loading_tick (gpointer data)
{
  Run *r = data;
  g_printerr ("\rloading… %.1f s", (g_get_monotonic_time () - r->started) / 1e6);
  return G_SOURCE_CONTINUE;
}

static void
on_token (MoeModel *model, MoeTensor *tokens, gpointer data)
{
  Run *r = data;
  gint64 id = *(const gint64 *) moe_tensor_get_data (tokens);

  if (r->tokens++ == 0)
    r->first_token = g_get_monotonic_time ();
  if (r->byte_level)
    {
      guchar c = (guchar) id;
      fwrite (&c, 1, 1, stdout);
    }
  else
    g_print (" %" G_GINT64_FORMAT, id);
  fflush (stdout);
}

static void
on_generated (GObject *source, GAsyncResult *res, gpointer data)
{
  Run *r = data;
  r->result = moe_model_generate_finish (MOE_MODEL (source), res, &r->error);
  g_main_loop_quit (r->loop);
}

static int
compare_strings (gconstpointer a, gconstpointer b)
{
  return strcmp (*(const char * const *) a, *(const char * const *) b);
}

static int
run_generate_job (const char *path, GError **error)
{
  g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
  g_autoptr(MoeGenerationConfig) cfg = NULL;
  g_autoptr(MoeTensor) ids = NULL;
  g_autoptr(GHashTable) map = NULL;
  g_autoptr(GPtrArray) keys = NULL;
  Run r = { 0, };
  guint tick;
  gint64 done;
  double seconds, decode_seconds;

  if (opt_max_new < 0 || opt_top_k < 0 || opt_temperature <= 0 || opt_top_p <= 0 || opt_top_p > 1 || opt_seed < 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "--max-new-tokens and --top-k must be ≥ 0, --temperature > 0, 0 < --top-p ≤ 1, --seed ≥ 0");
      return 1;
    }
  if (opt_dtype != NULL)
    moe_load_options_set_dtype (opts, opt_dtype);
  if (opt_device != NULL)
    moe_load_options_set_device (opts, opt_device);
  if (opt_backends != NULL && opt_backends[0] != NULL &&
      !parse_experts_spec (opt_backends[g_strv_length (opt_backends) - 1], opts, error))
    return 1;

  r.loop = g_main_loop_new (NULL, FALSE);
  r.started = g_get_monotonic_time ();
  tick = isatty (2) ? g_timeout_add (200, on_loading_tick, &r) : 0;
  moe_model_new_from_pretrained_async (path, opts, NULL, on_loaded, &r);
  g_main_loop_run (r.loop);
  if (tick)
    {
      g_source_remove (tick);
      g_printerr ("\r");
    }
  if (r.model == NULL)
    {
      g_propagate_error (error, r.error);
      g_main_loop_unref (r.loop);
      return 1;
    }
  g_printerr ("loaded %s (%s, %s, %s) in %.2f s\n", path,
              moe_config_get_model_type (moe_model_get_config (r.model)),
              moe_model_get_dtype (r.model), moe_model_get_device (r.model),
              (g_get_monotonic_time () - r.started) / 1e6);

  map = moe_model_get_experts_implementation (r.model);
  keys = g_ptr_array_new ();
  {
    GHashTableIter iter;
    gpointer k;
    g_hash_table_iter_init (&iter, map);
    while (g_hash_table_iter_next (&iter, &k, NULL))
      g_ptr_array_add (keys, k);
  }
  g_ptr_array_sort (keys, compare_strings);
  g_printerr ("experts implementation:");
  for (guint i = 0; i < keys->len; i++)
    g_printerr (" %s=%s", *(char *) keys->pdata[i] ? (char *) keys->pdata[i] : "\"\"",
                (char *) g_hash_table_lookup (map, keys->pdata[i]));
  g_printerr ("\n");

  r.byte_level = moe_model_get_vocab_size (r.model) == 256 && opt_ids == NULL;
  ids = prompt_ids (r.byte_level, error);
  if (ids == NULL)
    {
      g_object_unref (r.model);
      g_main_loop_unref (r.loop);
      return 1;
    }
  cfg = moe_generation_config_copy (moe_model_get_generation_config (r.model));
  g_object_set (cfg, "max-new-tokens", opt_max_new, "do-sample", opt_sample, "temperature", opt_temperature,
                "top-k", opt_top_k, "top-p", opt_top_p, "seed", (guint64) opt_seed, NULL);

  if (r.byte_level)
    {
      const gint64 *p = moe_tensor_get_data (ids);
      for (gint64 i = 0; i < moe_tensor_get_dim (ids, 1); i++)
        putchar ((int) p[i]);
    }
  else
    {
      const gint64 *p = moe_tensor_get_data (ids);
      for (gint64 i = 0; i < moe_tensor_get_dim (ids, 1); i++)
        g_print ("%s%" G_GINT64_FORMAT, i ? " " : "", p[i]);
    }
  fflush (stdout);

  r.started = g_get_monotonic_time ();
  moe_model_generate_async (r.model, ids, NULL, cfg, on_token, &r, NULL, NULL, on_generated, &r);
  g_main_loop_run (r.loop);
  done = g_get_monotonic_time ();
  g_print ("\n");
  if (r.result == NULL)
    {
      g_propagate_error (error, r.error);
      g_object_unref (r.model);
      g_main_loop_unref (r.loop);
      return 1;
    }
  seconds = (done - r.started) / 1e6;
  decode_seconds = r.tokens > 1 ? (done - r.first_token) / 1e6 : 0;
  g_printerr ("%u tokens in %.2f s: %.1f tokens/s (prefill of %" G_GINT64_FORMAT " tokens %.1f ms, decode %.1f tokens/s)\n",
              r.tokens, seconds, r.tokens / MAX (seconds, 1e-9), moe_tensor_get_dim (ids, 1),
              (r.first_token - r.started) / 1e3, r.tokens > 1 ? (r.tokens - 1) / MAX (decode_seconds, 1e-9) : 0.0);
  g_object_unref (r.result);
  g_object_unref (r.model);
  g_main_loop_unref (r.loop);
  return 0;
}

int
main (int argc, char *argv[])
{
  g_autoptr(GOptionContext) context = g_option_context_new ("[experts] [CHECKPOINT] — generate with a MoE checkpoint");
  g_autoptr(GError) error = NULL;
  g_autofree char *path = NULL;
  int status;

  setlocale (LC_ALL, "");
  g_option_context_add_main_entries (context, entries, NULL);
  g_option_context_set_description (context,
    "With no CHECKPOINT, runs the shipped demo model (a byte-level qwen3_moe trained on Python).\n"
    "“moe experts” times the checkpoint's expert layers with every CPU backend and checks they agree.\n"
    "“moe quantize [--format fp8|fp8-ue8m0|fp4] SRC DST” writes SRC with its experts quantized as\n"
    "transformers' fine-grained FP8 reads them.\n"
    "Backends are GModule plugins found through MOE_PLUGIN_PATH and the installed plugin directory.");
  if (!g_option_context_parse (context, &argc, &argv, &error))
    {
      g_printerr ("moe: %s\n", error->message);
      return 1;
    }
  if (opt_version)
    {
      g_print ("moe %s (plugin ABI %d)\n", MOE_VERSION_S, MOE_PLUGIN_ABI_VERSION);
      return 0;
    }
  if (opt_list)
    {
      g_auto(GStrv) names = moe_plugin_registry_list_backends (moe_plugin_registry_get_default ());
      for (guint i = 0; names[i]; i++)
        {
          MoePluginInfo *info = moe_plugin_registry_lookup (moe_plugin_registry_get_default (),
                                                            MOE_PLUGIN_KIND_EXPERTS_BACKEND, names[i]);
          g_print ("%-12s %s\n", names[i], moe_plugin_info_get_description (info) ?: "");
        }
      return 0;
    }

  if (opt_rest != NULL && opt_rest[0] != NULL && g_str_equal (opt_rest[0], "quantize"))
    {
      MoeQuantFormat format = MOE_QUANT_FORMAT_FP8;

      if (g_strv_length (opt_rest) != 3)
        {
          g_printerr ("moe: quantize wants a source and a destination directory\n");
          return 1;
        }
      if (opt_format != NULL && !moe_quant_format_from_name (opt_format, &format))
        {
          g_printerr ("moe: unknown --format “%s”; valid: fp8, fp8-ue8m0, fp4\n", opt_format);
          return 1;
        }
      if (!moe_quantize_checkpoint (opt_rest[1], opt_rest[2], format, NULL, &error))
        {
          g_printerr ("moe: %s\n", error->message);
          return 1;
        }
      g_print ("%s: the experts of %s in %s\n", opt_rest[2], opt_rest[1], opt_format ? opt_format : "fp8");
      return 0;
    }

  {
    gboolean experts = opt_rest != NULL && opt_rest[0] != NULL && g_str_equal (opt_rest[0], "experts");
    char **rest = opt_rest ? opt_rest + experts : NULL;

    if (rest != NULL && rest[0] != NULL && rest[1] != NULL)
      {
        g_printerr ("moe: one checkpoint at a time (got “%s” and “%s”)\n", rest[0], rest[1]);
        return 1;
      }
    if (rest != NULL && rest[0] != NULL)
      path = g_strdup (rest[0]);
    else if ((path = find_demo_model ()) == NULL)
      {
        g_printerr ("moe: the demo model is not installed; name a checkpoint directory\n");
        return 1;
      }
    status = experts ? run_experts_job (path, &error) : run_generate_job (path, &error);
  }
  if (error != NULL)
    g_printerr ("moe: %s\n", error->message);
  return status;
}
