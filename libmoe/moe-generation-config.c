/* moe-generation-config.c: what moe_model_generate() does
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>

#include <json-glib/json-glib.h>

#include "moe-private.h"

/**
 * MoeGenerationConfig:
 *
 * How [method@Model.generate] picks tokens and when it stops, as
 * transformers' `GenerationConfig`:
 *
 * |[<!-- language="Python" -->
 * cfg = Moe.GenerationConfig(max_new_tokens=12, do_sample=False)
 * ]|
 *
 * Greedy decoding unless `do-sample`; sampling applies `temperature`, then
 * `top-k`, then `top-p`, and draws one number a sequence and step from a
 * generator seeded with `seed`, walked over the kept tokens' probabilities
 * in id order (as `torch.multinomial` over transformers' masked ones): the
 * same seed gives the same tokens on the CPU and on a GPU, up to the
 * rounding of their logits.
 */
struct _MoeGenerationConfig
{
  GObject   parent_instance;

  guint     max_new_tokens;
  gboolean  do_sample;
  double    temperature;
  guint     top_k;
  double    top_p;
  guint64   seed;
  gint64    pad_token_id;
  GArray   *eos;
};

enum {
  PROP_0,
  PROP_MAX_NEW_TOKENS,
  PROP_DO_SAMPLE,
  PROP_TEMPERATURE,
  PROP_TOP_K,
  PROP_TOP_P,
  PROP_SEED,
  PROP_PAD_TOKEN_ID,
  N_PROPS
};

static GParamSpec *properties[N_PROPS];

G_DEFINE_FINAL_TYPE (MoeGenerationConfig, moe_generation_config, G_TYPE_OBJECT)

static void
moe_generation_config_finalize (GObject *object)
{
  MoeGenerationConfig *self = MOE_GENERATION_CONFIG (object);

  g_array_unref (self->eos);
  G_OBJECT_CLASS (moe_generation_config_parent_class)->finalize (object);
}

static void
moe_generation_config_get_property (GObject *object, guint prop_id, GValue *value, GParamSpec *pspec)
{
  MoeGenerationConfig *self = MOE_GENERATION_CONFIG (object);

  switch (prop_id)
    {
    case PROP_MAX_NEW_TOKENS: g_value_set_uint (value, self->max_new_tokens); break;
    case PROP_DO_SAMPLE: g_value_set_boolean (value, self->do_sample); break;
    case PROP_TEMPERATURE: g_value_set_double (value, self->temperature); break;
    case PROP_TOP_K: g_value_set_uint (value, self->top_k); break;
    case PROP_TOP_P: g_value_set_double (value, self->top_p); break;
    case PROP_SEED: g_value_set_uint64 (value, self->seed); break;
    case PROP_PAD_TOKEN_ID: g_value_set_int64 (value, self->pad_token_id); break;
    default: G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_generation_config_set_property (GObject *object, guint prop_id, const GValue *value, GParamSpec *pspec)
{
  MoeGenerationConfig *self = MOE_GENERATION_CONFIG (object);

  switch (prop_id)
    {
    case PROP_MAX_NEW_TOKENS: self->max_new_tokens = g_value_get_uint (value); break;
    case PROP_DO_SAMPLE: self->do_sample = g_value_get_boolean (value); break;
    case PROP_TEMPERATURE: self->temperature = g_value_get_double (value); break;
    case PROP_TOP_K: self->top_k = g_value_get_uint (value); break;
    case PROP_TOP_P: self->top_p = g_value_get_double (value); break;
    case PROP_SEED: self->seed = g_value_get_uint64 (value); break;
    case PROP_PAD_TOKEN_ID: self->pad_token_id = g_value_get_int64 (value); break;
    default: G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_generation_config_class_init (MoeGenerationConfigClass *klass)
{
  GObjectClass *object_class = G_OBJECT_CLASS (klass);
  const GParamFlags rw = G_PARAM_READWRITE | G_PARAM_STATIC_STRINGS;

  object_class->finalize = moe_generation_config_finalize;
  object_class->get_property = moe_generation_config_get_property;
  object_class->set_property = moe_generation_config_set_property;

  /**
   * MoeGenerationConfig:max-new-tokens:
   *
   * The most tokens to generate per sequence.
   */
  properties[PROP_MAX_NEW_TOKENS] = g_param_spec_uint ("max-new-tokens", NULL, NULL, 0, G_MAXUINT, 20, rw);
  /**
   * MoeGenerationConfig:do-sample:
   *
   * %TRUE to sample; %FALSE for greedy decoding.
   */
  properties[PROP_DO_SAMPLE] = g_param_spec_boolean ("do-sample", NULL, NULL, FALSE, rw);
  /**
   * MoeGenerationConfig:temperature:
   *
   * Divides the logits before sampling.
   */
  properties[PROP_TEMPERATURE] = g_param_spec_double ("temperature", NULL, NULL, 1e-6, 1e6, 1.0, rw);
  /**
   * MoeGenerationConfig:top-k:
   *
   * Sample among the k most likely tokens only; 0 for all.
   */
  properties[PROP_TOP_K] = g_param_spec_uint ("top-k", NULL, NULL, 0, G_MAXUINT, 50, rw);
  /**
   * MoeGenerationConfig:top-p:
   *
   * Sample among the smallest set of tokens whose probability reaches p.
   */
  properties[PROP_TOP_P] = g_param_spec_double ("top-p", NULL, NULL, 0.0, 1.0, 1.0, rw);
  /**
   * MoeGenerationConfig:seed:
   *
   * Seeds the sampler, so a sampled generation can be repeated.
   */
  properties[PROP_SEED] = g_param_spec_uint64 ("seed", NULL, NULL, 0, G_MAXUINT64, 0, rw);
  /**
   * MoeGenerationConfig:pad-token-id:
   *
   * The token finished sequences are filled with; -1 uses the first end token.
   */
  properties[PROP_PAD_TOKEN_ID] = g_param_spec_int64 ("pad-token-id", NULL, NULL, -1, G_MAXINT64, -1, rw);
  g_object_class_install_properties (object_class, N_PROPS, properties);
}

static void
moe_generation_config_init (MoeGenerationConfig *self)
{
  self->max_new_tokens = 20;
  self->temperature = 1.0;
  self->top_k = 50;
  self->top_p = 1.0;
  self->pad_token_id = -1;
  self->eos = g_array_new (FALSE, FALSE, sizeof (gint64));
}

/**
 * moe_generation_config_new:
 *
 * Returns: (transfer full): a config with transformers' defaults: greedy,
 *   20 new tokens, no end token
 */
MoeGenerationConfig *
moe_generation_config_new (void)
{
  return g_object_new (MOE_TYPE_GENERATION_CONFIG, NULL);
}

static gboolean
read_token_ids (JsonNode *node, GArray *out)
{
  if (node == NULL || JSON_NODE_HOLDS_NULL (node))
    return TRUE;
  if (JSON_NODE_HOLDS_VALUE (node) && json_node_get_value_type (node) == G_TYPE_INT64)
    {
      gint64 v = json_node_get_int (node);
      g_array_append_val (out, v);
      return TRUE;
    }
  if (JSON_NODE_HOLDS_ARRAY (node))
    {
      JsonArray *a = json_node_get_array (node);
      for (guint i = 0; i < json_array_get_length (a); i++)
        {
          JsonNode *e = json_array_get_element (a, i);
          gint64 v;
          if (!JSON_NODE_HOLDS_VALUE (e) || json_node_get_value_type (e) != G_TYPE_INT64)
            return FALSE;
          v = json_node_get_int (e);
          g_array_append_val (out, v);
        }
      return TRUE;
    }
  return FALSE;
}

/**
 * moe_generation_config_new_from_file:
 * @path: a `generation_config.json`
 * @error: return location for a #GError
 *
 * Reads the keys transformers uses: `max_new_tokens`, `do_sample`,
 * `temperature`, `top_k`, `top_p`, `eos_token_id` (a number or a list),
 * `pad_token_id`. Other keys are ignored.
 *
 * Returns: (transfer full): the config, or %NULL with @error set
 */
MoeGenerationConfig *
moe_generation_config_new_from_file (const char  *path,
                                     GError     **error)
{
  g_autoptr(MoeConfig) json = moe_config_new_from_file (path, error);
  g_autoptr(MoeGenerationConfig) self = NULL;
  g_autoptr(GError) local = NULL;
  JsonObject *obj;
  gint64 pad;

  if (json == NULL)
    return NULL;
  self = moe_generation_config_new ();
  {
    /* read each once, then clamp into the properties' ranges */
    gint64 max_new = 20, top_k = 50;
    double temperature = 1.0, top_p = 1.0;

    max_new = moe_config_get_int_or (json, "max_new_tokens", 20, &local);
    if (local == NULL)
      self->do_sample = moe_config_get_boolean_or (json, "do_sample", FALSE, &local);
    if (local == NULL)
      temperature = moe_config_get_double_or (json, "temperature", 1.0, &local);
    if (local == NULL)
      top_k = moe_config_get_int_or (json, "top_k", 50, &local);
    if (local == NULL)
      top_p = moe_config_get_double_or (json, "top_p", 1.0, &local);
    if (local == NULL)
      pad = moe_config_get_int_or (json, "pad_token_id", -1, &local);
    if (local != NULL)
      {
        g_set_error (error, MOE_ERROR, local->code, "%s: %s", path, local->message);
        return NULL;
      }
    self->max_new_tokens = (guint) CLAMP (max_new, 0, G_MAXUINT);
    self->temperature = isnan (temperature) ? 1.0 : CLAMP (temperature, 1e-6, 1e6);
    self->top_k = (guint) CLAMP (top_k, 0, G_MAXUINT);
    self->top_p = isnan (top_p) ? 1.0 : CLAMP (top_p, 0.0, 1.0);
  }
  self->pad_token_id = MAX (pad, -1);

  obj = _moe_config_get_json_object (json);
  if (!read_token_ids (json_object_get_member (obj, "eos_token_id"), self->eos))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                   "%s: eos_token_id must be an integer or a list of integers", path);
      return NULL;
    }
  return g_steal_pointer (&self);
}

/**
 * moe_generation_config_copy:
 * @self: a config
 *
 * Returns: (transfer full): an independent copy
 */
MoeGenerationConfig *
moe_generation_config_copy (MoeGenerationConfig *self)
{
  MoeGenerationConfig *copy;

  g_return_val_if_fail (MOE_IS_GENERATION_CONFIG (self), NULL);
  copy = g_object_new (MOE_TYPE_GENERATION_CONFIG,
                       "max-new-tokens", self->max_new_tokens,
                       "do-sample", self->do_sample,
                       "temperature", self->temperature,
                       "top-k", self->top_k,
                       "top-p", self->top_p,
                       "seed", self->seed,
                       "pad-token-id", self->pad_token_id,
                       NULL);
  g_array_append_vals (copy->eos, self->eos->data, self->eos->len);
  return copy;
}

/**
 * moe_generation_config_get_eos_token_ids:
 * @self: a config
 * @n_ids: (out): how many
 *
 * Returns: (array length=n_ids) (transfer none): the tokens that end a sequence
 */
const gint64 *
moe_generation_config_get_eos_token_ids (MoeGenerationConfig *self,
                                         guint               *n_ids)
{
  g_return_val_if_fail (MOE_IS_GENERATION_CONFIG (self), NULL);
  *n_ids = self->eos->len;
  return (const gint64 *) self->eos->data;
}

/**
 * moe_generation_config_set_eos_token_ids:
 * @self: a config
 * @ids: (array length=n_ids) (nullable): the tokens that end a sequence
 * @n_ids: how many
 */
void
moe_generation_config_set_eos_token_ids (MoeGenerationConfig *self,
                                         const gint64        *ids,
                                         guint                n_ids)
{
  g_return_if_fail (MOE_IS_GENERATION_CONFIG (self));
  g_array_set_size (self->eos, 0);
  if (ids != NULL)
    g_array_append_vals (self->eos, ids, n_ids);
}
