/* test-model.c: whole models against transformers' fixtures, backend
 * selection, signals, the decode switch and generation
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <glib/gstdio.h>
#include <libmoe.h>
#include <moe-plugin.h>

#include "moe-test-model-fixture.h"

static MoeModel *
load_model (const char *family, const char *dtype, const char *impl)
{
  return moe_test_load_model (family, dtype, impl, "cpu");
}

static void
test_family_f32 (gconstpointer data)
{
  moe_test_family_f32 (data, "cpu");
}

static void
test_family_bf16 (gconstpointer data)
{
  moe_test_family_bf16 (data, "cpu");
}

static gboolean
map_equals (GHashTable *map, const char * const *kv)
{
  guint n = 0;

  for (; kv[0] != NULL; kv += 2, n++)
    if (g_strcmp0 (g_hash_table_lookup (map, kv[0]), kv[1]) != 0)
      return FALSE;
  return n == g_hash_table_size (map);
}

typedef struct {
  GPtrArray *events;   /* "key:old>new" */
} Recorder;

static void
on_changed (MoeModel *model, const char *key, const char *old_name, const char *new_name, gpointer data)
{
  GPtrArray *events = data;
  g_ptr_array_add (events, g_strdup_printf ("%s:%s>%s", key, old_name, new_name));
}

/* qwen3_vl_moe: per-sub-config map, as transformers' get/set */
static void
test_sub_config_map (void)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *path = moe_test_data_path ("models", "qwen3_vl_moe", NULL);
  g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
  g_autoptr(GHashTable) want = g_hash_table_new (g_str_hash, g_str_equal);
  g_autoptr(MoeModel) model = NULL;
  g_autoptr(GHashTable) map = NULL;
  g_autoptr(GPtrArray) events = g_ptr_array_new_with_free_func (g_free);
  g_autoptr(GPtrArray) text_events = g_ptr_array_new_with_free_func (g_free);
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen3_vl_moe", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) ref = moe_test_model_reference ("qwen3_vl_moe", "reference.safetensors", "logits");
  g_autofree char *impl = NULL;

  /* what transformers' reference.json records after this set */
  g_hash_table_insert (want, (gpointer) "", (gpointer) "grouped_mm");
  g_hash_table_insert (want, (gpointer) "text_config", (gpointer) "grouped_mm");
  g_hash_table_insert (want, (gpointer) "vision_config", (gpointer) "eager");
  g_hash_table_insert (want, (gpointer) "no_such_config", (gpointer) "eager");   /* ignored, as transformers does */
  moe_load_options_set_dtype (opts, "float32");
  moe_load_options_set_experts_implementation_map (opts, want);
  model = moe_model_new_from_pretrained (path, opts, NULL, &error);
  g_assert_no_error (error);
  map = moe_model_get_experts_implementation (model);
  g_assert_true (map_equals (map, (const char *[]) { "", "grouped_mm", "text_config", "grouped_mm",
                                                     "vision_config", "eager", NULL }));

  g_signal_connect (model, "experts-implementation-changed", G_CALLBACK (on_changed), events);
  g_signal_connect (model, "experts-implementation-changed::text_config", G_CALLBACK (on_changed), text_events);

  /* the text backbone's experts follow text_config */
  {
    g_autoptr(GHashTable) m2 = g_hash_table_new (g_str_hash, g_str_equal);
    g_autoptr(MoeTensor) logits = NULL;
    g_hash_table_insert (m2, (gpointer) "text_config", (gpointer) "eager");
    g_hash_table_insert (m2, (gpointer) "", (gpointer) "batched_mm");
    g_assert_true (moe_model_set_experts_implementation_map (model, m2, &error));
    logits = moe_model_forward (model, ids, &error);
    g_assert_no_error (error);
    g_assert_cmpfloat (moe_test_rel_error (logits, ref), <=, 1e-4);
  }
  g_assert_cmpuint (events->len, ==, 2);
  g_assert_cmpuint (text_events->len, ==, 1);
  g_assert_cmpstr (text_events->pdata[0], ==, "text_config:grouped_mm>eager");
  impl = moe_model_dup_experts_implementation_for (model, "text_config");
  g_assert_cmpstr (impl, ==, "eager");

  /* one name for every entry */
  g_assert_true (moe_model_set_experts_implementation (model, "batched_mm", &error));
  g_clear_pointer (&map, g_hash_table_unref);
  map = moe_model_get_experts_implementation (model);
  g_assert_true (map_equals (map, (const char *[]) { "", "batched_mm", "text_config", "batched_mm",
                                                     "vision_config", "batched_mm", NULL }));
  g_assert_cmpuint (events->len, ==, 4);

  g_assert_false (moe_model_set_experts_implementation_for (model, "audio_config", "eager", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND);
}

static void
count_notify (GObject *object, GParamSpec *pspec, gpointer data)
{
  (*(guint *) data)++;
}

static void
test_selection_errors (void)
{
  g_autoptr(MoeModel) model = load_model ("qwen3_moe", "float32", NULL);
  g_autoptr(GError) error = NULL;
  g_autoptr(GPtrArray) events = g_ptr_array_new_with_free_func (g_free);
  g_autoptr(GHashTable) map = NULL;
  g_autofree char *prop = NULL;
  guint notified = 0;

  /* the default is grouped_mm */
  map = moe_model_get_experts_implementation (model);
  g_assert_true (map_equals (map, (const char *[]) { "", "grouped_mm", NULL }));
  g_signal_connect (model, "experts-implementation-changed", G_CALLBACK (on_changed), events);
  g_signal_connect (model, "notify::experts-implementation", G_CALLBACK (count_notify), &notified);

  g_assert_false (moe_model_set_experts_implementation (model, "fastest_mm", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
  g_assert_nonnull (strstr (error->message, "fastest_mm"));
  g_assert_nonnull (strstr (error->message, "grouped_mm"));
  g_assert_nonnull (strstr (error->message, "deepgemm_megamoe"));
  g_clear_error (&error);

  /* into deepgemm_megamoe after load: refused, as transformers' RuntimeError */
  g_assert_false (moe_model_set_experts_implementation (model, "deepgemm_megamoe", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT);
  g_assert_nonnull (strstr (error->message, "load-time"));
  g_clear_error (&error);
  g_assert_cmpuint (events->len, ==, 0);

  /* a backend that needs a GPU: accepted at set time, refused by the
   * forward on the CPU, saying what it needs (transformers checks
   * availability lazily, at the first forward) */
  g_assert_true (moe_model_set_experts_implementation (model, "deepgemm", &error));
  {
    g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "input_ids");
    g_autoptr(MoeTensor) logits = moe_model_forward (model, ids, &error);
    g_assert_null (logits);
    g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
    g_assert_nonnull (strstr (error->message, "deepgemm runs on NVIDIA GPUs of compute capability 9.0"));
    g_assert_nonnull (strstr (error->message, "these experts are on cpu"));
    g_clear_error (&error);
  }

  g_object_set (model, "experts-implementation", "eager", NULL);
  g_object_get (model, "experts-implementation", &prop, NULL);
  g_assert_cmpstr (prop, ==, "eager");
  g_assert_cmpuint (notified, ==, 2);
  g_assert_cmpuint (events->len, ==, 2);
  g_assert_cmpstr (events->pdata[0], ==, ":grouped_mm>deepgemm");
  g_assert_cmpstr (events->pdata[1], ==, ":deepgemm>eager");

  /* megamoe chosen at load cannot be switched away from */
  {
    g_autofree char *path = moe_test_data_path ("models", "qwen3_moe", NULL);
    g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
    g_autoptr(MoeModel) mega = NULL;
    moe_load_options_set_experts_implementation (opts, "deepgemm_megamoe");
    mega = moe_model_new_from_pretrained (path, opts, NULL, &error);
    g_assert_no_error (error);
    g_assert_false (moe_model_set_experts_implementation (mega, "grouped_mm", &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT);
    g_clear_error (&error);
  }
  /* an unknown name at load */
  {
    g_autofree char *path = moe_test_data_path ("models", "qwen3_moe", NULL);
    g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
    g_autoptr(MoeModel) bad = NULL;
    moe_load_options_set_experts_implementation (opts, "gruoped_mm");
    bad = moe_model_new_from_pretrained (path, opts, NULL, &error);
    g_assert_null (bad);
    g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
  }
}

typedef struct {
  MoeModel     *model;
  GPtrArray    *events;
  GPtrArray    *phases;
  GCancellable *cancel_on_decode;
  const char   *break_on_decode;
  char         *seen_in_decode;
} Watch;

static void
on_phase (MoeModel *model, MoePhase phase, gpointer data)
{
  Watch *w = data;
  g_autoptr(GHashTable) map = moe_model_get_experts_implementation (model);

  g_ptr_array_add (w->phases, g_strdup_printf ("%d", phase));
  if (phase == MOE_PHASE_DECODE)
    {
      g_free (w->seen_in_decode);  /* a Watch may see several generations */
      w->seen_in_decode = g_strdup (g_hash_table_lookup (map, ""));
      if (w->cancel_on_decode)
        g_cancellable_cancel (w->cancel_on_decode);
      if (w->break_on_decode)
        g_assert_true (moe_model_set_experts_implementation (model, w->break_on_decode, NULL));
    }
}

static void
break_text_config (MoeModel *model, MoePhase phase)
{
  if (phase == MOE_PHASE_DECODE)
    g_assert_true (moe_model_set_experts_implementation_for (model, "text_config", "deepgemm", NULL));
}

static MoeTensor *
run_watched (Watch *w, MoeDecodeSwitch policy, GError **error)
{
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen2_moe", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();

  g_object_set (cfg, "max-new-tokens", 6, NULL);
  moe_model_set_decode_switch (w->model, policy);
  return moe_model_generate (w->model, prompt, cfg, w->cancel_on_decode, error);
}

static void
watch_init (Watch *w)
{
  memset (w, 0, sizeof *w);
  w->model = load_model ("qwen2_moe", "float32", "grouped_mm");
  w->events = g_ptr_array_new_with_free_func (g_free);
  w->phases = g_ptr_array_new_with_free_func (g_free);
  g_signal_connect (w->model, "experts-implementation-changed", G_CALLBACK (on_changed), w->events);
  g_signal_connect (w->model, "phase-changed", G_CALLBACK (on_phase), w);
}

static void
watch_clear (Watch *w)
{
  g_object_unref (w->model);
  g_ptr_array_unref (w->events);
  g_ptr_array_unref (w->phases);
  g_clear_object (&w->cancel_on_decode);
  g_free (w->seen_in_decode);
}

static void
assert_restored (Watch *w)
{
  g_autoptr(GHashTable) map = moe_model_get_experts_implementation (w->model);
  g_assert_true (map_equals (map, (const char *[]) { "", "grouped_mm", NULL }));
  g_assert_cmpint (moe_model_get_phase (w->model), ==, MOE_PHASE_IDLE);
}

static void
test_decode_switch (void)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("qwen2_moe", "reference.safetensors", "generated");
  Watch w;

  /* always: grouped_mm → batched_mm for the decode loop, back at the end */
  watch_init (&w);
  {
    g_autoptr(MoeTensor) out = run_watched (&w, MOE_DECODE_SWITCH_ALWAYS, &error);
    g_assert_no_error (error);
    g_assert_cmpint (moe_tensor_get_dim (out, 1), ==, 9 + 6);
    g_assert_cmpmem (moe_tensor_get_data (out), 15 * sizeof (gint64), moe_tensor_get_data (generated), 15 * sizeof (gint64));
  }
  g_assert_cmpuint (w.events->len, ==, 2);
  g_assert_cmpstr (w.events->pdata[0], ==, ":grouped_mm>batched_mm");
  g_assert_cmpstr (w.events->pdata[1], ==, ":batched_mm>grouped_mm");
  g_assert_cmpstr (w.seen_in_decode, ==, "batched_mm");
  g_assert_cmpuint (w.phases->len, ==, 3);
  g_assert_cmpstr (w.phases->pdata[0], ==, "1");
  g_assert_cmpstr (w.phases->pdata[1], ==, "2");
  g_assert_cmpstr (w.phases->pdata[2], ==, "0");
  assert_restored (&w);
  watch_clear (&w);

  /* auto on the CPU and never: nothing switches */
  for (MoeDecodeSwitch p = MOE_DECODE_SWITCH_AUTO; p <= MOE_DECODE_SWITCH_NEVER; p += MOE_DECODE_SWITCH_NEVER)
    {
      g_autoptr(MoeTensor) out = NULL;
      watch_init (&w);
      out = run_watched (&w, p, &error);
      g_assert_no_error (error);
      g_assert_cmpuint (w.events->len, ==, 0);
      g_assert_cmpstr (w.seen_in_decode, ==, "grouped_mm");
      watch_clear (&w);
    }

  /* by tokens (qwen2_moe: 8 experts, top-2): a 9-token prompt's prefill
   * (18 rows) stays grouped, its decode (2 rows) switches, as always does */
  watch_init (&w);
  {
    g_autoptr(MoeTensor) out = run_watched (&w, MOE_DECODE_SWITCH_BY_TOKENS, &error);
    g_assert_no_error (error);
    g_assert_cmpmem (moe_tensor_get_data (out), 15 * sizeof (gint64), moe_tensor_get_data (generated), 15 * sizeof (gint64));
  }
  g_assert_cmpuint (w.events->len, ==, 2);
  g_assert_cmpstr (w.seen_in_decode, ==, "batched_mm");
  assert_restored (&w);
  watch_clear (&w);
  {
    g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen2_moe", "reference.safetensors", "input_ids");
    const gint64 *row = moe_tensor_get_data (ids);
    g_autoptr(MoeGenerationConfig) one = moe_generation_config_new ();
    g_autoptr(GArray) five = g_array_new (FALSE, FALSE, sizeof (gint64));
    gint64 short_shape[2] = { 1, 3 }, five_shape[2] = { 5, 9 };
    g_autoptr(MoeTensor) short_prompt = NULL, five_prompts = NULL, out = NULL;

    for (int i = 0; i < 5; i++)
      g_array_append_vals (five, row, 9);
    {
      g_autoptr(GBytes) a = g_bytes_new (row, 3 * sizeof (gint64));
      g_autoptr(GBytes) b = g_bytes_new (five->data, 45 * sizeof (gint64));
      short_prompt = moe_tensor_new_from_bytes (MOE_DTYPE_I64, short_shape, 2, a, NULL);
      five_prompts = moe_tensor_new_from_bytes (MOE_DTYPE_I64, five_shape, 2, b, NULL);
    }

    /* a 3-token prompt (6 rows): its prefill switches already, so even one
     * new token (no decode step) runs batched_mm */
    g_object_set (one, "max-new-tokens", 1, NULL);
    watch_init (&w);
    moe_model_set_decode_switch (w.model, MOE_DECODE_SWITCH_BY_TOKENS);
    out = moe_model_generate (w.model, short_prompt, one, NULL, &error);
    g_assert_no_error (error);
    g_assert_cmpuint (w.events->len, ==, 2);
    g_assert_cmpstr (w.events->pdata[0], ==, ":grouped_mm>batched_mm");
    assert_restored (&w);
    watch_clear (&w);
    g_clear_object (&out);

    /* five sequences: decode steps of 10 rows stay grouped */
    watch_init (&w);
    moe_model_set_decode_switch (w.model, MOE_DECODE_SWITCH_BY_TOKENS);
    g_object_set (one, "max-new-tokens", 3, NULL);
    out = moe_model_generate (w.model, five_prompts, one, NULL, &error);
    g_assert_no_error (error);
    g_assert_cmpuint (w.events->len, ==, 0);
    g_assert_cmpstr (w.seen_in_decode, ==, "grouped_mm");
    watch_clear (&w);
  }

  /* only grouped_mm entries switch */
  watch_init (&w);
  g_assert_true (moe_model_set_experts_implementation (w.model, "eager", NULL));
  g_ptr_array_set_size (w.events, 0);
  {
    g_autoptr(MoeTensor) out = run_watched (&w, MOE_DECODE_SWITCH_ALWAYS, &error);
    g_assert_no_error (error);
  }
  g_assert_cmpuint (w.events->len, ==, 0);
  g_assert_cmpstr (w.seen_in_decode, ==, "eager");
  watch_clear (&w);

  /* cancelled mid-generation: error, map restored, model usable */
  watch_init (&w);
  w.cancel_on_decode = g_cancellable_new ();
  {
    g_autoptr(MoeTensor) out = run_watched (&w, MOE_DECODE_SWITCH_ALWAYS, &error);
    g_assert_null (out);
    g_assert_error (error, G_IO_ERROR, G_IO_ERROR_CANCELLED);
    g_clear_error (&error);
  }
  g_assert_cmpstr (w.events->pdata[w.events->len - 1], ==, ":batched_mm>grouped_mm");
  assert_restored (&w);
  g_clear_object (&w.cancel_on_decode);
  {
    g_autoptr(MoeTensor) out = run_watched (&w, MOE_DECODE_SWITCH_ALWAYS, &error);
    g_assert_no_error (error);
    g_assert_cmpmem (moe_tensor_get_data (out), 15 * sizeof (gint64), moe_tensor_get_data (generated), 15 * sizeof (gint64));
  }
  watch_clear (&w);

  /* an error mid-generation: a decode step's backend cannot run on the
   * CPU; the entry the user changed during the generation keeps the user's
   * value, and the switch leaves no batched_mm behind */
  watch_init (&w);
  w.break_on_decode = "deepgemm";
  {
    g_autoptr(MoeTensor) out = run_watched (&w, MOE_DECODE_SWITCH_ALWAYS, &error);
    g_autoptr(GHashTable) map = NULL;
    g_assert_null (out);
    g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
    g_assert_nonnull (strstr (error->message, "deepgemm runs on NVIDIA GPUs"));
    g_clear_error (&error);
    map = moe_model_get_experts_implementation (w.model);
    g_assert_true (map_equals (map, (const char *[]) { "", "deepgemm", NULL }));
    g_assert_cmpint (moe_model_get_phase (w.model), ==, MOE_PHASE_IDLE);
  }
  watch_clear (&w);

  /* the same with two MoE-bearing keys: the one the user did not touch is
   * restored after the error */
  {
    g_autofree char *path = moe_test_data_path ("models", "qwen3_vl_moe", NULL);
    g_autoptr(MoeModel) vl = moe_model_new_from_pretrained (path, NULL, NULL, &error);
    g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen3_vl_moe", "reference.safetensors", "input_ids");
    g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
    g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
    g_autoptr(MoeTensor) out = NULL;
    g_autoptr(GHashTable) map = NULL;
    Watch v = { vl, g_ptr_array_new_with_free_func (g_free), g_ptr_array_new_with_free_func (g_free), };

    g_assert_no_error (error);
    g_object_set (cfg, "max-new-tokens", 4, NULL);
    g_signal_connect (vl, "phase-changed", G_CALLBACK (on_phase), &v);
    v.break_on_decode = NULL;
    moe_model_set_decode_switch (vl, MOE_DECODE_SWITCH_ALWAYS);
    g_signal_connect_swapped (vl, "phase-changed", G_CALLBACK (break_text_config), vl);
    out = moe_model_generate (vl, prompt, cfg, NULL, &error);
    g_assert_null (out);
    g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
    g_clear_error (&error);
    map = moe_model_get_experts_implementation (vl);
    g_assert_true (map_equals (map, (const char *[]) { "", "grouped_mm", "text_config", "deepgemm",
                                                       "vision_config", "grouped_mm", NULL }));
    g_ptr_array_unref (v.events);
    g_ptr_array_unref (v.phases);
    g_free (v.seen_in_decode);
  }

  /* one new token: no decode step, no switch */
  watch_init (&w);
  {
    g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen2_moe", "reference.safetensors", "input_ids");
    g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
    g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
    g_autoptr(MoeTensor) out = NULL;
    g_object_set (cfg, "max-new-tokens", 1, NULL);
    moe_model_set_decode_switch (w.model, MOE_DECODE_SWITCH_ALWAYS);
    out = moe_model_generate (w.model, prompt, cfg, NULL, &error);
    g_assert_no_error (error);
    g_assert_cmpuint (w.events->len, ==, 0);
    g_assert_cmpuint (w.phases->len, ==, 2);   /* prefill, idle */
  }
  watch_clear (&w);
}

static MoeTensor *
ids_tensor (const gint64 *v, gint64 rows, gint64 cols)
{
  gint64 shape[2] = { rows, cols };
  g_autoptr(GBytes) bytes = g_bytes_new (v, rows * cols * sizeof (gint64));
  return moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 2, bytes, NULL);
}

/* a left-padded batch generates what each prompt generates alone */
static void
test_batch_padding (void)
{
  g_autoptr(MoeModel) model = load_model ("qwen3_moe", "float32", NULL);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  g_autoptr(GError) error = NULL;
  const gint64 a[9] = { 5, 17, 101, 44, 203, 7, 19, 88, 250 };
  const gint64 b[5] = { 31, 9, 140, 66, 2 };
  gint64 batch[18], mask[18];
  g_autoptr(MoeTensor) ta = ids_tensor (a, 1, 9), tb = ids_tensor (b, 1, 5);
  g_autoptr(MoeTensor) ga = NULL, gb = NULL, gbatch = NULL, tbatch = NULL, tmask = NULL;
  const gint64 *o, *oa, *ob;

  g_object_set (cfg, "max-new-tokens", 8, NULL);
  for (guint i = 0; i < 9; i++)
    {
      batch[i] = a[i];
      mask[i] = 1;
      batch[9 + i] = i < 4 ? 0 : b[i - 4];
      mask[9 + i] = i >= 4;
    }
  tbatch = ids_tensor (batch, 2, 9);
  tmask = ids_tensor (mask, 2, 9);
  ga = moe_model_generate (model, ta, cfg, NULL, &error);
  gb = moe_model_generate (model, tb, cfg, NULL, &error);
  gbatch = moe_model_generate_with_mask (model, tbatch, tmask, cfg, NULL, &error);
  g_assert_no_error (error);
  g_assert_cmpint (moe_tensor_get_dim (gbatch, 1), ==, 17);
  o = moe_tensor_get_data (gbatch);
  oa = moe_tensor_get_data (ga);
  ob = moe_tensor_get_data (gb);
  for (guint s = 0; s < 8; s++)
    {
      g_assert_cmpint (o[9 + s], ==, oa[9 + s]);
      g_assert_cmpint (o[17 + 9 + s], ==, ob[5 + s]);
    }
}

static void
test_sampling_and_stop (void)
{
  g_autoptr(MoeModel) model = load_model ("mixtral", "float32", NULL);
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("mixtral", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("mixtral", "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) s1 = NULL, s2 = NULL, s3 = NULL, greedy = NULL, stopped = NULL;
  const gint64 *g = moe_tensor_get_data (generated);
  gint64 stop;

  /* seeded sampling repeats; top-k 1 is greedy */
  g_object_set (cfg, "max-new-tokens", 12, "do-sample", TRUE, "temperature", 0.7, "top-p", 0.9, "seed", (guint64) 42, NULL);
  s1 = moe_model_generate (model, prompt, cfg, NULL, &error);
  s2 = moe_model_generate (model, prompt, cfg, NULL, &error);
  g_assert_no_error (error);
  moe_test_assert_same_ids (s1, s2);
  g_object_set (cfg, "top-k", 1, NULL);
  greedy = moe_model_generate (model, prompt, cfg, NULL, &error);
  moe_test_assert_same_ids (greedy, generated);
  g_object_set (cfg, "top-k", 50, "temperature", 5.0, "top-p", 1.0, "seed", (guint64) 7, NULL);
  s3 = moe_model_generate (model, prompt, cfg, NULL, &error);
  g_assert_false (memcmp (moe_tensor_get_data (s3), g, 21 * sizeof (gint64)) == 0);

  /* an end token stops the sequence (and is kept, as transformers keeps it) */
  stop = g[9 + 3];
  g_object_set (cfg, "do-sample", FALSE, NULL);
  moe_generation_config_set_eos_token_ids (cfg, &stop, 1);
  stopped = moe_model_generate (model, prompt, cfg, NULL, &error);
  g_assert_no_error (error);
  for (guint i = 9; i < 9 + 3; i++)
    g_assert_cmpint (g[i], !=, stop);   /* the fixture's earlier tokens are not the stop token */
  g_assert_cmpint (moe_tensor_get_dim (stopped, 1), ==, 9 + 4);
  g_assert_cmpint (((const gint64 *) moe_tensor_get_data (stopped))[12], ==, stop);
}

/* A copy of a fixture with its config edited, to check load errors. */
static char *
broken_copy (const char *family, const char *key, const char *json_value)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *src = moe_test_data_path ("models", family, NULL);
  g_autofree char *dir = g_dir_make_tmp ("moe-test-XXXXXX", &error);
  g_autofree char *cfg_src = g_build_filename (src, "config.json", NULL);
  g_autofree char *cfg_dst = g_build_filename (dir, "config.json", NULL);
  g_autofree char *model_src = g_build_filename (src, "model.safetensors", NULL);
  g_autofree char *model_dst = g_build_filename (dir, "model.safetensors", NULL);
  g_autofree char *text = NULL;
  g_autoptr(GRegex) re = NULL;
  g_autofree char *pattern = g_strdup_printf ("\"%s\": [^,\\n}]*", key);
  g_autofree char *replacement = json_value ? g_strdup_printf ("\"%s\": %s", key, json_value) : g_strdup ("\"removed_key\": 0");
  g_autofree char *edited = NULL;

  g_assert_no_error (error);
  g_assert_true (g_file_get_contents (cfg_src, &text, NULL, NULL));
  re = g_regex_new (pattern, 0, 0, NULL);
  edited = g_regex_replace_literal (re, text, -1, 0, replacement, 0, NULL);
  g_assert_cmpstr (edited, !=, text);
  g_assert_true (g_file_set_contents (cfg_dst, edited, -1, NULL));
  {
    g_autofree char *weights = NULL;
    gsize size;
    g_assert_true (g_file_get_contents (model_src, &weights, &size, NULL));
    g_assert_true (g_file_set_contents (model_dst, weights, size, NULL));
  }
  return g_steal_pointer (&dir);
}

static void
remove_copy (const char *dir)
{
  g_autofree char *a = g_build_filename (dir, "config.json", NULL);
  g_autofree char *b = g_build_filename (dir, "model.safetensors", NULL);
  g_unlink (a);
  g_unlink (b);
  g_rmdir (dir);
}

static void
test_load_errors (void)
{
  const struct { const char *key, *value; MoeError code; const char *substring; } cases[] = {
    { "model_type", "\"llama4_moe\"", MOE_ERROR_NOT_SUPPORTED, "llama4_moe" },
    { "hidden_size", NULL, MOE_ERROR_MISSING_KEY, "hidden_size" },
    { "hidden_size", "32", MOE_ERROR_SHAPE_MISMATCH, "config implies" },
    { "num_attention_heads", "\"four\"", MOE_ERROR_INVALID_CONFIG, "num_attention_heads" },
    { "num_hidden_layers", "-2", MOE_ERROR_INVALID_CONFIG, "num_hidden_layers" },
    { "num_hidden_layers", "3", MOE_ERROR_NOT_FOUND, "layers.2" },
    { "num_experts_per_tok", "99", MOE_ERROR_INVALID_CONFIG, "top-k" },
    { "hidden_act", "\"swoosh\"", MOE_ERROR_NOT_SUPPORTED, "swoosh" },
  };

  for (guint i = 0; i < G_N_ELEMENTS (cases); i++)
    {
      g_autoptr(GError) error = NULL;
      g_autofree char *dir = broken_copy ("qwen3_moe", cases[i].key, cases[i].value);
      g_autoptr(MoeModel) model = moe_model_new_from_pretrained (dir, NULL, NULL, &error);

      g_assert_null (model);
      g_assert_error (error, MOE_ERROR, (int) cases[i].code);
      g_test_message ("%s=%s: %s", cases[i].key, cases[i].value, error->message);
      if (strstr (error->message, cases[i].substring) == NULL)
        g_error ("“%s” does not mention “%s”", error->message, cases[i].substring);
      remove_copy (dir);
    }
  {
    g_autoptr(GError) error = NULL;
    g_autoptr(MoeModel) model = moe_model_new_from_pretrained ("/nonexistent/model", NULL, NULL, &error);
    g_assert_null (model);
    g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND);
  }
}

static void
test_forward_errors (void)
{
  g_autoptr(MoeModel) model = load_model ("olmoe", "float32", NULL);
  g_autoptr(GError) error = NULL;
  const gint64 bad[3] = { 1, 320, 2 };
  const gint64 ok[3] = { 1, 2, 3 };
  g_autoptr(MoeTensor) t = ids_tensor (bad, 1, 3);
  g_autoptr(MoeTensor) good = ids_tensor (ok, 1, 3);
  g_autoptr(MoeTensor) out = moe_model_forward (model, t, &error);

  g_assert_null (out);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT);
  g_assert_nonnull (strstr (error->message, "319"));
  g_clear_error (&error);
  {
    const gint64 m[3] = { 1, 2, 1 };
    g_autoptr(MoeTensor) mask = ids_tensor (m, 1, 3);
    g_assert_null (moe_model_forward_with_mask (model, good, mask, &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT);
    g_clear_error (&error);
  }
  {
    float f[3] = { 0, 1, 2 };
    gint64 shape[2] = { 1, 3 };
    g_autoptr(GBytes) fb = g_bytes_new (f, sizeof f);
    g_autoptr(MoeTensor) ft = moe_tensor_new_from_bytes (MOE_DTYPE_F32, shape, 2, fb, NULL);
    g_assert_null (moe_model_forward (model, ft, &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH);
    g_clear_error (&error);
  }
  out = moe_model_forward (model, good, &error);
  g_assert_no_error (error);
  g_assert_cmpint (moe_tensor_get_dim (out, 2), ==, 320);
}

typedef struct {
  GMainLoop *loop;
  MoeTensor *result;
  GError    *error;
  guint      tokens;
  guint      ticks;
} AsyncRun;

static void
on_token (MoeModel *model, MoeTensor *tokens, gpointer data)
{
  AsyncRun *r = data;
  g_assert_cmpint (moe_tensor_get_dim (tokens, 0), ==, 1);
  r->tokens++;
}

static void
on_generated (GObject *source, GAsyncResult *res, gpointer data)
{
  AsyncRun *r = data;
  r->result = moe_model_generate_finish (MOE_MODEL (source), res, &r->error);
  g_main_loop_quit (r->loop);
}

static gboolean
on_tick (gpointer data)
{
  ((AsyncRun *) data)->ticks++;
  return G_SOURCE_CONTINUE;
}

static void
test_async (void)
{
  g_autoptr(MoeModel) model = load_model ("gpt_oss", "float32", NULL);
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("gpt_oss", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("gpt_oss", "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  AsyncRun r = { g_main_loop_new (NULL, FALSE), };
  guint tick;

  g_object_set (cfg, "max-new-tokens", 12, NULL);
  tick = g_timeout_add (1, on_tick, &r);
  moe_model_generate_async (model, prompt, NULL, cfg, on_token, &r, NULL, NULL, on_generated, &r);
  g_main_loop_run (r.loop);
  g_source_remove (tick);
  g_assert_no_error (r.error);
  moe_test_assert_same_ids (r.result, generated);
  g_assert_cmpuint (r.tokens, ==, 12);
  g_clear_object (&r.result);

  /* cancelled before it starts */
  {
    g_autoptr(GCancellable) c = g_cancellable_new ();
    g_cancellable_cancel (c);
    moe_model_generate_async (model, prompt, NULL, cfg, NULL, NULL, NULL, c, on_generated, &r);
    g_main_loop_run (r.loop);
    g_assert_null (r.result);
    g_assert_error (r.error, G_IO_ERROR, G_IO_ERROR_CANCELLED);
    g_clear_error (&r.error);
  }
  g_main_loop_unref (r.loop);
}

static void
on_loaded (GObject *source, GAsyncResult *res, gpointer data)
{
  AsyncRun *r = data;
  MoeModel *model = moe_model_new_from_pretrained_finish (res, &r->error);
  g_assert_no_error (r->error);
  g_assert_true (MOE_IS_MODEL (model));
  g_assert_cmpstr (moe_config_get_model_type (moe_model_get_config (model)), ==, "deepseek_v3");
  g_object_unref (model);
  g_main_loop_quit (r->loop);
}

static void
test_load_async (void)
{
  g_autofree char *path = moe_test_data_path ("models", "deepseek_v3", NULL);
  AsyncRun r = { g_main_loop_new (NULL, FALSE), };

  moe_model_new_from_pretrained_async (path, NULL, NULL, on_loaded, &r);
  g_main_loop_run (r.loop);
  g_main_loop_unref (r.loop);
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);

  for (guint i = 0; i < G_N_ELEMENTS (moe_test_families); i++)
    {
      g_autofree char *p32 = g_strdup_printf ("/model/%s/f32", moe_test_families[i]);
      g_autofree char *p16 = g_strdup_printf ("/model/%s/bf16", moe_test_families[i]);
      g_test_add_data_func (p32, moe_test_families[i], test_family_f32);
      g_test_add_data_func (p16, moe_test_families[i], test_family_bf16);
    }
  g_test_add_func ("/model/sub-config-map", test_sub_config_map);
  g_test_add_func ("/model/selection-errors", test_selection_errors);
  g_test_add_func ("/model/decode-switch", test_decode_switch);
  g_test_add_func ("/model/batch-padding", test_batch_padding);
  g_test_add_func ("/model/sampling-and-stop", test_sampling_and_stop);
  g_test_add_func ("/model/load-errors", test_load_errors);
  g_test_add_func ("/model/forward-errors", test_forward_errors);
  g_test_add_func ("/model/async", test_async);
  g_test_add_func ("/model/load-async", test_load_async);

  return g_test_run ();
}
