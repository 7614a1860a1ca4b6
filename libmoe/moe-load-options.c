/* moe-load-options.c: how moe_model_new_from_pretrained() loads a model
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include "moe-private.h"

/**
 * MoeLoadOptions:
 *
 * Options for [ctor@Model.new_from_pretrained], as transformers'
 * `from_pretrained` keyword arguments:
 *
 * |[<!-- language="Python" -->
 * opts = Moe.LoadOptions(dtype="float32", device="cpu", experts_implementation="grouped_mm")
 * opts.set_experts_implementation_map({"": "eager", "text_config": "grouped_mm"})
 * ]|
 *
 * A map entry overrides `experts-implementation` for its key; `""` is the
 * top-level model, other keys are sub-config names.
 */
struct _MoeLoadOptions
{
  GObject          parent_instance;

  char            *dtype;
  char            *device;
  char            *experts_implementation;
  GHashTable      *map;
  MoeDecodeSwitch  decode_switch;
  gboolean         dequantize;
};

enum {
  PROP_0,
  PROP_DTYPE,
  PROP_DEVICE,
  PROP_EXPERTS_IMPLEMENTATION,
  PROP_DECODE_SWITCH,
  PROP_DEQUANTIZE,
  N_PROPS
};

static GParamSpec *properties[N_PROPS];

G_DEFINE_FINAL_TYPE (MoeLoadOptions, moe_load_options, G_TYPE_OBJECT)

static void
moe_load_options_finalize (GObject *object)
{
  MoeLoadOptions *self = MOE_LOAD_OPTIONS (object);

  g_free (self->dtype);
  g_free (self->device);
  g_free (self->experts_implementation);
  g_clear_pointer (&self->map, g_hash_table_unref);
  G_OBJECT_CLASS (moe_load_options_parent_class)->finalize (object);
}

static void
moe_load_options_get_property (GObject *object, guint prop_id, GValue *value, GParamSpec *pspec)
{
  MoeLoadOptions *self = MOE_LOAD_OPTIONS (object);

  switch (prop_id)
    {
    case PROP_DTYPE: g_value_set_string (value, self->dtype); break;
    case PROP_DEVICE: g_value_set_string (value, self->device); break;
    case PROP_EXPERTS_IMPLEMENTATION: g_value_set_string (value, self->experts_implementation); break;
    case PROP_DECODE_SWITCH: g_value_set_enum (value, self->decode_switch); break;
    case PROP_DEQUANTIZE: g_value_set_boolean (value, self->dequantize); break;
    default: G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_load_options_set_property (GObject *object, guint prop_id, const GValue *value, GParamSpec *pspec)
{
  MoeLoadOptions *self = MOE_LOAD_OPTIONS (object);

  switch (prop_id)
    {
    case PROP_DTYPE: moe_load_options_set_dtype (self, g_value_get_string (value)); break;
    case PROP_DEVICE: moe_load_options_set_device (self, g_value_get_string (value)); break;
    case PROP_EXPERTS_IMPLEMENTATION: moe_load_options_set_experts_implementation (self, g_value_get_string (value)); break;
    case PROP_DECODE_SWITCH: moe_load_options_set_decode_switch (self, g_value_get_enum (value)); break;
    case PROP_DEQUANTIZE: moe_load_options_set_dequantize (self, g_value_get_boolean (value)); break;
    default: G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_load_options_class_init (MoeLoadOptionsClass *klass)
{
  GObjectClass *object_class = G_OBJECT_CLASS (klass);
  const GParamFlags rw = G_PARAM_READWRITE | G_PARAM_EXPLICIT_NOTIFY | G_PARAM_STATIC_STRINGS;

  object_class->finalize = moe_load_options_finalize;
  object_class->get_property = moe_load_options_get_property;
  object_class->set_property = moe_load_options_set_property;

  /**
   * MoeLoadOptions:dtype: (getter get_dtype) (setter set_dtype)
   *
   * "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
   */
  properties[PROP_DTYPE] = g_param_spec_string ("dtype", NULL, NULL, "auto", rw);
  /**
   * MoeLoadOptions:device: (getter get_device) (setter set_device)
   *
   * The device to run on: "cpu", or one a device plugin provides.
   */
  properties[PROP_DEVICE] = g_param_spec_string ("device", NULL, NULL, "cpu", rw);
  /**
   * MoeLoadOptions:experts-implementation: (getter get_experts_implementation) (setter set_experts_implementation)
   *
   * One experts backend for the model and every sub-config; %NULL for the
   * default, "grouped_mm".
   */
  properties[PROP_EXPERTS_IMPLEMENTATION] = g_param_spec_string ("experts-implementation", NULL, NULL, NULL, rw);
  /**
   * MoeLoadOptions:decode-switch: (getter get_decode_switch) (setter set_decode_switch)
   *
   * The model's initial [property@Model:decode-switch].
   */
  properties[PROP_DECODE_SWITCH] =
    g_param_spec_enum ("decode-switch", NULL, NULL, MOE_TYPE_DECODE_SWITCH, MOE_DECODE_SWITCH_AUTO, rw);
  /**
   * MoeLoadOptions:dequantize: (getter get_dequantize) (setter set_dequantize)
   *
   * For FP8/FP4 checkpoints (transformers' `FineGrainedFP8Config(dequantize=True)`):
   * multiply every quantized weight out to the model's dtype at load, so
   * that the model runs unquantized (activations included) on any backend.
   */
  properties[PROP_DEQUANTIZE] =
    g_param_spec_boolean ("dequantize", NULL, NULL, FALSE, rw);
  g_object_class_install_properties (object_class, N_PROPS, properties);
}

static void
moe_load_options_init (MoeLoadOptions *self)
{
  self->dtype = g_strdup ("auto");
  self->device = g_strdup ("cpu");
  self->map = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, g_free);
}

/**
 * moe_load_options_new:
 *
 * Returns: (transfer full): options with the defaults: dtype "auto", device
 *   "cpu", experts implementation "grouped_mm"
 */
MoeLoadOptions *
moe_load_options_new (void)
{
  return g_object_new (MOE_TYPE_LOAD_OPTIONS, NULL);
}

static void
set_string (MoeLoadOptions *self, char **field, const char *value, GParamSpec *pspec)
{
  if (g_strcmp0 (*field, value) == 0)
    return;
  g_free (*field);
  *field = g_strdup (value);
  g_object_notify_by_pspec (G_OBJECT (self), pspec);
}

/**
 * moe_load_options_get_dtype:
 * @self: options
 *
 * Returns: the dtype name
 */
const char *
moe_load_options_get_dtype (MoeLoadOptions *self)
{
  g_return_val_if_fail (MOE_IS_LOAD_OPTIONS (self), NULL);
  return self->dtype;
}

/**
 * moe_load_options_set_dtype:
 * @self: options
 * @dtype: (nullable): "auto", "float32", "bfloat16" or "float16"; %NULL for "auto"
 */
void
moe_load_options_set_dtype (MoeLoadOptions *self, const char *dtype)
{
  g_return_if_fail (MOE_IS_LOAD_OPTIONS (self));
  set_string (self, &self->dtype, dtype ? dtype : "auto", properties[PROP_DTYPE]);
}

/**
 * moe_load_options_get_device:
 * @self: options
 *
 * Returns: the device name
 */
const char *
moe_load_options_get_device (MoeLoadOptions *self)
{
  g_return_val_if_fail (MOE_IS_LOAD_OPTIONS (self), NULL);
  return self->device;
}

/**
 * moe_load_options_set_device:
 * @self: options
 * @device: (nullable): a device name; %NULL for "cpu"
 */
void
moe_load_options_set_device (MoeLoadOptions *self, const char *device)
{
  g_return_if_fail (MOE_IS_LOAD_OPTIONS (self));
  set_string (self, &self->device, device ? device : "cpu", properties[PROP_DEVICE]);
}

/**
 * moe_load_options_get_experts_implementation:
 * @self: options
 *
 * Returns: (nullable): the experts backend for every sub-config
 */
const char *
moe_load_options_get_experts_implementation (MoeLoadOptions *self)
{
  g_return_val_if_fail (MOE_IS_LOAD_OPTIONS (self), NULL);
  return self->experts_implementation;
}

/**
 * moe_load_options_set_experts_implementation:
 * @self: options
 * @name: (nullable): a backend name, or %NULL for the default
 */
void
moe_load_options_set_experts_implementation (MoeLoadOptions *self, const char *name)
{
  g_return_if_fail (MOE_IS_LOAD_OPTIONS (self));
  set_string (self, &self->experts_implementation, name, properties[PROP_EXPERTS_IMPLEMENTATION]);
}

/**
 * moe_load_options_dup_experts_implementation_map:
 * @self: options
 *
 * Returns: (transfer full) (element-type utf8 utf8): the per-sub-config map
 */
GHashTable *
moe_load_options_dup_experts_implementation_map (MoeLoadOptions *self)
{
  GHashTable *copy;
  GHashTableIter iter;
  gpointer k, v;

  g_return_val_if_fail (MOE_IS_LOAD_OPTIONS (self), NULL);
  copy = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, g_free);
  g_hash_table_iter_init (&iter, self->map);
  while (g_hash_table_iter_next (&iter, &k, &v))
    g_hash_table_insert (copy, g_strdup (k), g_strdup (v));
  return copy;
}

/**
 * moe_load_options_set_experts_implementation_map:
 * @self: options
 * @map: (element-type utf8 utf8) (nullable): `""` → backend for the top
 *   level, sub-config name → backend for that sub-config; %NULL clears it
 */
void
moe_load_options_set_experts_implementation_map (MoeLoadOptions *self, GHashTable *map)
{
  GHashTableIter iter;
  gpointer k, v;

  g_return_if_fail (MOE_IS_LOAD_OPTIONS (self));
  g_hash_table_remove_all (self->map);
  if (map == NULL)
    return;
  g_hash_table_iter_init (&iter, map);
  while (g_hash_table_iter_next (&iter, &k, &v))
    if (k != NULL && v != NULL)
      g_hash_table_insert (self->map, g_strdup (k), g_strdup (v));
}

/**
 * moe_load_options_get_decode_switch:
 * @self: options
 *
 * Returns: the decode-switch policy
 */
MoeDecodeSwitch
moe_load_options_get_decode_switch (MoeLoadOptions *self)
{
  g_return_val_if_fail (MOE_IS_LOAD_OPTIONS (self), MOE_DECODE_SWITCH_AUTO);
  return self->decode_switch;
}

/**
 * moe_load_options_set_decode_switch:
 * @self: options
 * @policy: the decode-switch policy
 */
void
moe_load_options_set_decode_switch (MoeLoadOptions *self, MoeDecodeSwitch policy)
{
  g_return_if_fail (MOE_IS_LOAD_OPTIONS (self));
  if (self->decode_switch == policy)
    return;
  self->decode_switch = policy;
  g_object_notify_by_pspec (G_OBJECT (self), properties[PROP_DECODE_SWITCH]);
}

/**
 * moe_load_options_get_dequantize:
 * @self: options
 *
 * Returns: whether quantized weights are dequantized at load
 */
gboolean
moe_load_options_get_dequantize (MoeLoadOptions *self)
{
  g_return_val_if_fail (MOE_IS_LOAD_OPTIONS (self), FALSE);
  return self->dequantize;
}

/**
 * moe_load_options_set_dequantize:
 * @self: options
 * @dequantize: whether to dequantize quantized weights at load
 */
void
moe_load_options_set_dequantize (MoeLoadOptions *self,
                                 gboolean        dequantize)
{
  g_return_if_fail (MOE_IS_LOAD_OPTIONS (self));
  dequantize = !!dequantize;
  if (self->dequantize == dequantize)
    return;
  self->dequantize = dequantize;
  g_object_notify_by_pspec (G_OBJECT (self), properties[PROP_DEQUANTIZE]);
}
