/* moe-model.c: a Mixture-of-Experts language model
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>
#include <string.h>

#include "moe-private.h"
#include "moe-sampling-private.h"
#include "moe-transformer-private.h"
#include "moe-cpu-kernels.h"

/**
 * MoeModel:
 *
 * A causal language model with Mixture-of-Experts layers, loaded from a
 * Hugging Face checkpoint directory (`config.json`, `generation_config.json`,
 * safetensors shards). Families: qwen2_moe, qwen3_moe, mixtral, olmoe,
 * deepseek_v3, gpt_oss and the text backbone of qwen3_vl_moe.
 *
 * The experts backend is chosen per sub-config, as transformers does it: a
 * map from `""` (the top-level model) and each sub-config name
 * (`text_config`…) to a backend name, read with
 * [method@Model.get_experts_implementation] and changed with
 * [method@Model.set_experts_implementation] (one name for every entry) or
 * [method@Model.set_experts_implementation_map] (per key; keys the model
 * does not have are ignored, as transformers ignores them). Every change
 * emits [signal@Model::experts-implementation-changed], whose detail is the
 * key.
 *
 * During [method@Model.generate], when [property@Model:decode-switch] says
 * so (by default: on devices other than the CPU; or by each step's token
 * count), entries set to `grouped_mm` run the decode steps with
 * `batched_mm`; the map is restored when generation ends, also on error or
 * cancellation.
 *
 * Threading: calls may come from any thread. Forward passes and
 * generations on one model are serialised; a change of the experts map from
 * another thread takes effect at the next step. Signals and token callbacks
 * are delivered on the main context of the thread that created the model
 * (or, for [method@Model.generate_async], of its caller).
 */

static const char * const known_backends[] = {
  "eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe", "deepgemm_megamoe", NULL
};

#define MEGAMOE "deepgemm_megamoe"

struct _MoeModel
{
  GObject              parent_instance;

  char                *path;
  MoeConfig           *config;
  MoeCheckpoint       *checkpoint;
  MoeTransformer      *transformer;
  MoeGenerationConfig *generation_config;
  char                *device;
  MoeDType             dtype;

  GThread             *owner_thread;
  GMainContext        *owner_context;

  GMutex               lock;            /* guards the fields below */
  GPtrArray           *keys;            /* "" first, then the sub-configs */
  GHashTable          *impl;            /* key -> backend name */
  MoeDecodeSwitch      decode_switch;
  MoePhase             phase;

  GMutex               run_lock;        /* serialises forward passes */
};

enum {
  PROP_0,
  PROP_EXPERTS_IMPLEMENTATION,
  PROP_DEVICE,
  PROP_DTYPE,
  PROP_CONFIG,
  PROP_GENERATION_CONFIG,
  PROP_DECODE_SWITCH,
  PROP_PHASE,
  N_PROPS
};

enum {
  SIGNAL_EXPERTS_IMPLEMENTATION_CHANGED,
  SIGNAL_PHASE_CHANGED,
  N_SIGNALS
};

static GParamSpec *properties[N_PROPS];
static guint signals[N_SIGNALS];

G_DEFINE_FINAL_TYPE (MoeModel, moe_model, G_TYPE_OBJECT)

/* ------------------------------------------------------------------ */
/* Signals on the owner's context                                      */

typedef struct {
  MoeModel *model;
  int       what;          /* a signal id index, or -1 for a notify */
  char     *key, *old_name, *new_name;
  MoePhase  phase;
} Emission;

static gboolean
emit_now (gpointer data)
{
  Emission *e = data;

  moe_handoff_acquire (e);

  switch (e->what)
    {
    case SIGNAL_EXPERTS_IMPLEMENTATION_CHANGED:
      g_signal_emit (e->model, signals[SIGNAL_EXPERTS_IMPLEMENTATION_CHANGED],
                     g_quark_from_string (e->key), e->key, e->old_name, e->new_name);
      if (*e->key == '\0')
        g_object_notify_by_pspec (G_OBJECT (e->model), properties[PROP_EXPERTS_IMPLEMENTATION]);
      break;
    case SIGNAL_PHASE_CHANGED:
      g_object_notify_by_pspec (G_OBJECT (e->model), properties[PROP_PHASE]);
      g_signal_emit (e->model, signals[SIGNAL_PHASE_CHANGED], 0, e->phase);
      break;
    }
  return G_SOURCE_REMOVE;
}

static void
emission_free (gpointer data)
{
  Emission *e = data;

  moe_handoff_acquire (e);

  g_object_unref (e->model);
  g_free (e->key);
  g_free (e->old_name);
  g_free (e->new_name);
  g_free (e);
}

/* Queues @func on @context, always: g_main_context_invoke() would run it at
 * once, on this thread, whenever nobody iterates @context right now. */
static void
run_on_context (GMainContext   *context,
                GSourceFunc     func,
                gpointer        data,
                GDestroyNotify  destroy)
{
  GSource *source = g_idle_source_new ();

  moe_handoff_release (data);
  g_source_set_priority (source, G_PRIORITY_DEFAULT);
  g_source_set_callback (source, func, data, destroy);
  g_source_set_static_name (source, "[libmoe] callback");
  g_source_attach (source, context);
  g_source_unref (source);
}

/* Emits at once on the owner thread; from any other thread, queues the
 * emission on the owner's main context. */
static void
emit_on_owner (Emission *e)
{
  if (g_thread_self () == e->model->owner_thread)
    {
      emit_now (e);
      emission_free (e);
    }
  else
    run_on_context (e->model->owner_context, emit_now, e, emission_free);
}

static void
emit_changed (MoeModel *self, const char *key, const char *old_name, const char *new_name)
{
  Emission *e = g_new0 (Emission, 1);

  e->model = g_object_ref (self);
  e->what = SIGNAL_EXPERTS_IMPLEMENTATION_CHANGED;
  e->key = g_strdup (key);
  e->old_name = g_strdup (old_name);
  e->new_name = g_strdup (new_name);
  emit_on_owner (e);
}

static void
set_phase (MoeModel *self, MoePhase phase)
{
  Emission *e;

  moe_mutex_lock (&self->lock);
  if (self->phase == phase)
    {
      moe_mutex_unlock (&self->lock);
      return;
    }
  self->phase = phase;
  moe_mutex_unlock (&self->lock);

  e = g_new0 (Emission, 1);
  e->model = g_object_ref (self);
  e->what = SIGNAL_PHASE_CHANGED;
  e->phase = phase;
  emit_on_owner (e);
}

/* ------------------------------------------------------------------ */
/* The experts map                                                     */

static gboolean
is_valid_backend (const char *name)
{
  g_auto(GStrv) found = NULL;

  if (g_strv_contains (known_backends, name))
    return TRUE;
  found = moe_plugin_registry_list_backends (moe_plugin_registry_get_default ());
  return g_strv_contains ((const char * const *) found, name);
}

static void
set_invalid_backend (GError **error, const char *name)
{
  g_auto(GStrv) found = moe_plugin_registry_list_backends (moe_plugin_registry_get_default ());
  GString *valid = g_string_new (NULL);

  for (guint i = 0; known_backends[i]; i++)
    g_string_append_printf (valid, "%s%s", i ? ", " : "", known_backends[i]);
  for (guint i = 0; found[i]; i++)
    if (!g_strv_contains (known_backends, found[i]))
      g_string_append_printf (valid, ", %s", found[i]);
  g_set_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND,
               "Experts implementation “%s” is not supported; valid names: %s", name, valid->str);
  g_string_free (valid, TRUE);
}

/* Points the experts objects at the map's backend; called by the running
 * thread at each step boundary, under the lock. */
static void
sync_experts_locked (MoeModel *self)
{
  GPtrArray *experts = _moe_transformer_get_experts (self->transformer);
  const char *name = g_hash_table_lookup (self->impl, _moe_transformer_get_experts_key (self->transformer));

  for (guint i = 0; i < experts->len; i++)
    moe_experts_set_implementation (experts->pdata[i], name);
}

/* Applies @requested (key -> name; keys not in the model are ignored) after
 * validating every entry, then emits one signal per changed key. */
static gboolean
apply_map (MoeModel *self, GHashTable *requested, GError **error)
{
  g_autoptr(GPtrArray) changes = g_ptr_array_new_with_free_func (g_free);

  moe_mutex_lock (&self->lock);
  for (guint i = 0; i < self->keys->len; i++)
    {
      const char *key = self->keys->pdata[i];
      const char *want = g_hash_table_lookup (requested, key);
      const char *have = g_hash_table_lookup (self->impl, key);

      if (want == NULL || g_str_equal (want, have))
        continue;
      if (!is_valid_backend (want))
        {
          moe_mutex_unlock (&self->lock);
          set_invalid_backend (error, want);
          return FALSE;
        }
      if (g_str_equal (want, MEGAMOE) || g_str_equal (have, MEGAMOE))
        {
          moe_mutex_unlock (&self->lock);
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                       "Cannot switch the experts implementation of “%s” from %s to %s after loading: "
                       "deepgemm_megamoe is a load-time choice (it repacks the weights once); "
                       "reload the model with moe_model_new_from_pretrained()",
                       key, have, want);
          return FALSE;
        }
    }
  for (guint i = 0; i < self->keys->len; i++)
    {
      const char *key = self->keys->pdata[i];
      const char *want = g_hash_table_lookup (requested, key);
      const char *have = g_hash_table_lookup (self->impl, key);

      if (want == NULL || g_str_equal (want, have))
        continue;
      g_ptr_array_add (changes, g_strdup (key));
      g_ptr_array_add (changes, g_strdup (have));
      g_ptr_array_add (changes, g_strdup (want));
      g_hash_table_insert (self->impl, g_strdup (key), g_strdup (want));
    }
  moe_mutex_unlock (&self->lock);

  for (guint i = 0; i < changes->len; i += 3)
    emit_changed (self, changes->pdata[i], changes->pdata[i + 1], changes->pdata[i + 2]);
  return TRUE;
}

/**
 * moe_model_set_experts_implementation:
 * @self: a model
 * @name: a backend name, applied to the model and every sub-config
 * @error: return location for a #GError
 *
 * Returns: %TRUE on success; %FALSE with %MOE_ERROR_UNKNOWN_BACKEND for a
 *   name that is not a valid experts implementation (the message lists the
 *   valid ones), or %MOE_ERROR_INVALID_ARGUMENT when switching into or out
 *   of `deepgemm_megamoe`
 */
gboolean
moe_model_set_experts_implementation (MoeModel    *self,
                                      const char  *name,
                                      GError     **error)
{
  g_autoptr(GHashTable) map = g_hash_table_new (g_str_hash, g_str_equal);

  g_return_val_if_fail (MOE_IS_MODEL (self), FALSE);
  g_return_val_if_fail (name != NULL, FALSE);

  for (guint i = 0; i < self->keys->len; i++)
    g_hash_table_insert (map, self->keys->pdata[i], (gpointer) name);
  return apply_map (self, map, error);
}

/**
 * moe_model_set_experts_implementation_map:
 * @self: a model
 * @map: (element-type utf8 utf8): `""` → the top-level model's backend,
 *   sub-config name → that sub-config's backend; keys the model does not
 *   have are ignored, as transformers ignores them
 * @error: return location for a #GError
 *
 * Changes several entries at once: all or none.
 *
 * Returns: %TRUE on success
 */
gboolean
moe_model_set_experts_implementation_map (MoeModel    *self,
                                          GHashTable  *map,
                                          GError     **error)
{
  g_return_val_if_fail (MOE_IS_MODEL (self), FALSE);
  g_return_val_if_fail (map != NULL, FALSE);
  return apply_map (self, map, error);
}

/**
 * moe_model_set_experts_implementation_for:
 * @self: a model
 * @key: `""` or a sub-config name
 * @name: a backend name
 * @error: return location for a #GError
 *
 * Returns: %TRUE on success; %FALSE with %MOE_ERROR_NOT_FOUND for a key the
 *   model does not have
 */
gboolean
moe_model_set_experts_implementation_for (MoeModel    *self,
                                          const char  *key,
                                          const char  *name,
                                          GError     **error)
{
  g_autoptr(GHashTable) map = g_hash_table_new (g_str_hash, g_str_equal);

  g_return_val_if_fail (MOE_IS_MODEL (self), FALSE);
  g_return_val_if_fail (key != NULL && name != NULL, FALSE);

  if (!g_hash_table_contains (self->impl, key))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND,
                   "The model has no sub-config “%s”", key);
      return FALSE;
    }
  g_hash_table_insert (map, (gpointer) key, (gpointer) name);
  return apply_map (self, map, error);
}

/**
 * moe_model_get_experts_implementation:
 * @self: a model
 *
 * Returns what is running now: inside a decode step with the decode switch
 * active, the switched entries read `batched_mm`.
 *
 * Returns: (transfer full) (element-type utf8 utf8): `{"": …, "text_config": …}`
 */
GHashTable *
moe_model_get_experts_implementation (MoeModel *self)
{
  GHashTable *out;

  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);

  out = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, g_free);
  moe_mutex_lock (&self->lock);
  for (guint i = 0; i < self->keys->len; i++)
    g_hash_table_insert (out, g_strdup (self->keys->pdata[i]),
                         g_strdup (g_hash_table_lookup (self->impl, self->keys->pdata[i])));
  moe_mutex_unlock (&self->lock);
  return out;
}

/**
 * moe_model_dup_experts_implementation_for:
 * @self: a model
 * @key: `""` or a sub-config name
 *
 * Returns: (transfer full) (nullable): the entry's backend name, or %NULL
 *   if the model has no such key
 */
char *
moe_model_dup_experts_implementation_for (MoeModel   *self,
                                          const char *key)
{
  char *out;

  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);
  moe_mutex_lock (&self->lock);
  out = g_strdup (g_hash_table_lookup (self->impl, key));
  moe_mutex_unlock (&self->lock);
  return out;
}

/**
 * moe_model_dup_experts_implementation_name:
 * @self: a model
 *
 * Returns: (transfer full): the `""` entry, the value of
 *   [property@Model:experts-implementation]
 */
char *
moe_model_dup_experts_implementation_name (MoeModel *self)
{
  return moe_model_dup_experts_implementation_for (self, "");
}

/* ------------------------------------------------------------------ */
/* GObject                                                             */

static void
moe_model_finalize (GObject *object)
{
  MoeModel *self = MOE_MODEL (object);

  _moe_transformer_free (self->transformer);
  g_clear_object (&self->checkpoint);
  g_clear_object (&self->config);
  g_clear_object (&self->generation_config);
  g_free (self->path);
  g_free (self->device);
  g_ptr_array_unref (self->keys);
  g_hash_table_unref (self->impl);
  g_main_context_unref (self->owner_context);
  g_mutex_clear (&self->lock);
  g_mutex_clear (&self->run_lock);

  G_OBJECT_CLASS (moe_model_parent_class)->finalize (object);
}

static void
moe_model_get_property (GObject *object, guint prop_id, GValue *value, GParamSpec *pspec)
{
  MoeModel *self = MOE_MODEL (object);

  switch (prop_id)
    {
    case PROP_EXPERTS_IMPLEMENTATION: g_value_take_string (value, moe_model_dup_experts_implementation_name (self)); break;
    case PROP_DEVICE: g_value_set_string (value, self->device); break;
    case PROP_DTYPE: g_value_set_string (value, moe_model_get_dtype (self)); break;
    case PROP_CONFIG: g_value_set_object (value, self->config); break;
    case PROP_GENERATION_CONFIG: g_value_set_object (value, self->generation_config); break;
    case PROP_DECODE_SWITCH: g_value_set_enum (value, moe_model_get_decode_switch (self)); break;
    case PROP_PHASE: g_value_set_enum (value, moe_model_get_phase (self)); break;
    default: G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_model_set_property (GObject *object, guint prop_id, const GValue *value, GParamSpec *pspec)
{
  MoeModel *self = MOE_MODEL (object);
  g_autoptr(GError) error = NULL;

  switch (prop_id)
    {
    case PROP_EXPERTS_IMPLEMENTATION:
      if (!moe_model_set_experts_implementation_for (self, "", g_value_get_string (value), &error))
        g_warning ("%s", error->message);
      break;
    case PROP_DECODE_SWITCH:
      moe_model_set_decode_switch (self, g_value_get_enum (value));
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_model_class_init (MoeModelClass *klass)
{
  GObjectClass *object_class = G_OBJECT_CLASS (klass);
  const GParamFlags ro = G_PARAM_READABLE | G_PARAM_STATIC_STRINGS;

  object_class->finalize = moe_model_finalize;
  object_class->get_property = moe_model_get_property;
  object_class->set_property = moe_model_set_property;

  /**
   * MoeModel:experts-implementation:
   *
   * The top-level (`""`) entry of the experts map. Setting an invalid name
   * warns and changes nothing; use [method@Model.set_experts_implementation_for]
   * to get a #GError instead. Sub-config entries are reached with
   * [method@Model.dup_experts_implementation_for] and watched through the
   * detailed [signal@Model::experts-implementation-changed].
   */
  properties[PROP_EXPERTS_IMPLEMENTATION] =
    g_param_spec_string ("experts-implementation", NULL, NULL, "grouped_mm",
                         G_PARAM_READWRITE | G_PARAM_EXPLICIT_NOTIFY | G_PARAM_STATIC_STRINGS);
  /**
   * MoeModel:device: (getter get_device)
   *
   * The device the model runs on.
   */
  properties[PROP_DEVICE] = g_param_spec_string ("device", NULL, NULL, "cpu", ro);
  /**
   * MoeModel:dtype: (getter get_dtype)
   *
   * The dtype weights are held and activations rounded to: "float32",
   * "bfloat16" or "float16".
   */
  properties[PROP_DTYPE] = g_param_spec_string ("dtype", NULL, NULL, "float32", ro);
  /**
   * MoeModel:config: (getter get_config)
   *
   * The parsed `config.json`.
   */
  properties[PROP_CONFIG] = g_param_spec_object ("config", NULL, NULL, MOE_TYPE_CONFIG, ro);
  /**
   * MoeModel:generation-config: (getter get_generation_config)
   *
   * The checkpoint's `generation_config.json` (defaults if it has none):
   * what [method@Model.generate] uses when given no config.
   */
  properties[PROP_GENERATION_CONFIG] =
    g_param_spec_object ("generation-config", NULL, NULL, MOE_TYPE_GENERATION_CONFIG, ro);
  /**
   * MoeModel:decode-switch: (getter get_decode_switch) (setter set_decode_switch)
   *
   * When generation runs `grouped_mm` entries as `batched_mm` for the
   * decode steps.
   */
  properties[PROP_DECODE_SWITCH] =
    g_param_spec_enum ("decode-switch", NULL, NULL, MOE_TYPE_DECODE_SWITCH, MOE_DECODE_SWITCH_AUTO,
                       G_PARAM_READWRITE | G_PARAM_EXPLICIT_NOTIFY | G_PARAM_STATIC_STRINGS);
  /**
   * MoeModel:phase: (getter get_phase)
   *
   * Where a running generation is.
   */
  properties[PROP_PHASE] = g_param_spec_enum ("phase", NULL, NULL, MOE_TYPE_PHASE, MOE_PHASE_IDLE, ro);
  g_object_class_install_properties (object_class, N_PROPS, properties);

  /**
   * MoeModel::experts-implementation-changed:
   * @model: the model
   * @key: `""` or the sub-config name whose entry changed (also the detail)
   * @old_name: the previous backend
   * @new_name: the new backend
   *
   * Emitted for every change of the experts map: by the setters, and by
   * the decode switch when a generation's decode loop begins and ends.
   * Connect to `experts-implementation-changed::text_config` to watch one key.
   */
  signals[SIGNAL_EXPERTS_IMPLEMENTATION_CHANGED] =
    g_signal_new ("experts-implementation-changed", G_TYPE_FROM_CLASS (klass),
                  G_SIGNAL_RUN_LAST | G_SIGNAL_DETAILED, 0, NULL, NULL, NULL,
                  G_TYPE_NONE, 3, G_TYPE_STRING, G_TYPE_STRING, G_TYPE_STRING);
  /**
   * MoeModel::phase-changed:
   * @model: the model
   * @phase: the new phase
   *
   * Emitted as a generation moves from prefill to decode to idle.
   */
  signals[SIGNAL_PHASE_CHANGED] =
    g_signal_new ("phase-changed", G_TYPE_FROM_CLASS (klass), G_SIGNAL_RUN_LAST, 0, NULL, NULL, NULL,
                  G_TYPE_NONE, 1, MOE_TYPE_PHASE);
}

static void
moe_model_init (MoeModel *self)
{
  g_mutex_init (&self->lock);
  g_mutex_init (&self->run_lock);
  self->keys = g_ptr_array_new_with_free_func (g_free);
  self->impl = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, g_free);
  self->owner_thread = g_thread_self ();
  self->owner_context = g_main_context_ref_thread_default ();
}

/* ------------------------------------------------------------------ */
/* Loading                                                             */

static gboolean
resolve_dtype (const char *requested, MoeConfig *config, MoeCheckpoint *ck, MoeDType *dtype, GError **error)
{
  if (requested == NULL || g_str_equal (requested, "auto"))
    {
      /* the checkpoint's own dtype, as the embeddings hold it */
      g_auto(GStrv) names = moe_checkpoint_list_tensors (ck);
      for (guint i = 0; names[i]; i++)
        if (g_str_has_suffix (names[i], "embed_tokens.weight"))
          return moe_checkpoint_get_tensor_info (ck, names[i], dtype, NULL, error);
      *dtype = MOE_DTYPE_F32;
      return TRUE;
    }
  if (!moe_dtype_from_name (requested, dtype) ||
      (*dtype != MOE_DTYPE_F32 && *dtype != MOE_DTYPE_BF16 && *dtype != MOE_DTYPE_F16))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "Unknown dtype “%s”; valid: auto, float32, bfloat16, float16", requested);
      return FALSE;
    }
  return TRUE;
}

static MoeModel *
load (const char *path, MoeLoadOptions *options, GCancellable *cancellable, GError **error)
{
  g_autoptr(MoeModel) self = NULL;
  g_autoptr(MoeLoadOptions) defaults = NULL;
  g_autoptr(GHashTable) map = NULL;
  g_autofree char *config_path = NULL, *gen_path = NULL;
  g_auto(GStrv) subs = NULL;
  const char *device, *single;
  MoeDevice *dev;

  if (options == NULL)
    options = defaults = moe_load_options_new ();

  self = g_object_new (MOE_TYPE_MODEL, NULL);
  self->path = g_strdup (path);
  self->decode_switch = moe_load_options_get_decode_switch (options);

  device = moe_load_options_get_device (options);
  dev = moe_device_get_for_name (device, error);
  if (dev == NULL)
    return NULL;
  self->device = g_strdup (device);

  if (!g_file_test (path, G_FILE_TEST_IS_DIR))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND, "%s is not a checkpoint directory", path);
      return NULL;
    }
  config_path = g_build_filename (path, "config.json", NULL);
  if (!_moe_checkpoint_check_file (path, "config.json", error) ||
      !_moe_checkpoint_check_file (path, "generation_config.json", error))
    return NULL;
  self->config = moe_config_new_from_file (config_path, error);
  if (self->config == NULL)
    return NULL;
  gen_path = g_build_filename (path, "generation_config.json", NULL);
  self->generation_config = g_file_test (gen_path, G_FILE_TEST_EXISTS)
    ? moe_generation_config_new_from_file (gen_path, error)
    : moe_generation_config_new ();
  if (self->generation_config == NULL)
    return NULL;

  /* the experts map: "" and every sub-config, validated before any weight is read */
  g_ptr_array_add (self->keys, g_strdup (""));
  subs = moe_config_list_sub_configs (self->config);
  for (guint i = 0; subs[i]; i++)
    g_ptr_array_add (self->keys, g_strdup (subs[i]));
  single = moe_load_options_get_experts_implementation (options);
  map = moe_load_options_dup_experts_implementation_map (options);
  for (guint i = 0; i < self->keys->len; i++)
    {
      const char *key = self->keys->pdata[i];
      const char *name = g_hash_table_lookup (map, key);
      if (name == NULL)
        name = single ? single : "grouped_mm";
      if (!is_valid_backend (name))
        {
          set_invalid_backend (error, name);
          return NULL;
        }
      g_hash_table_insert (self->impl, g_strdup (key), g_strdup (name));
    }

  if (!(self->checkpoint = moe_checkpoint_open (path, error)) ||
      !resolve_dtype (moe_load_options_get_dtype (options), self->config, self->checkpoint, &self->dtype, error))
    return NULL;
  if (g_cancellable_set_error_if_cancelled (cancellable, error))
    return NULL;
  self->transformer = _moe_transformer_new (self->config, self->checkpoint, self->dtype,
                                            moe_load_options_get_dequantize (options), dev, cancellable, error);
  if (self->transformer == NULL)
    return NULL;

  moe_mutex_lock (&self->lock);
  sync_experts_locked (self);
  moe_mutex_unlock (&self->lock);
  return g_steal_pointer (&self);
}

/**
 * moe_model_new_from_pretrained:
 * @path: a checkpoint directory
 * @options: (nullable): how to load it; %NULL for the defaults
 * @cancellable: (nullable): a #GCancellable
 * @error: return location for a #GError
 *
 * Loads a model. Weights whose dtype is the model's are memory-mapped, not
 * copied; per-expert checkpoint keys are fused as transformers does.
 *
 * Returns: (transfer full): the model, or %NULL with @error set: an
 *   unknown `model_type`, a missing or ill-typed config key, a tensor the
 *   config does not agree with, an invalid experts implementation…
 */
MoeModel *
moe_model_new_from_pretrained (const char      *path,
                               MoeLoadOptions  *options,
                               GCancellable    *cancellable,
                               GError         **error)
{
  g_return_val_if_fail (path != NULL, NULL);
  g_return_val_if_fail (options == NULL || MOE_IS_LOAD_OPTIONS (options), NULL);
  return load (path, options, cancellable, error);
}

typedef struct {
  char           *path;
  MoeLoadOptions *options;
  GMainContext   *context;
} LoadData;

static void
load_data_free (gpointer p)
{
  LoadData *d = p;

  g_free (d->path);
  g_clear_object (&d->options);
  g_main_context_unref (d->context);
  g_free (d);
}

static void
load_thread (GTask *task, gpointer source, gpointer task_data, GCancellable *cancellable)
{
  LoadData *d = task_data;
  GError *error = NULL;
  MoeModel *model;

  moe_handoff_acquire (d);
  /* the model belongs to the caller's context, not to this worker */
  model = load (d->path, d->options, cancellable, &error);
  if (model == NULL)
    {
      g_task_return_error (task, error);
      return;
    }
  g_main_context_unref (model->owner_context);
  model->owner_context = g_main_context_ref (d->context);
  model->owner_thread = NULL;
  moe_handoff_release (task);
  g_task_return_pointer (task, model, g_object_unref);
}

/**
 * moe_model_new_from_pretrained_async:
 * @path: a checkpoint directory
 * @options: (nullable): how to load it
 * @cancellable: (nullable): a #GCancellable
 * @callback: (scope async): called when the model is loaded
 * @user_data: data for @callback
 *
 * Loads a model in a worker thread, so the caller's main loop keeps running.
 */
void
moe_model_new_from_pretrained_async (const char          *path,
                                     MoeLoadOptions      *options,
                                     GCancellable        *cancellable,
                                     GAsyncReadyCallback  callback,
                                     gpointer             user_data)
{
  g_autoptr(GTask) task = NULL;
  LoadData *d;

  g_return_if_fail (path != NULL);

  task = g_task_new (NULL, cancellable, callback, user_data);
  g_task_set_source_tag (task, moe_model_new_from_pretrained_async);
  d = g_new0 (LoadData, 1);
  d->path = g_strdup (path);
  d->options = options ? g_object_ref (options) : NULL;
  d->context = g_main_context_ref_thread_default ();
  g_task_set_task_data (task, d, load_data_free);
  moe_handoff_release (d);
  g_task_run_in_thread (task, load_thread);
}

/**
 * moe_model_new_from_pretrained_finish:
 * @result: the result passed to the callback
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the model, or %NULL with @error set
 */
MoeModel *
moe_model_new_from_pretrained_finish (GAsyncResult  *result,
                                      GError       **error)
{
  MoeModel *model;

  g_return_val_if_fail (g_task_is_valid (result, NULL), NULL);
  g_return_val_if_fail (g_task_get_source_tag (G_TASK (result)) == moe_model_new_from_pretrained_async, NULL);
  moe_handoff_acquire (result);
  model = g_task_propagate_pointer (G_TASK (result), error);
  /* _finish runs on the caller's thread: it owns the model from now on */
  if (model != NULL)
    model->owner_thread = g_thread_self ();
  return model;
}

/* ------------------------------------------------------------------ */
/* Forward                                                             */

typedef struct {
  guint   B, T;
  gint64 *ids;        /* [B, T] */
  guint8 *mask;       /* [B, T] */
} Batch;

static void
batch_clear (Batch *b)
{
  g_free (b->ids);
  g_free (b->mask);
}

static gboolean
read_int_tensor (MoeTensor *t, const char *what, guint B, guint T, gint64 *out, GError **error)
{
  g_autoptr(GBytes) bytes = NULL;
  MoeDType d = moe_tensor_get_dtype (t);
  gconstpointer p;
  gsize n = (gsize) B * T;

  if (moe_tensor_get_n_dims (t) != 2 || moe_tensor_get_dim (t, 0) != B || moe_tensor_get_dim (t, 1) != T)
    {
      g_autofree char *s = moe_tensor_to_string (t);
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH, "%s is %s; expected [%u, %u]", what, s, B, T);
      return FALSE;
    }
  bytes = moe_tensor_dup_bytes (t, error);
  if (bytes == NULL)
    return FALSE;
  p = g_bytes_get_data (bytes, NULL);
  for (gsize i = 0; i < n; i++)
    switch (d)
      {
      case MOE_DTYPE_I64: out[i] = ((const gint64 *) p)[i]; break;
      case MOE_DTYPE_I32: out[i] = ((const gint32 *) p)[i]; break;
      case MOE_DTYPE_U8:
      case MOE_DTYPE_BOOL: out[i] = ((const guint8 *) p)[i]; break;
      default:
        g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                     "%s is %s; expected I64 or I32%s", what, moe_dtype_get_name (d),
                     g_str_equal (what, "attention_mask") ? " (or BOOL, U8)" : "");
        return FALSE;
      }
  return TRUE;
}

static gboolean
batch_init (Batch *b, MoeTensor *input_ids, MoeTensor *attention_mask, GError **error)
{
  g_autofree gint64 *mask = NULL;

  memset (b, 0, sizeof *b);
  if (moe_tensor_get_n_dims (input_ids) != 2 || moe_tensor_get_dim (input_ids, 0) < 1 ||
      moe_tensor_get_dim (input_ids, 1) < 1 || moe_tensor_get_n_elements (input_ids) > G_MAXINT32)
    {
      g_autofree char *s = moe_tensor_to_string (input_ids);
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "input_ids is %s; expected [batch, tokens] with both at least 1", s);
      return FALSE;
    }
  b->B = moe_tensor_get_dim (input_ids, 0);
  b->T = moe_tensor_get_dim (input_ids, 1);
  b->ids = g_new (gint64, (gsize) b->B * b->T);
  b->mask = g_new (guint8, (gsize) b->B * b->T);
  if (!read_int_tensor (input_ids, "input_ids", b->B, b->T, b->ids, error))
    return FALSE;
  if (attention_mask == NULL)
    {
      memset (b->mask, 1, (gsize) b->B * b->T);
      return TRUE;
    }
  mask = g_new (gint64, (gsize) b->B * b->T);
  if (!read_int_tensor (attention_mask, "attention_mask", b->B, b->T, mask, error))
    return FALSE;
  for (gsize i = 0; i < (gsize) b->B * b->T; i++)
    {
      if (mask[i] != 0 && mask[i] != 1)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                       "attention_mask holds %" G_GINT64_FORMAT "; it must be 0 or 1", mask[i]);
          return FALSE;
        }
      b->mask[i] = (guint8) mask[i];
    }
  return TRUE;
}

/* transformers' generate(): positions count only the attended tokens
 * (left padding gets position 1, which it never attends from). */
static void
prefill_positions (const Batch *b, gint64 *positions, gint64 *next)
{
  for (guint i = 0; i < b->B; i++)
    {
      gint64 seen = 0;
      for (guint t = 0; t < b->T; t++)
        {
          gsize r = (gsize) i * b->T + t;
          seen += b->mask[r];
          positions[r] = b->mask[r] ? seen - 1 : 1;
        }
      next[i] = seen;
    }
}

static MoeTensor *
forward_locked (MoeModel *self, const Batch *b, GError **error)
{
  gint64 V = _moe_transformer_get_vocab_size (self->transformer);
  gint64 shape[3] = { b->B, b->T, V };
  g_autofree gint64 *positions = g_new (gint64, (gsize) b->B * b->T);
  g_autofree gint64 *next = g_new (gint64, b->B);
  g_autoptr(MoeTensor) logits = moe_tensor_new_empty (NULL, MOE_DTYPE_F32, shape, 3, error);
  MoeKvCache *cache;
  gboolean ok;

  if (logits == NULL)
    return NULL;
  prefill_positions (b, positions, next);
  moe_mutex_lock (&self->lock);
  sync_experts_locked (self);
  moe_mutex_unlock (&self->lock);

  cache = _moe_kv_cache_new (self->transformer, b->B);
  ok = _moe_transformer_forward (self->transformer, cache, b->ids, b->B, b->T, positions, b->mask, FALSE,
                                 moe_tensor_get_mutable_data (logits), NULL, NULL, error);
  _moe_kv_cache_free (cache);
  return ok ? g_steal_pointer (&logits) : NULL;
}

/**
 * moe_model_forward_with_mask:
 * @self: a model
 * @input_ids: `[B, T]` token ids (I64 or I32)
 * @attention_mask: (nullable): `[B, T]`, 1 for real tokens and 0 for
 *   (left) padding; %NULL when nothing is padded
 * @error: return location for a #GError
 *
 * Runs the model over whole sequences. Positions count only the tokens the
 * mask keeps, as transformers' generate() computes them.
 *
 * Returns: (transfer full): logits `[B, T, vocab]` (F32)
 */
MoeTensor *
moe_model_forward_with_mask (MoeModel   *self,
                             MoeTensor  *input_ids,
                             MoeTensor  *attention_mask,
                             GError    **error)
{
  Batch b;
  MoeTensor *out = NULL;

  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);
  g_return_val_if_fail (MOE_IS_TENSOR (input_ids), NULL);

  if (batch_init (&b, input_ids, attention_mask, error))
    {
      moe_mutex_lock (&self->run_lock);
      out = forward_locked (self, &b, error);
      moe_mutex_unlock (&self->run_lock);
    }
  batch_clear (&b);
  return out;
}

/**
 * moe_model_forward:
 * @self: a model
 * @input_ids: `[B, T]` token ids (I64 or I32)
 * @error: return location for a #GError
 *
 * Returns: (transfer full): logits `[B, T, vocab]` (F32)
 */
MoeTensor *
moe_model_forward (MoeModel   *self,
                   MoeTensor  *input_ids,
                   GError    **error)
{
  return moe_model_forward_with_mask (self, input_ids, NULL, error);
}

/* ------------------------------------------------------------------ */
/* Generation                                                          */

/* Where a generation's per-step tokens go. Shared by the generation and
 * every queued callback, and freed — with the caller's data — after the
 * last of them has run, wherever that happens. */
typedef struct {
  gatomicrefcount   ref;
  MoeModel         *model;
  GMainContext     *context;    /* where token callbacks run */
  MoeTokenCallback  callback;
  gpointer          data;
  GDestroyNotify    destroy;
} TokenSink;

static TokenSink *
token_sink_ref (TokenSink *sink)
{
  g_atomic_ref_count_inc (&sink->ref);
  return sink;
}

static gboolean
token_sink_destroy (gpointer p)
{
  TokenSink *sink = p;

  moe_handoff_acquire (sink);

  if (sink->destroy != NULL)
    sink->destroy (sink->data);
  g_object_unref (sink->model);
  g_main_context_unref (sink->context);
  g_free (sink);
  return G_SOURCE_REMOVE;
}

/* The caller's data is released on the caller's context (bindings such as
 * GJS cannot free their closures from a worker thread). */
static void
token_sink_unref (TokenSink *sink)
{
  moe_handoff_release (sink);
  if (!g_atomic_ref_count_dec (&sink->ref))
    return;
  moe_handoff_acquire (sink);
  if (g_main_context_is_owner (sink->context))
    token_sink_destroy (sink);
  else
    run_on_context (sink->context, token_sink_destroy, sink, NULL);
}

typedef struct {
  TokenSink *sink;
  MoeTensor *tokens;
} TokenCall;

static gboolean
token_call_run (gpointer p)
{
  TokenCall *c = p;

  moe_handoff_acquire (c);

  c->sink->callback (c->sink->model, c->tokens, c->sink->data);
  return G_SOURCE_REMOVE;
}

static void
token_call_free (gpointer p)
{
  TokenCall *c = p;

  moe_handoff_acquire (c);

  g_object_unref (c->tokens);
  token_sink_unref (c->sink);
  g_free (c);
}

static MoeTensor *
generate_locked (MoeModel            *self,
                 const Batch         *b,
                 MoeGenerationConfig *config,
                 TokenSink           *sink,
                 GCancellable        *cancellable,
                 GError             **error)
{
  MoeTransformer *tf = self->transformer;
  gint64 V = _moe_transformer_get_vocab_size (tf);
  guint max_new, n_eos, done_steps = 0, L;
  const gint64 *eos;
  gint64 pad;
  guint64 seed;
  gboolean do_sample;
  g_autofree gint64 *positions = g_new (gint64, (gsize) b->B * b->T);
  g_autofree gint64 *next_pos = g_new (gint64, b->B);
  g_autofree float *logits = g_new (float, (gsize) b->B * V);
  g_autofree gint64 *tokens = g_new (gint64, b->B);
  g_autofree double *draws = NULL;
  MoeSampling sampling = { 0, };
  g_autofree gboolean *finished = g_new0 (gboolean, b->B);
  g_autoptr(GArray) out = g_array_new (FALSE, FALSE, sizeof (gint64));   /* [steps][B] */
  g_autofree guint8 *valid = NULL;
  g_autoptr(GHashTable) original = NULL;
  g_autoptr(GRand) rng = NULL;
  gboolean switched = FALSE, ok = TRUE;
  MoeKvCache *cache;
  MoeDecodeSwitch policy;

  g_object_get (config, "max-new-tokens", &max_new, "seed", &seed, "pad-token-id", &pad, "do-sample", &do_sample,
                NULL);
  /* the model picks the tokens where the logits are (a GPU sends back B
   * ids, not B·V floats), sampling with the draws taken here */
  if (do_sample)
    {
      g_object_get (config, "temperature", &sampling.temperature, "top-k", &sampling.top_k, "top-p", &sampling.top_p,
                    NULL);
      sampling.draws = draws = g_new (double, b->B);
    }
  eos = moe_generation_config_get_eos_token_ids (config, &n_eos);
  if (pad < 0)
    pad = n_eos > 0 ? eos[0] : 0;
  {
    guint32 words[2] = { (guint32) seed, (guint32) (seed >> 32) };
    rng = g_rand_new_with_seed_array (words, 2);
  }

  L = b->T + max_new;
  valid = g_new0 (guint8, (gsize) b->B * L);
  for (guint i = 0; i < b->B; i++)
    memcpy (valid + (gsize) i * L, b->mask + (gsize) i * b->T, b->T);
  prefill_positions (b, positions, next_pos);

  cache = _moe_kv_cache_new (tf, b->B);
  policy = moe_model_get_decode_switch (self);
  set_phase (self, MOE_PHASE_PREFILL);

  for (guint step = 0; step < max_new; step++)
    {
      g_autofree guint8 *key_valid = NULL;
      g_autofree gint64 *ids = NULL;
      g_autofree gint64 *pos = NULL;
      guint T = step == 0 ? b->T : 1;
      guint len = b->T + step;
      gboolean all_done = TRUE;

      if (g_cancellable_set_error_if_cancelled (cancellable, error))
        {
          ok = FALSE;
          break;
        }

      /* the decode switch: grouped_mm entries run batched_mm from here on
       * (from the first step its policy says: never back, as a step's rows
       * only shrink after the prompt) */
      if (!switched)
        {
          gboolean now;
          if (policy == MOE_DECODE_SWITCH_BY_TOKENS)
            now = (guint64) b->B * T * _moe_transformer_get_top_k (tf) <= _moe_transformer_get_num_experts (tf);
          else
            now = step == 1 && (policy == MOE_DECODE_SWITCH_ALWAYS ||
                                (policy == MOE_DECODE_SWITCH_AUTO && !g_str_equal (self->device, "cpu")));
          if (now)
            {
              g_autoptr(GHashTable) decode = g_hash_table_new (g_str_hash, g_str_equal);
              GHashTableIter iter;
              gpointer k, v;
              g_clear_pointer (&original, g_hash_table_unref);
              original = moe_model_get_experts_implementation (self);
              g_hash_table_iter_init (&iter, original);
              while (g_hash_table_iter_next (&iter, &k, &v))
                if (g_str_equal (v, "grouped_mm"))
                  {
                    g_hash_table_insert (decode, k, (gpointer) "batched_mm");
                    switched = TRUE;
                  }
              if (switched && !apply_map (self, decode, error))
                {
                  switched = FALSE;
                  ok = FALSE;
                  break;
                }
            }
        }
      if (step == 1)
        set_phase (self, MOE_PHASE_DECODE);

      /* the attention validity of every cached position, [B, len] */
      key_valid = g_new (guint8, (gsize) b->B * len);
      for (guint i = 0; i < b->B; i++)
        memcpy (key_valid + (gsize) i * len, valid + (gsize) i * L, len);

      if (step == 0)
        {
          ids = g_memdup2 (b->ids, (gsize) b->B * b->T * sizeof (gint64));
          pos = g_memdup2 (positions, (gsize) b->B * b->T * sizeof (gint64));
        }
      else
        {
          ids = g_new (gint64, b->B);
          pos = g_new (gint64, b->B);
          for (guint i = 0; i < b->B; i++)
            {
              ids[i] = g_array_index (out, gint64, (gsize) (step - 1) * b->B + i);
              pos[i] = next_pos[i]++;
            }
        }

      moe_mutex_lock (&self->lock);
      sync_experts_locked (self);
      moe_mutex_unlock (&self->lock);
      if (draws != NULL)
        _moe_sample_draws (rng, b->B, finished, draws);
      if (!_moe_transformer_forward (tf, cache, ids, b->B, T, pos, key_valid, TRUE, logits,
                                     draws != NULL ? &sampling : NULL, tokens, error))
        {
          ok = FALSE;
          break;
        }

      for (guint i = 0; i < b->B; i++)
        {
          gint64 tok = finished[i] ? pad : tokens[i];
          g_array_append_val (out, tok);
          for (guint e = 0; e < n_eos && !finished[i]; e++)
            finished[i] = tok == eos[e];
          all_done &= finished[i];
          valid[(gsize) i * L + b->T + step] = 1;
        }
      done_steps++;

      if (sink != NULL && sink->callback != NULL)
        {
          gint64 shape[1] = { b->B };
          TokenCall *c = g_new0 (TokenCall, 1);
          g_autoptr(GBytes) step_bytes = g_bytes_new ((const gint64 *) out->data + (gsize) step * b->B,
                                                      b->B * sizeof (gint64));
          c->sink = token_sink_ref (sink);
          c->tokens = moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 1, step_bytes, NULL);
          run_on_context (sink->context, token_call_run, c, token_call_free);
        }
      if (all_done)
        break;

    }

  /* restored whatever happened; an entry changed by someone else during
   * the generation keeps their value */
  if (switched)
    {
      g_autoptr(GHashTable) now = moe_model_get_experts_implementation (self);
      g_autoptr(GHashTable) back = g_hash_table_new (g_str_hash, g_str_equal);
      GHashTableIter iter;
      gpointer k, v;
      g_hash_table_iter_init (&iter, original);
      while (g_hash_table_iter_next (&iter, &k, &v))
        if (g_str_equal (v, "grouped_mm") && g_strcmp0 (g_hash_table_lookup (now, k), "batched_mm") == 0)
          g_hash_table_insert (back, k, v);
      apply_map (self, back, NULL);
    }
  _moe_kv_cache_free (cache);
  set_phase (self, MOE_PHASE_IDLE);

  if (!ok)
    return NULL;

  {
    gint64 shape[2] = { b->B, b->T + done_steps };
    MoeTensor *result = moe_tensor_new_empty (NULL, MOE_DTYPE_I64, shape, 2, error);
    gint64 *dst;
    if (result == NULL)
      return NULL;
    dst = moe_tensor_get_mutable_data (result);
    for (guint i = 0; i < b->B; i++)
      {
        memcpy (dst + (gsize) i * shape[1], b->ids + (gsize) i * b->T, b->T * sizeof (gint64));
        for (guint s = 0; s < done_steps; s++)
          dst[(gsize) i * shape[1] + b->T + s] = g_array_index (out, gint64, (gsize) s * b->B + i);
      }
    return result;
  }
}

static MoeTensor *
generate (MoeModel *self, MoeTensor *input_ids, MoeTensor *attention_mask, MoeGenerationConfig *config,
          TokenSink *sink, GCancellable *cancellable, GError **error)
{
  Batch b;
  MoeTensor *out = NULL;

  if (batch_init (&b, input_ids, attention_mask, error))
    {
      moe_mutex_lock (&self->run_lock);
      out = generate_locked (self, &b, config ? config : self->generation_config, sink, cancellable, error);
      moe_mutex_unlock (&self->run_lock);
    }
  batch_clear (&b);
  return out;
}

/**
 * moe_model_generate_with_mask:
 * @self: a model
 * @input_ids: `[B, T]` prompts (I64 or I32), left-padded when of unequal length
 * @attention_mask: (nullable): `[B, T]`, 0 on the padding
 * @config: (nullable): how to generate; %NULL for the checkpoint's
 *   [property@Model:generation-config]
 * @cancellable: (nullable): stops the generation between steps
 * @error: return location for a #GError
 *
 * Generates with a KV cache: one prefill pass over the prompts, then one
 * step per new token, until every sequence has produced an end token or
 * `max-new-tokens` were made. Finished sequences are padded with
 * `pad-token-id`. Emits [signal@Model::phase-changed] and runs the decode
 * switch described above.
 *
 * Returns: (transfer full): `[B, T + new]` token ids (I64)
 */
MoeTensor *
moe_model_generate_with_mask (MoeModel            *self,
                              MoeTensor           *input_ids,
                              MoeTensor           *attention_mask,
                              MoeGenerationConfig *config,
                              GCancellable        *cancellable,
                              GError             **error)
{
  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);
  g_return_val_if_fail (MOE_IS_TENSOR (input_ids), NULL);
  g_return_val_if_fail (config == NULL || MOE_IS_GENERATION_CONFIG (config), NULL);
  return generate (self, input_ids, attention_mask, config, NULL, cancellable, error);
}

/**
 * moe_model_generate:
 * @self: a model
 * @input_ids: `[B, T]` prompts (I64 or I32), all of the same length
 * @config: (nullable): how to generate; %NULL for the checkpoint's defaults
 * @cancellable: (nullable): stops the generation between steps
 * @error: return location for a #GError
 *
 * Returns: (transfer full): `[B, T + new]` token ids (I64)
 */
MoeTensor *
moe_model_generate (MoeModel            *self,
                    MoeTensor           *input_ids,
                    MoeGenerationConfig *config,
                    GCancellable        *cancellable,
                    GError             **error)
{
  return moe_model_generate_with_mask (self, input_ids, NULL, config, cancellable, error);
}

typedef struct {
  MoeTensor           *input_ids;
  MoeTensor           *attention_mask;
  MoeGenerationConfig *config;
  TokenSink           *sink;
} GenerateData;

static void
generate_data_free (gpointer p)
{
  GenerateData *d = p;

  g_clear_object (&d->input_ids);
  g_clear_object (&d->attention_mask);
  g_clear_object (&d->config);
  token_sink_unref (d->sink);
  g_free (d);
}

static void
generate_thread (GTask *task, gpointer source, gpointer task_data, GCancellable *cancellable)
{
  GenerateData *d = task_data;
  GError *error = NULL;
  MoeTensor *out;

  moe_handoff_acquire (d);
  out = generate (MOE_MODEL (source), d->input_ids, d->attention_mask, d->config, d->sink, cancellable, &error);
  moe_handoff_release (task);
  if (out == NULL)
    g_task_return_error (task, error);
  else
    g_task_return_pointer (task, out, g_object_unref);
}

/**
 * moe_model_generate_async:
 * @self: a model
 * @input_ids: `[B, T]` prompts
 * @attention_mask: (nullable): `[B, T]`, 0 on the padding
 * @config: (nullable): how to generate
 * @token_callback: (nullable) (scope notified) (closure token_data) (destroy token_destroy):
 *   called with each step's `[B]` new tokens, on the caller's main context
 * @token_data: data for @token_callback
 * @token_destroy: (nullable): frees @token_data when the generation is over
 * @cancellable: (nullable): stops the generation between steps; the model
 *   stays usable and its experts map is restored
 * @callback: (scope async): called when the generation is over
 * @user_data: data for @callback
 *
 * Generates in a worker thread; the caller's main loop keeps running while
 * tokens stream in through @token_callback.
 */
void
moe_model_generate_async (MoeModel            *self,
                          MoeTensor           *input_ids,
                          MoeTensor           *attention_mask,
                          MoeGenerationConfig *config,
                          MoeTokenCallback     token_callback,
                          gpointer             token_data,
                          GDestroyNotify       token_destroy,
                          GCancellable        *cancellable,
                          GAsyncReadyCallback  callback,
                          gpointer             user_data)
{
  g_autoptr(GTask) task = NULL;
  GenerateData *d;

  g_return_if_fail (MOE_IS_MODEL (self));
  g_return_if_fail (MOE_IS_TENSOR (input_ids));

  task = g_task_new (self, cancellable, callback, user_data);
  g_task_set_source_tag (task, moe_model_generate_async);
  d = g_new0 (GenerateData, 1);
  d->input_ids = g_object_ref (input_ids);
  d->attention_mask = attention_mask ? g_object_ref (attention_mask) : NULL;
  d->config = config ? moe_generation_config_copy (config) : NULL;
  d->sink = g_new0 (TokenSink, 1);
  g_atomic_ref_count_init (&d->sink->ref);
  d->sink->model = g_object_ref (self);
  d->sink->context = g_main_context_ref_thread_default ();
  d->sink->callback = token_callback;
  d->sink->data = token_data;
  d->sink->destroy = token_destroy;
  g_task_set_task_data (task, d, generate_data_free);
  moe_handoff_release (d);
  g_task_run_in_thread (task, generate_thread);
}

/**
 * moe_model_generate_finish:
 * @self: a model
 * @result: the result passed to the callback
 * @error: return location for a #GError
 *
 * Returns: (transfer full): `[B, T + new]` token ids, or %NULL with @error
 *   set (%G_IO_ERROR_CANCELLED when cancelled)
 */
MoeTensor *
moe_model_generate_finish (MoeModel      *self,
                           GAsyncResult  *result,
                           GError       **error)
{
  g_return_val_if_fail (g_task_is_valid (result, self), NULL);
  moe_handoff_acquire (result);
  return g_task_propagate_pointer (G_TASK (result), error);
}

/* ------------------------------------------------------------------ */
/* Accessors                                                           */

/**
 * moe_model_get_config:
 * @self: a model
 *
 * Returns: (transfer none): the parsed `config.json`
 */
MoeConfig *
moe_model_get_config (MoeModel *self)
{
  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);
  return self->config;
}

/**
 * moe_model_get_generation_config:
 * @self: a model
 *
 * Returns: (transfer none): the checkpoint's generation defaults
 */
MoeGenerationConfig *
moe_model_get_generation_config (MoeModel *self)
{
  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);
  return self->generation_config;
}

/**
 * moe_model_get_device:
 * @self: a model
 *
 * Returns: the device name
 */
const char *
moe_model_get_device (MoeModel *self)
{
  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);
  return self->device;
}

/**
 * moe_model_get_dtype:
 * @self: a model
 *
 * Returns: "float32", "bfloat16" or "float16"
 */
const char *
moe_model_get_dtype (MoeModel *self)
{
  g_return_val_if_fail (MOE_IS_MODEL (self), NULL);
  switch (self->dtype)
    {
    case MOE_DTYPE_BF16: return "bfloat16";
    case MOE_DTYPE_F16: return "float16";
    default: return "float32";
    }
}

/**
 * moe_model_get_vocab_size:
 * @self: a model
 *
 * Returns: the vocabulary size, the last dimension of the logits
 */
gint64
moe_model_get_vocab_size (MoeModel *self)
{
  g_return_val_if_fail (MOE_IS_MODEL (self), 0);
  return _moe_transformer_get_vocab_size (self->transformer);
}

/**
 * moe_model_get_decode_switch:
 * @self: a model
 *
 * Returns: the decode-switch policy
 */
MoeDecodeSwitch
moe_model_get_decode_switch (MoeModel *self)
{
  MoeDecodeSwitch p;

  g_return_val_if_fail (MOE_IS_MODEL (self), MOE_DECODE_SWITCH_AUTO);
  moe_mutex_lock (&self->lock);
  p = self->decode_switch;
  moe_mutex_unlock (&self->lock);
  return p;
}

/**
 * moe_model_set_decode_switch:
 * @self: a model
 * @policy: the decode-switch policy, used from the next generation on
 */
void
moe_model_set_decode_switch (MoeModel        *self,
                             MoeDecodeSwitch  policy)
{
  gboolean changed;

  g_return_if_fail (MOE_IS_MODEL (self));
  moe_mutex_lock (&self->lock);
  changed = self->decode_switch != policy;
  self->decode_switch = policy;
  moe_mutex_unlock (&self->lock);
  if (changed)
    g_object_notify_by_pspec (G_OBJECT (self), properties[PROP_DECODE_SWITCH]);
}

/**
 * moe_model_get_phase:
 * @self: a model
 *
 * Returns: where a running generation is
 */
MoePhase
moe_model_get_phase (MoeModel *self)
{
  MoePhase p;

  g_return_val_if_fail (MOE_IS_MODEL (self), MOE_PHASE_IDLE);
  moe_mutex_lock (&self->lock);
  p = self->phase;
  moe_mutex_unlock (&self->lock);
  return p;
}
