/* moe.c: the libmoe command-line tool
 *
 * Until whole-model generation lands, the main job runs a checkpoint's
 * expert layers through every discovered experts backend: it routes real
 * activations (the prompt's token embeddings, RMS-normalised, through each
 * layer's router), times every backend on them, and checks that the
 * backends agree.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <locale.h>

#include <libmoe.h>
#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

#define AGREEMENT_F32 1e-5
#define AGREEMENT_HALF 2e-2

static char *opt_prompt = NULL;
static char *opt_dtype = NULL;
static char **opt_backends = NULL;
static int opt_repeat = 20;
static gboolean opt_list = FALSE;
static gboolean opt_version = FALSE;
static char **opt_rest = NULL;

static const GOptionEntry entries[] = {
  { "prompt", 'p', 0, G_OPTION_ARG_STRING, &opt_prompt, "Text whose bytes are routed (byte-level models)", "TEXT" },
  { "experts-implementation", 'e', 0, G_OPTION_ARG_STRING_ARRAY, &opt_backends, "Run only this backend (repeatable)", "NAME" },
  { "dtype", 0, 0, G_OPTION_ARG_STRING, &opt_dtype, "Compute dtype: auto (the checkpoint's), float32, bfloat16, float16", "DTYPE" },
  { "repeat", 'n', 0, G_OPTION_ARG_INT, &opt_repeat, "Timed runs per backend and layer (median reported)", "N" },
  { "list-backends", 'l', 0, G_OPTION_ARG_NONE, &opt_list, "List the experts backends found and exit", NULL },
  { "version", 0, 0, G_OPTION_ARG_NONE, &opt_version, "Print the version and exit", NULL },
  { G_OPTION_REMAINING, 0, 0, G_OPTION_ARG_FILENAME_ARRAY, &opt_rest, NULL, "[CHECKPOINT]" },
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
  g_auto(GStrv) found = moe_plugin_registry_list_backends (registry);
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
      index = moe_tensor_new_from_bytes (MOE_DTYPE_I64, ks, 2, g_bytes_new_take (g_steal_pointer (&ids), T * s.top_k * 8), error);
      weights = moe_tensor_new_from_bytes (MOE_DTYPE_F32, ks, 2, g_bytes_new_take (g_steal_pointer (&w), T * s.top_k * 4), error);
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

int
main (int argc, char *argv[])
{
  g_autoptr(GOptionContext) context = g_option_context_new ("[CHECKPOINT] — run a MoE checkpoint's experts through every backend");
  g_autoptr(GError) error = NULL;
  g_autofree char *path = NULL;
  int status;

  setlocale (LC_ALL, "");
  g_option_context_add_main_entries (context, entries, NULL);
  g_option_context_set_description (context,
    "With no CHECKPOINT, runs the shipped demo model (a byte-level qwen3_moe trained on Python).\n"
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

  if (opt_rest != NULL && opt_rest[0] != NULL)
    path = g_strdup (opt_rest[0]);
  else if ((path = find_demo_model ()) == NULL)
    {
      g_printerr ("moe: the demo model is not installed; name a checkpoint directory\n");
      return 1;
    }

  status = run_experts_job (path, &error);
  if (error != NULL)
    g_printerr ("moe: %s\n", error->message);
  return status;
}
