/* moe-transformer.c: the decoder stack behind MoeModel, on the CPU
 *
 * One code path for every supported family; what differs between them is
 * data read from config.json into the structures below (how attention is
 * projected and normalised, how RoPE is laid out, how the router picks
 * experts, whether a shared expert is added). Activations are float32;
 * weights stay in the model dtype and are read in place. In a bf16 or f16
 * model every op's output is rounded to that dtype, as torch computes it.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>
#include <string.h>
#include <json-glib/json-glib.h>

#include "moe-transformer-private.h"
#include "moe-cpu-kernels.h"

static const struct { const char *model_type; Family family; } families[] = {
  { "qwen2_moe", FAMILY_QWEN2_MOE },
  { "qwen3_moe", FAMILY_QWEN3_MOE },
  { "qwen3_vl_moe", FAMILY_QWEN3_VL_MOE },
  { "mixtral", FAMILY_MIXTRAL },
  { "olmoe", FAMILY_OLMOE },
  { "deepseek_v3", FAMILY_DEEPSEEK_V3 },
  { "gpt_oss", FAMILY_GPT_OSS },
};

/* ------------------------------------------------------------------ */
/* Loading                                                             */

typedef struct {
  MoeCheckpoint *ck;
  MoeDType       dtype;
  const char    *prefix;    /* "model." or "model.language_model." */
  GError       **error;
  gboolean       quantized;   /* config.json has a quantization_config */
  gboolean       dequantize;  /* multiply quantized weights out at load */
  MoeDevice     *device;      /* where the experts go (the rest stays on the host for the device to copy) */
} Loader;

static MoeTensor *
load_tensor (Loader *l, const char *name, gboolean required, guint n_dims, const gint64 *shape)
{
  g_autoptr(MoeTensor) t = NULL;
  MoeTensor *out;

  if (*l->error != NULL)
    return NULL;
  if (!moe_checkpoint_has_tensor (l->ck, name))
    {
      if (required)
        g_set_error (l->error, MOE_ERROR, MOE_ERROR_NOT_FOUND,
                     "%s: the checkpoint has no tensor “%s”", moe_checkpoint_get_path (l->ck), name);
      return NULL;
    }
  t = moe_checkpoint_get_tensor (l->ck, name, l->error);
  if (t == NULL)
    return NULL;
  if (shape != NULL && !moe_tensor_has_shape (t, shape, n_dims))
    {
      g_autofree char *have = moe_tensor_to_string (t);
      GString *want = g_string_new (NULL);
      for (guint i = 0; i < n_dims; i++)
        g_string_append_printf (want, "%s%" G_GINT64_FORMAT, i ? ", " : "", shape[i]);
      g_set_error (l->error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "%s: tensor “%s” is %s, but the config implies [%s]",
                   moe_checkpoint_get_path (l->ck), name, have, want->str);
      g_string_free (want, TRUE);
      return NULL;
    }
  if (!moe_dtype_is_float (moe_tensor_get_dtype (t)))
    {
      g_set_error (l->error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "%s: tensor “%s” is %s; quantized checkpoints are not supported yet",
                   moe_checkpoint_get_path (l->ck), name, moe_dtype_get_name (moe_tensor_get_dtype (t)));
      return NULL;
    }
  /* same dtype: the tensor stays a view of the mapped file */
  out = moe_tensor_to_dtype (t, l->dtype, l->error);
  return out;
}

static float *
load_f32 (Loader *l, const char *name, gboolean required, gint64 size)
{
  g_autoptr(MoeTensor) t = load_tensor (l, name, required, 1, &size);
  return t ? moe_cpu_tensor_dup_f32 (t) : NULL;
}

/* A quantized linear's weight [out, in] (FP8) or [out, in/2] (FP4) and its
 * weight_scale_inv [⌈out/128⌉, ⌈in/128⌉] or [out, in/32]. */
static void
load_quantized_linear (Loader *l, Linear *lin, const char *name, MoeTensor *w, gint64 out, gint64 in)
{
  g_autofree char *scale_name = g_strdup_printf ("%s.weight_scale_inv", name);
  gboolean fp4 = moe_tensor_get_dtype (w) == MOE_DTYPE_I8;
  gint64 ws[2] = { out, fp4 ? in / 2 : in };
  gint64 ss[2] = { fp4 ? out : (out + 127) / 128, fp4 ? in / 32 : (in + 127) / 128 };
  g_autoptr(MoeTensor) scale = NULL;
  MoeDType sd;

  if (!l->quantized)
    {
      g_set_error (l->error, MOE_ERROR, MOE_ERROR_INVALID_CHECKPOINT,
                   "%s: “%s.weight” is %s but config.json has no quantization_config",
                   moe_checkpoint_get_path (l->ck), name, moe_dtype_get_name (moe_tensor_get_dtype (w)));
      return;
    }
  if ((fp4 && in % 32 != 0) || !moe_tensor_has_shape (w, ws, 2))
    {
      g_autofree char *have = moe_tensor_to_string (w);
      g_set_error (l->error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "%s: tensor “%s.weight” is %s, but the config implies [%" G_GINT64_FORMAT ", %" G_GINT64_FORMAT "]%s",
                   moe_checkpoint_get_path (l->ck), name, have, ws[0], ws[1],
                   fp4 ? " (FP4: two values per byte, inputs a multiple of 32)" : "");
      return;
    }
  if (!moe_checkpoint_has_tensor (l->ck, scale_name))
    {
      g_set_error (l->error, MOE_ERROR, MOE_ERROR_NOT_FOUND, "%s: quantized “%s.weight” has no “%s”",
                   moe_checkpoint_get_path (l->ck), name, scale_name);
      return;
    }
  scale = moe_checkpoint_get_tensor (l->ck, scale_name, l->error);
  if (scale == NULL)
    return;
  sd = moe_tensor_get_dtype (scale);
  if (!moe_tensor_has_shape (scale, ss, 2) || (sd != MOE_DTYPE_F32 && sd != MOE_DTYPE_E8M0) ||
      (fp4 && sd != MOE_DTYPE_E8M0))
    {
      g_autofree char *have = moe_tensor_to_string (scale);
      g_set_error (l->error, MOE_ERROR, MOE_ERROR_INVALID_CHECKPOINT,
                   "%s: “%s” is %s; expected %s[%" G_GINT64_FORMAT ", %" G_GINT64_FORMAT "] (%s)",
                   moe_checkpoint_get_path (l->ck), scale_name, have, fp4 ? "F8_E8M0" : "F32 or F8_E8M0",
                   ss[0], ss[1], fp4 ? "one scale per row and 32 inputs" : "one scale per 128×128 block");
      return;
    }
  if (l->dequantize)
    lin->weight = _moe_dequantize (w, scale, 0, l->dtype, l->error);
  else
    {
      lin->weight = g_object_ref (w);
      lin->scale = g_steal_pointer (&scale);
    }
}

static void
load_linear (Loader *l, Linear *lin, const char *name, gint64 out, gint64 in, gboolean bias)
{
  g_autofree char *w = g_strdup_printf ("%s.weight", name);
  g_autofree char *b = g_strdup_printf ("%s.bias", name);
  gint64 shape[2] = { out, in };

  if (*l->error == NULL && moe_checkpoint_has_tensor (l->ck, w))
    {
      MoeDType d;
      if (!moe_checkpoint_get_tensor_info (l->ck, w, &d, NULL, l->error))
        return;
      if (_moe_dtype_is_quantized_weight (d))
        {
          g_autoptr(MoeTensor) q = moe_checkpoint_get_tensor (l->ck, w, l->error);
          if (q != NULL)
            load_quantized_linear (l, lin, name, q, out, in);
          if (bias)
            lin->bias = load_tensor (l, b, TRUE, 1, &out);
          return;
        }
    }
  lin->weight = load_tensor (l, w, TRUE, 2, shape);
  if (bias)
    lin->bias = load_tensor (l, b, TRUE, 1, &out);
}

static void
linear_clear (Linear *lin)
{
  g_clear_object (&lin->weight);
  g_clear_object (&lin->bias);
  g_clear_object (&lin->scale);
}

static gboolean
config_int (MoeConfig *c, const char *key, gint64 min, gint64 *out, GError **error)
{
  *out = moe_config_get_int (c, key, error);
  if (error != NULL && *error != NULL)
    return FALSE;
  if (*out < min || *out > G_MAXINT32)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                   "%s: “%s” is %" G_GINT64_FORMAT "; it must be between %" G_GINT64_FORMAT " and %d",
                   *moe_config_get_name (c) ? moe_config_get_name (c) : "config", key, *out, min, G_MAXINT32);
      return FALSE;
    }
  return TRUE;
}

static gint64
first_int (MoeConfig *c, const char * const *keys, gint64 fallback, GError **error)
{
  for (guint i = 0; keys[i] != NULL; i++)
    if (!moe_config_is_null (c, keys[i]))
      return moe_config_get_int (c, keys[i], error);
  if (fallback < 0)
    {
      g_autofree char *list = g_strjoinv (" or ", (char **) keys);
      g_set_error (error, MOE_ERROR, MOE_ERROR_MISSING_KEY, "config: %s is missing", list);
    }
  return fallback;
}

/* RoPE: the inverse frequencies and YaRN's attention factor, as
 * transformers' modeling_rope_utils computes them in float32. */
static gboolean
setup_rope (MoeTransformer *self, MoeConfig *c, GError **error)
{
  g_autoptr(GError) local = NULL;
  MoeConfig *params = NULL;
  g_autofree char *type = NULL;
  double theta, factor = 1.0, partial = 1.0;
  JsonObject *obj = _moe_config_get_json_object (c);
  JsonNode *rp = json_object_get_member (obj, "rope_parameters");
  g_autoptr(MoeConfig) rope = NULL;
  guint dim = self->rope_dim;

  if (rp == NULL || !JSON_NODE_HOLDS_OBJECT (rp))
    rp = json_object_get_member (obj, "rope_scaling");
  if (rp != NULL && JSON_NODE_HOLDS_OBJECT (rp))
    rope = params = _moe_config_new_for_json (rp, "rope_parameters");

  theta = params ? moe_config_get_double_or (params, "rope_theta", NAN, &local) : NAN;
  if (isnan (theta) && local == NULL)
    theta = moe_config_get_double_or (c, "rope_theta", 10000.0, &local);
  if (local == NULL && params != NULL)
    type = moe_config_dup_string_or (params, "rope_type", NULL, &local);
  if (local == NULL && type == NULL && params != NULL)
    type = moe_config_dup_string_or (params, "type", "default", &local);
  if (local == NULL)
    partial = params ? moe_config_get_double_or (params, "partial_rotary_factor",
                                                 moe_config_get_double_or (c, "partial_rotary_factor", 1.0, NULL), &local)
                     : moe_config_get_double_or (c, "partial_rotary_factor", 1.0, &local);
  if (local != NULL)
    {
      g_propagate_error (error, g_steal_pointer (&local));
      return FALSE;
    }
  if (type == NULL)
    type = g_strdup ("default");
  if (!(theta > 1.0 && theta < 1e12) || !(partial > 0 && partial <= 1.0))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                   "config: rope_theta %g must be in (1, 1e12) and partial_rotary_factor %g in (0, 1]", theta, partial);
      return FALSE;
    }
  if (partial < 1.0)
    dim = (guint) (self->rope_dim * partial);
  self->rope_dim = dim;
  self->rope_scale = 1.0f;
  self->inv_freq = g_new (float, MAX (dim / 2, 1));
  for (guint i = 0; i < dim / 2; i++)
    self->inv_freq[i] = (float) (1.0 / pow (theta, (double) (2 * i) / dim));

  if (g_str_equal (type, "default"))
    return TRUE;
  if (g_str_equal (type, "linear"))
    {
      factor = moe_config_get_double (params, "factor", error);
      for (guint i = 0; i < dim / 2; i++)
        self->inv_freq[i] /= (float) factor;
      return error == NULL || *error == NULL;
    }
  if (g_str_equal (type, "yarn"))
    {
      double beta_fast, beta_slow, orig, attention_factor, low, high, mscale, mscale_all;
      gboolean truncate;

      factor = moe_config_get_double (params, "factor", &local);
      if (local == NULL)
        orig = moe_config_get_double (params, "original_max_position_embeddings", &local);
      if (local != NULL)
        {
          g_propagate_error (error, g_steal_pointer (&local));
          return FALSE;
        }
      beta_fast = moe_config_get_double_or (params, "beta_fast", 32, NULL);
      beta_slow = moe_config_get_double_or (params, "beta_slow", 1, NULL);
      truncate = moe_config_get_boolean_or (params, "truncate", TRUE, NULL);
      mscale = moe_config_get_double_or (params, "mscale", 0, NULL);
      mscale_all = moe_config_get_double_or (params, "mscale_all_dim", 0, NULL);
      attention_factor = moe_config_get_double_or (params, "attention_factor", NAN, NULL);
#define GET_MSCALE(s, m) ((s) <= 1 ? 1.0 : 0.1 * (m) * log (s) + 1.0)
      if (isnan (attention_factor))
        attention_factor = (mscale != 0 && mscale_all != 0)
          ? GET_MSCALE (factor, mscale) / GET_MSCALE (factor, mscale_all)
          : GET_MSCALE (factor, 1);
#undef GET_MSCALE
#define CORRECTION_DIM(rot) ((dim * log (orig / ((rot) * 2 * G_PI))) / (2 * log (theta)))
      low = CORRECTION_DIM (beta_fast);
      high = CORRECTION_DIM (beta_slow);
#undef CORRECTION_DIM
      if (truncate)
        {
          low = floor (low);
          high = ceil (high);
        }
      low = MAX (low, 0);
      high = MIN (high, dim - 1);
      if (low == high)
        high += 0.001;
      for (guint i = 0; i < dim / 2; i++)
        {
          float pos_freq = powf ((float) theta, (float) (2 * i) / (float) dim);
          float extrapolation = 1.0f / pos_freq;
          float interpolation = 1.0f / ((float) factor * pos_freq);
          float ramp = CLAMP (((float) i - (float) low) / (float) (high - low), 0.0f, 1.0f);
          float extrapolation_factor = 1.0f - ramp;
          self->inv_freq[i] = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
        }
      self->rope_scale = (float) attention_factor;
      return TRUE;
    }
  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
               "config: rope type “%s” is not supported; supported: default, linear, yarn", type);
  return FALSE;
}

static gboolean
is_sparse_layer (MoeTransformer *self, MoeConfig *c, guint i, GArray *mlp_only, gint64 sparse_step, gint64 first_dense)
{
  if (self->family == FAMILY_DEEPSEEK_V3)
    return i >= first_dense;
  if (self->family == FAMILY_MIXTRAL || self->family == FAMILY_GPT_OSS || self->family == FAMILY_OLMOE)
    return TRUE;
  for (guint j = 0; mlp_only && j < mlp_only->len; j++)
    if (g_array_index (mlp_only, gint64, j) == i)
      return FALSE;
  return self->num_experts > 0 && sparse_step > 0 && (i + 1) % sparse_step == 0;
}

static guint
layer_window (MoeTransformer *self, MoeConfig *c, guint i, GError **error)
{
  JsonObject *obj = _moe_config_get_json_object (c);
  JsonNode *types = json_object_get_member (obj, "layer_types");
  gint64 window = moe_config_get_int_or (c, "sliding_window", 0, NULL);

  if (window <= 0)
    return 0;
  if (types != NULL && JSON_NODE_HOLDS_ARRAY (types))
    {
      JsonArray *a = json_node_get_array (types);
      JsonNode *t = i < json_array_get_length (a) ? json_array_get_element (a, i) : NULL;
      if (t == NULL || !JSON_NODE_HOLDS_VALUE (t) || json_node_get_value_type (t) != G_TYPE_STRING)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                       "config: layer_types must list a string for each of the layers (layer %u)", i);
          return 0;
        }
      return g_str_equal (json_node_get_string (t), "sliding_attention") ? (guint) window : 0;
    }
  if (!moe_config_get_boolean_or (c, "use_sliding_window", TRUE, NULL))
    return 0;
  return (guint) window;
}

/* FP8/FP4 experts: kept as they are (the backends read them in place), or
 * multiplied out to the model dtype with the dequantize option. */
static gboolean
load_quantized_experts (Loader *l, Layer *L, GError **error)
{
  MoeExperts *q = L->experts;
  g_autoptr(MoeTensor) up = NULL, down = NULL;
  g_autoptr(MoeExperts) plain = NULL;
  gsize split = 0;

  if (!l->quantized)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CHECKPOINT,
                   "%s: the experts are %s but config.json has no quantization_config",
                   moe_checkpoint_get_path (l->ck), moe_dtype_get_name (moe_tensor_get_dtype (moe_experts_get_up_weight (q))));
      return FALSE;
    }
  if (!moe_experts_validate (q, error))
    return FALSE;
  if (!l->dequantize)
    return TRUE;
  {
    MoeCpuExperts view;
    moe_cpu_experts_init (&view, q, l->dtype);
    split = view.up_scale_split;
  }
  up = _moe_dequantize (moe_experts_get_up_weight (q), moe_experts_get_up_weight_scale (q), split, l->dtype, error);
  down = up ? _moe_dequantize (moe_experts_get_down_weight (q), moe_experts_get_down_weight_scale (q), 0, l->dtype, error) : NULL;
  if (down == NULL)
    return FALSE;
  plain = moe_experts_new (up, down);
  g_set_object (&L->experts, plain);
  return TRUE;
}

static gboolean
load_layer (MoeTransformer *self, MoeConfig *c, Loader *l, guint i, gboolean sparse, gint64 dense_inter,
            gint64 shared_inter, GError **error)
{
  Layer *L = &self->layer[i];
  g_autofree char *p = g_strdup_printf ("%slayers.%u", l->prefix, i);
  g_autofree char *name = NULL;
  gint64 H = self->hidden, nh = self->heads, nkv = self->kv_heads, hd = self->head_dim;
  gboolean attn_bias = moe_config_get_boolean_or (c, "attention_bias", FALSE, NULL);

#define N(fmt, ...) (g_free (name), name = g_strdup_printf ("%s." fmt, p, ##__VA_ARGS__))

  L->input_norm = load_f32 (l, N ("input_layernorm.weight"), TRUE, H);
  L->post_norm = load_f32 (l, N ("post_attention_layernorm.weight"), TRUE, H);
  if (*error != NULL)
    return FALSE;   /* a missing norm: layer_window () would set @error over it */
  L->window = layer_window (self, c, i, error);
  if (*error != NULL)
    return FALSE;

  if (self->family == FAMILY_DEEPSEEK_V3)
    {
      gint64 qk = self->nope_dim + self->rope_dim;
      if (self->q_lora > 0)
        {
          load_linear (l, &L->q_a, N ("self_attn.q_a_proj"), self->q_lora, H, attn_bias);
          L->q_a_norm = load_f32 (l, N ("self_attn.q_a_layernorm.weight"), TRUE, self->q_lora);
          load_linear (l, &L->q_b, N ("self_attn.q_b_proj"), nh * qk, self->q_lora, FALSE);
        }
      else
        load_linear (l, &L->q, N ("self_attn.q_proj"), nh * qk, H, FALSE);
      load_linear (l, &L->kv_a, N ("self_attn.kv_a_proj_with_mqa"), self->kv_lora + self->rope_dim, H, attn_bias);
      L->kv_a_norm = load_f32 (l, N ("self_attn.kv_a_layernorm.weight"), TRUE, self->kv_lora);
      load_linear (l, &L->kv_b, N ("self_attn.kv_b_proj"), nh * (self->nope_dim + self->v_head_dim), self->kv_lora, FALSE);
      load_linear (l, &L->o, N ("self_attn.o_proj"), H, nh * self->v_head_dim, attn_bias);
    }
  else
    {
      gboolean qkv_bias = self->family == FAMILY_QWEN2_MOE
        ? moe_config_get_boolean_or (c, "qkv_bias", TRUE, NULL) : attn_bias;
      load_linear (l, &L->q, N ("self_attn.q_proj"), nh * hd, H, qkv_bias);
      load_linear (l, &L->k, N ("self_attn.k_proj"), nkv * hd, H, qkv_bias);
      load_linear (l, &L->v, N ("self_attn.v_proj"), nkv * hd, H, qkv_bias);
      load_linear (l, &L->o, N ("self_attn.o_proj"), H, nh * hd, self->family == FAMILY_GPT_OSS ? attn_bias : FALSE);
      if (self->qk_norm == QK_NORM_PER_HEAD)
        {
          L->q_norm = load_f32 (l, N ("self_attn.q_norm.weight"), TRUE, hd);
          L->k_norm = load_f32 (l, N ("self_attn.k_norm.weight"), TRUE, hd);
        }
      else if (self->qk_norm == QK_NORM_FULL)
        {
          L->q_norm = load_f32 (l, N ("self_attn.q_norm.weight"), TRUE, nh * hd);
          L->k_norm = load_f32 (l, N ("self_attn.k_norm.weight"), TRUE, nkv * hd);
        }
      if (self->family == FAMILY_GPT_OSS)
        L->sinks = load_f32 (l, N ("self_attn.sinks"), TRUE, nh);
    }

  L->is_moe = sparse;
  if (!sparse)
    {
      load_linear (l, &L->gate, N ("mlp.gate_proj"), dense_inter, H, FALSE);
      load_linear (l, &L->up, N ("mlp.up_proj"), dense_inter, H, FALSE);
      load_linear (l, &L->down, N ("mlp.down_proj"), H, dense_inter, FALSE);
      return *error == NULL;
    }

  {
    const char *module = self->family == FAMILY_MIXTRAL && moe_checkpoint_has_tensor (l->ck, N ("block_sparse_moe.gate.weight"))
      ? "block_sparse_moe" : "mlp";
    const char *router = self->family == FAMILY_GPT_OSS ? "router" : "gate";
    g_autofree char *experts_prefix = g_strdup_printf ("%s.%s.experts", p, module);
    gint64 E = self->num_experts;

    {
      gint64 rs[2] = { E, H };
      g_autoptr(MoeTensor) r = load_tensor (l, N ("%s.%s.weight", module, router), TRUE, 2, rs);
      if (r == NULL)
        return FALSE;
      L->router = moe_cpu_tensor_dup_f32 (r);
    }
    if (self->family == FAMILY_GPT_OSS)
      L->router_bias = load_f32 (l, N ("%s.router.bias", module), TRUE, E);
    if (self->family == FAMILY_DEEPSEEK_V3)
      L->score_bias = load_f32 (l, N ("%s.gate.e_score_correction_bias", module), TRUE, E);
    if (*error != NULL)
      return FALSE;

    L->experts = moe_checkpoint_load_experts (l->ck, experts_prefix, error);
    if (L->experts == NULL)
      return FALSE;
    if (_moe_dtype_is_quantized_weight (moe_tensor_get_dtype (moe_experts_get_up_weight (L->experts))) &&
        !load_quantized_experts (l, L, error))
      return FALSE;
    if (moe_experts_get_up_weight_scale (L->experts) == NULL &&
        moe_tensor_get_dtype (moe_experts_get_up_weight (L->experts)) != l->dtype)
      {
        g_autoptr(MoeTensor) up = moe_tensor_to_dtype (moe_experts_get_up_weight (L->experts), l->dtype, error);
        g_autoptr(MoeTensor) down = up ? moe_tensor_to_dtype (moe_experts_get_down_weight (L->experts), l->dtype, error) : NULL;
        g_autoptr(MoeExperts) converted = NULL;
        gboolean transposed = moe_experts_get_is_transposed (L->experts);
        MoeTensor *ub = moe_experts_get_up_bias (L->experts), *db = moe_experts_get_down_bias (L->experts);
        if (down == NULL)
          return FALSE;
        converted = moe_experts_new (up, down);
        moe_experts_set_is_transposed (converted, transposed);
        if (ub != NULL)
          {
            g_autoptr(MoeTensor) b = moe_tensor_to_dtype (ub, l->dtype, error);
            moe_experts_set_up_bias (converted, b);
          }
        if (db != NULL)
          {
            g_autoptr(MoeTensor) b = moe_tensor_to_dtype (db, l->dtype, error);
            moe_experts_set_down_bias (converted, b);
          }
        g_set_object (&L->experts, converted);
      }
    moe_experts_set_activation (L->experts, self->act);
    if (self->family == FAMILY_GPT_OSS)
      {
        moe_experts_set_gate_layout (L->experts, MOE_GATE_LAYOUT_INTERLEAVED);
        moe_experts_set_swiglu_limit (L->experts, moe_config_get_double_or (c, "swiglu_limit", 7.0, NULL));
      }
    if (moe_experts_get_num_experts (L->experts) != E)
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                     "%s: layer %u holds %u experts, the config says %" G_GINT64_FORMAT,
                     moe_checkpoint_get_path (l->ck), i, moe_experts_get_num_experts (L->experts), E);
        return FALSE;
      }
    if (moe_experts_get_hidden_size (L->experts) != H || !moe_experts_validate (L->experts, error))
      {
        if (*error == NULL)
          g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                       "%s: layer %u's experts have hidden size %u, the config says %" G_GINT64_FORMAT,
                       moe_checkpoint_get_path (l->ck), i, moe_experts_get_hidden_size (L->experts), H);
        return FALSE;
      }
    if (!moe_device_is_cpu (l->device))
      {
        MoeExperts *moved = moe_experts_to_device (L->experts, moe_device_get_name (l->device), error);
        if (moved == NULL)
          return FALSE;
        g_object_unref (L->experts);
        L->experts = moved;
      }
    g_ptr_array_add (self->all_experts, g_object_ref (L->experts));

    if (self->has_shared)
      {
        const char *shared = self->family == FAMILY_DEEPSEEK_V3 ? "shared_experts" : "shared_expert";
        load_linear (l, &L->gate, N ("mlp.%s.gate_proj", shared), shared_inter, H, FALSE);
        load_linear (l, &L->up, N ("mlp.%s.up_proj", shared), shared_inter, H, FALSE);
        load_linear (l, &L->down, N ("mlp.%s.down_proj", shared), H, shared_inter, FALSE);
        if (self->shared_gated)
          load_linear (l, &L->shared_gate, N ("mlp.shared_expert_gate"), 1, H, FALSE);
      }
  }
#undef N
  return *error == NULL;
}

/* transformers' fine-grained FP8 (DeepSeek-style checkpoints): what libmoe
 * runs, and a clear refusal of the rest. */
static gboolean
check_quantization (MoeConfig *top, gboolean *quantized, GError **error)
{
  g_autoptr(MoeConfig) q = _moe_config_dup_object (top, "quantization_config");
  g_autofree char *method = NULL, *scheme = NULL;
  g_autoptr(GError) local = NULL;
  g_autoptr(GArray) block = NULL;

  *quantized = FALSE;
  if (q == NULL)
    return TRUE;
  method = moe_config_dup_string_or (q, "quant_method", "", &local);
  if (local == NULL)
    scheme = moe_config_dup_string_or (q, "activation_scheme", "dynamic", &local);
  if (local != NULL)
    {
      g_propagate_prefixed_error (error, g_steal_pointer (&local), "config: quantization_config: ");
      return FALSE;
    }
  if (!g_str_equal (method, "fp8"))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "config: quantization_config.quant_method “%s” is not supported; libmoe runs “fp8” "
                   "(block-scaled FP8 and FP4 experts)", method);
      return FALSE;
    }
  if (!g_str_equal (scheme, "dynamic"))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "config: quantization_config.activation_scheme “%s” is not supported (as in transformers' "
                   "batched_mm and grouped_mm); valid: dynamic", scheme);
      return FALSE;
    }
  if (moe_config_has_key (q, "weight_block_size") && !moe_config_is_null (q, "weight_block_size"))
    {
      block = moe_config_get_int_array (q, "weight_block_size", &local);
      if (block == NULL || block->len != 2 || g_array_index (block, gint64, 0) != 128 ||
          g_array_index (block, gint64, 1) != 128)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                       "config: quantization_config.weight_block_size must be [128, 128]%s%s",
                       local ? ": " : "", local ? local->message : "");
          return FALSE;
        }
    }
  *quantized = TRUE;
  return TRUE;
}

MoeTransformer *
_moe_transformer_new (MoeConfig      *top,
                      MoeCheckpoint  *ck,
                      MoeDType        dtype,
                      gboolean        dequantize,
                      MoeDevice      *device,
                      GCancellable   *cancellable,
                      GError        **error)
{
  MoeTransformer *self = g_new0 (MoeTransformer, 1);
  g_autoptr(GError) local = NULL;
  g_autoptr(GArray) mlp_only = NULL;
  const char *model_type = moe_config_get_model_type (top);
  MoeConfig *c = top;
  Loader l = { ck, dtype, "model.", &local, FALSE, dequantize, device ? device : moe_device_get_cpu () };
  gint64 v, dense_inter = 0, moe_inter = 0, shared_inter = 0, sparse_step = 1, first_dense = 0;
  static const char *experts_keys[] = { "num_experts", "num_local_experts", "n_routed_experts", NULL };
  static const char *topk_keys[] = { "num_experts_per_tok", "experts_per_token", NULL };
  gboolean found = FALSE;

  self->all_experts = g_ptr_array_new_with_free_func (g_object_unref);
  self->dtype = dtype;
  self->device = l.device;

  for (guint i = 0; model_type && i < G_N_ELEMENTS (families); i++)
    if (g_str_equal (model_type, families[i].model_type))
      {
        self->family = families[i].family;
        found = TRUE;
      }
  if (!found)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "config: model_type “%s” is not supported; supported: qwen2_moe, qwen3_moe, qwen3_vl_moe, "
                   "mixtral, olmoe, deepseek_v3, gpt_oss", model_type ? model_type : "(missing)");
      goto fail;
    }

  self->experts_key = g_strdup ("");
  if (self->family == FAMILY_QWEN3_VL_MOE)
    {
      c = moe_config_get_sub_config (top, "text_config");
      if (c == NULL)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_MISSING_KEY, "config: qwen3_vl_moe needs a text_config");
          goto fail;
        }
      g_free (self->experts_key);
      self->experts_key = g_strdup ("text_config");
      l.prefix = "model.language_model.";
    }

  if (!check_quantization (top, &l.quantized, error))
    goto fail;

#define INT(key, min, dst) G_STMT_START { if (!config_int (c, key, min, &v, &local)) goto fail_local; dst = v; } G_STMT_END
  INT ("hidden_size", 1, self->hidden);
  INT ("num_hidden_layers", 1, self->layers);
  INT ("num_attention_heads", 1, self->heads);
  INT ("vocab_size", 1, self->vocab);
  if (local == NULL)
    self->kv_heads = moe_config_get_int_or (c, "num_key_value_heads", self->heads, &local);
  if (local == NULL)
    self->head_dim = moe_config_get_int_or (c, "head_dim", self->hidden / self->heads, &local);
  if (local == NULL)
    self->eps = moe_config_get_double_or (c, "rms_norm_eps", 1e-6, &local);
  if (local == NULL)
    self->act = moe_config_dup_string_or (c, "hidden_act", "silu", &local);
  if (local == NULL)
    self->num_experts = first_int (c, experts_keys, -1, &local);
  if (local == NULL)
    self->top_k = first_int (c, topk_keys, -1, &local);
  if (local != NULL)
    goto fail_local;
  /* every size is bounded before anything is allocated from it */
  {
    const struct { const char *what; gint64 value, max; } limits[] = {
      { "hidden_size", self->hidden, 1 << 20 },
      { "num_hidden_layers", self->layers, 1 << 12 },
      { "num_attention_heads", self->heads, 1 << 12 },
      { "num_key_value_heads", moe_config_get_int_or (c, "num_key_value_heads", self->heads, NULL), 1 << 12 },
      { "head_dim", moe_config_get_int_or (c, "head_dim", 1, NULL), 1 << 14 },
      { "vocab_size", self->vocab, 1 << 26 },
      { "intermediate_size", moe_config_get_int_or (c, "intermediate_size", 1, NULL), 1 << 24 },
      { "moe_intermediate_size", moe_config_get_int_or (c, "moe_intermediate_size", 1, NULL), 1 << 24 },
      { "shared_expert_intermediate_size", moe_config_get_int_or (c, "shared_expert_intermediate_size", 1, NULL), 1 << 24 },
      { "q_lora_rank", moe_config_get_int_or (c, "q_lora_rank", 1, NULL), 1 << 16 },
      { "kv_lora_rank", moe_config_get_int_or (c, "kv_lora_rank", 1, NULL), 1 << 16 },
      { "qk_nope_head_dim", moe_config_get_int_or (c, "qk_nope_head_dim", 1, NULL), 1 << 14 },
      { "qk_rope_head_dim", moe_config_get_int_or (c, "qk_rope_head_dim", 2, NULL), 1 << 14 },
      { "v_head_dim", moe_config_get_int_or (c, "v_head_dim", 1, NULL), 1 << 14 },
    };
    for (guint i = 0; i < G_N_ELEMENTS (limits); i++)
      if (limits[i].value < 0 || limits[i].value > limits[i].max)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                       "config: %s is %" G_GINT64_FORMAT "; it must be between 0 and %" G_GINT64_FORMAT,
                       limits[i].what, limits[i].value, limits[i].max);
          goto fail;
        }
    if (!(self->eps >= 0 && self->eps < 1))
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                     "config: rms_norm_eps is %g; it must be in [0, 1)", self->eps);
        goto fail;
      }
  }
  if (self->kv_heads == 0 || self->heads % self->kv_heads != 0 || self->head_dim == 0 ||
      self->num_experts == 0 || self->top_k == 0 || self->top_k > self->num_experts ||
      self->num_experts > 1u << 20)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                   "config: inconsistent sizes (num_attention_heads %u, num_key_value_heads %u, head_dim %u, "
                   "experts %u, top-k %u)", self->heads, self->kv_heads, self->head_dim,
                   self->num_experts, self->top_k);
      goto fail;
    }
  if (!moe_cpu_activation_from_name (self->act, &self->act_fn))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "config: hidden_act “%s” is not supported; supported: silu, gelu, gelu_pytorch_tanh, relu", self->act);
      goto fail;
    }

  self->v_head_dim = self->head_dim;
  self->rope_dim = self->head_dim;
  self->router_kind = ROUTER_SOFTMAX_TOPK;
  if (local == NULL)
    self->norm_topk = moe_config_get_boolean_or (c, "norm_topk_prob", FALSE, &local);
  self->weights_in_act_dtype = TRUE;
  if (local == NULL)
    dense_inter = moe_config_get_int_or (c, "intermediate_size", 0, &local);
  if (local == NULL)
    moe_inter = moe_config_get_int_or (c, "moe_intermediate_size", dense_inter, &local);
  if (local == NULL)
    mlp_only = moe_config_get_int_array (c, "mlp_only_layers", &local);
  if (local == NULL)
    sparse_step = moe_config_get_int_or (c, "decoder_sparse_step", 1, &local);
  if (local != NULL)
    goto fail_local;

  switch (self->family)
    {
    case FAMILY_QWEN2_MOE:
      self->has_shared = self->shared_gated = TRUE;
      if (local == NULL)
        shared_inter = moe_config_get_int (c, "shared_expert_intermediate_size", &local);
      break;
    case FAMILY_QWEN3_MOE:
      self->qk_norm = QK_NORM_PER_HEAD;
      break;
    case FAMILY_QWEN3_VL_MOE:
      self->qk_norm = QK_NORM_PER_HEAD;
      self->norm_topk = TRUE;       /* its router always renormalises */
      break;
    case FAMILY_MIXTRAL:
      self->norm_topk = TRUE;
      self->weights_in_act_dtype = FALSE;
      break;
    case FAMILY_OLMOE:
      self->qk_norm = QK_NORM_FULL;
      if (local == NULL)
        self->clip_qkv = moe_config_get_double_or (c, "clip_qkv", 0, &local);
      break;
    case FAMILY_DEEPSEEK_V3:
      self->router_kind = ROUTER_SIGMOID_GROUPED;
      self->weights_in_act_dtype = FALSE;
      self->has_shared = TRUE;
      if (local == NULL)
        self->routed_scale = moe_config_get_double_or (c, "routed_scaling_factor", 1.0, &local);
      if (local == NULL)
        self->n_group = moe_config_get_int_or (c, "n_group", 1, &local);
      if (local == NULL)
        self->topk_group = moe_config_get_int_or (c, "topk_group", 1, &local);
      if (local == NULL)
        shared_inter = moe_inter * moe_config_get_int_or (c, "n_shared_experts", 1, &local);
      if (local == NULL)
        first_dense = moe_config_get_int_or (c, "first_k_dense_replace", 0, &local);
      if (local == NULL)
        self->q_lora = moe_config_get_int_or (c, "q_lora_rank", 0, &local);
      if (local == NULL)
        INT ("kv_lora_rank", 1, self->kv_lora);
      if (local == NULL)
        INT ("qk_nope_head_dim", 0, self->nope_dim);
      if (local == NULL)
        INT ("qk_rope_head_dim", 2, self->rope_dim);
      if (local == NULL)
        INT ("v_head_dim", 1, self->v_head_dim);
      if (local == NULL)
        self->rope_interleaved = moe_config_get_boolean_or (c, "rope_interleave", TRUE, &local);
      self->kv_heads = self->heads;
      self->head_dim = self->nope_dim + self->rope_dim;
      if (self->n_group == 0 || self->num_experts % self->n_group != 0 || self->topk_group > self->n_group ||
          self->num_experts / self->n_group < 2)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                       "config: n_group %u and topk_group %u do not divide %u experts into groups of two or more",
                       self->n_group, self->topk_group, self->num_experts);
          goto fail;
        }
      break;
    case FAMILY_GPT_OSS:
      self->router_kind = ROUTER_TOPK_SOFTMAX;
      self->eager_attention = TRUE;
      break;
    }
  if (local != NULL)
    goto fail_local;
#undef INT

  self->scaling = 1.0f / sqrtf ((float) self->head_dim);
  if (!setup_rope (self, c, &local))
    goto fail_local;
  if (self->family == FAMILY_DEEPSEEK_V3 && self->rope_scale != 1.0f)
    {
      /* yarn_apply_mscale: DeepSeek folds mscale² into the score scale */
      self->scaling *= self->rope_scale * self->rope_scale;
      self->rope_scale = 1.0f;
    }

  {
    gint64 es[2] = { self->vocab, self->hidden };
    g_autofree char *embed = g_strdup_printf ("%sembed_tokens.weight", l.prefix);
    g_autofree char *norm = g_strdup_printf ("%snorm.weight", l.prefix);
    self->embed = load_tensor (&l, embed, TRUE, 2, es);
    self->final_norm = load_f32 (&l, norm, TRUE, self->hidden);
    if (moe_checkpoint_has_tensor (ck, "lm_head.weight"))
      self->lm_head = load_tensor (&l, "lm_head.weight", TRUE, 2, es);
    else if (moe_config_get_boolean_or (top, "tie_word_embeddings", FALSE, NULL) ||
             moe_config_get_boolean_or (c, "tie_word_embeddings", FALSE, NULL))
      self->lm_head = self->embed ? g_object_ref (self->embed) : NULL;
    else
      load_tensor (&l, "lm_head.weight", TRUE, 2, es);
    if (local != NULL)
      goto fail_local;
  }

  self->layer = g_new0 (Layer, self->layers);
  for (guint i = 0; i < self->layers; i++)
    {
      if (g_cancellable_set_error_if_cancelled (cancellable, error))
        goto fail;
      if (!load_layer (self, c, &l, i, is_sparse_layer (self, c, i, mlp_only, sparse_step, first_dense),
                       dense_inter, shared_inter, &local))
        goto fail_local;
      if (local != NULL)
        goto fail_local;
    }
  if (!moe_device_is_cpu (self->device))
    {
      MoeDeviceClass *klass = MOE_DEVICE_GET_CLASS (self->device);
      if (klass->decoder_new == NULL)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                       "Device “%s” runs experts layers but not whole models", moe_device_get_name (self->device));
          goto fail;
        }
      self->device_decoder = klass->decoder_new (self->device, self, error);
      if (self->device_decoder == NULL)
        goto fail;
    }
  return self;

fail_local:
  g_propagate_error (error, g_steal_pointer (&local));
fail:
  _moe_transformer_free (self);
  return NULL;
}

void
_moe_transformer_free (MoeTransformer *self)
{
  if (self == NULL)
    return;
  if (self->device_decoder != NULL)
    MOE_DEVICE_GET_CLASS (self->device)->decoder_free (self->device, self->device_decoder);
  for (guint i = 0; self->layer != NULL && i < self->layers; i++)
    {
      Layer *L = &self->layer[i];
      Linear *lins[] = { &L->q, &L->k, &L->v, &L->o, &L->q_a, &L->q_b, &L->kv_a, &L->kv_b,
                         &L->gate, &L->up, &L->down, &L->shared_gate };
      for (guint j = 0; j < G_N_ELEMENTS (lins); j++)
        linear_clear (lins[j]);
      g_free (L->input_norm);
      g_free (L->post_norm);
      g_free (L->q_norm);
      g_free (L->k_norm);
      g_free (L->q_a_norm);
      g_free (L->kv_a_norm);
      g_free (L->sinks);
      g_free (L->router);
      g_free (L->router_bias);
      g_free (L->score_bias);
      g_clear_object (&L->experts);
    }
  g_free (self->layer);
  g_clear_object (&self->embed);
  g_clear_object (&self->lm_head);
  g_free (self->final_norm);
  g_free (self->inv_freq);
  g_free (self->act);
  g_free (self->experts_key);
  g_ptr_array_unref (self->all_experts);
  g_free (self);
}

const char *
_moe_transformer_get_experts_key (MoeTransformer *self)
{
  return self->experts_key;
}

GPtrArray *
_moe_transformer_get_experts (MoeTransformer *self)
{
  return self->all_experts;
}

gint64
_moe_transformer_get_vocab_size (MoeTransformer *self)
{
  return self->vocab;
}

guint
_moe_transformer_get_num_experts (MoeTransformer *self)
{
  return self->num_experts;
}

guint
_moe_transformer_get_top_k (MoeTransformer *self)
{
  return self->top_k;
}

/* ------------------------------------------------------------------ */
/* KV cache                                                            */

static gsize
key_dim (MoeTransformer *m)
{
  return m->head_dim;
}

MoeKvCache *
_moe_kv_cache_new (MoeTransformer *model,
                   guint           batch)
{
  MoeKvCache *cache = g_new0 (MoeKvCache, 1);

  cache->model = model;
  cache->batch = batch;
  cache->k = g_new0 (float *, model->layers);
  cache->v = g_new0 (float *, model->layers);
  return cache;
}

void
_moe_kv_cache_free (MoeKvCache *cache)
{
  if (cache == NULL)
    return;
  if (cache->device_cache != NULL)
    MOE_DEVICE_GET_CLASS (cache->model->device)->decoder_cache_free (cache->model->device, cache->device_cache);
  for (guint i = 0; i < cache->model->layers; i++)
    {
      g_free (cache->k[i]);
      g_free (cache->v[i]);
    }
  g_free (cache->k);
  g_free (cache->v);
  g_free (cache);
}

guint
_moe_kv_cache_get_length (MoeKvCache *cache)
{
  return cache->length;
}

static gboolean
kv_cache_reserve (MoeKvCache *cache, guint length, GError **error)
{
  MoeTransformer *m = cache->model;
  gsize row_k = (gsize) cache->batch * m->kv_heads * key_dim (m);
  gsize row_v = (gsize) cache->batch * m->kv_heads * m->v_head_dim;
  guint cap;

  if (length <= cache->capacity)
    return TRUE;
  cap = MAX (length, MAX (cache->capacity * 2, 16));
  for (guint i = 0; i < m->layers; i++)
    {
      float *k = g_try_realloc (cache->k[i], cap * row_k * sizeof (float));
      float *v = k ? g_try_realloc (cache->v[i], cap * row_v * sizeof (float)) : NULL;
      if (k != NULL)
        cache->k[i] = k;
      if (v == NULL)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY,
                       "Could not grow the KV cache to %u positions", cap);
          return FALSE;
        }
      cache->v[i] = v;
    }
  cache->capacity = cap;
  return TRUE;
}

/* ------------------------------------------------------------------ */
/* Ops                                                                 */

static inline void
round_to_dtype (MoeTransformer *m, float *x, gsize n)
{
  if (m->dtype == MOE_DTYPE_F32)
    return;
  for (gsize i = 0; i < n; i++)
    x[i] = moe_cpu_round_to (x[i], m->dtype);
}

static void
linear (MoeTransformer *m, const Linear *lin, const float *x, gsize rows, float *y)
{
  MoeCpuMatrix w = {
    .dtype = moe_tensor_get_dtype (lin->weight),
    .data = moe_tensor_get_data (lin->weight),
    .n = moe_tensor_get_dim (lin->weight, 0),
    .k = moe_tensor_get_dim (lin->weight, 1),
    .transposed = FALSE,
  };

  if (lin->scale != NULL)
    {
      /* FP8 or FP4: dynamic activation quantization inside moe_cpu_matmul() */
      if (w.dtype == MOE_DTYPE_I8)
        w.k *= 2;
      w.scale = moe_tensor_get_data (lin->scale);
      w.scale_dtype = moe_tensor_get_dtype (lin->scale);
      w.scale_rows = moe_tensor_get_dim (lin->scale, 0);
    }

  moe_cpu_matmul (x, rows, &w, y);
  if (lin->bias != NULL)
    moe_cpu_add_bias (y, rows, w.n, moe_tensor_get_dtype (lin->bias), moe_tensor_get_data (lin->bias));
  round_to_dtype (m, y, rows * w.n);
}

/* RMSNorm over rows of width n (stride apart), as torch: the variance in
 * float32, the normalised value rounded to the model dtype, then × weight. */
static void
rms_norm (MoeTransformer *m, const float *x, gsize rows, gsize n, gsize stride, const float *w, float *y)
{
  for (gsize r = 0; r < rows; r++)
    {
      const float *xr = x + r * stride;
      float *yr = y + r * stride;
      float ss = 0;
      for (gsize j = 0; j < n; j++)
        ss += xr[j] * xr[j];
      float inv = 1.0f / sqrtf (ss / (float) n + m->eps);
      for (gsize j = 0; j < n; j++)
        yr[j] = m->family == FAMILY_GPT_OSS
          ? moe_cpu_round_to (xr[j] * inv * w[j], m->dtype)        /* (w · x).to(dtype) */
          : moe_cpu_round_to (moe_cpu_round_to (xr[j] * inv, m->dtype) * w[j], m->dtype);
    }
}

/* Rotates @dim values of one head vector at position @pos. */
static void
rope (MoeTransformer *m, float *x, gint64 pos)
{
  guint half = m->rope_dim / 2;
  float tmp[512];
  float *t = m->rope_dim <= G_N_ELEMENTS (tmp) ? tmp : g_new (float, m->rope_dim);

  for (guint i = 0; i < half; i++)
    {
      float angle = m->inv_freq[i] * (float) pos;
      float c = moe_cpu_round_to (cosf (angle) * m->rope_scale, m->dtype);
      float s = moe_cpu_round_to (sinf (angle) * m->rope_scale, m->dtype);
      float x1 = m->rope_interleaved ? x[2 * i] : x[i];
      float x2 = m->rope_interleaved ? x[2 * i + 1] : x[i + half];
      t[i] = x1 * c - x2 * s;
      t[i + half] = x2 * c + x1 * s;
    }
  for (guint i = 0; i < m->rope_dim; i++)
    x[i] = moe_cpu_round_to (t[i], m->dtype);
  if (t != tmp)
    g_free (t);
}

typedef struct {
  guint         B, T, past;
  const gint64 *positions;
  const guint8 *key_valid;     /* [B, past + T] or NULL */
} Step;

/* Scaled dot-product attention of q [B*T, heads, dk] over the cache,
 * writing out [B*T, heads, dv]. */
static void
attend (MoeTransformer *m, MoeKvCache *cache, guint layer, const Step *st, const float *q, float *out)
{
  const Layer *L = &m->layer[layer];
  guint len = st->past + st->T, group = m->heads / m->kv_heads;
  gsize dk = key_dim (m), dv = m->v_head_dim;
  g_autofree float *score = g_new (float, len + 1);

  for (guint b = 0; b < st->B; b++)
    for (guint t = 0; t < st->T; t++)
      {
        guint qpos = st->past + t;          /* cache index of this query */
        for (guint h = 0; h < m->heads; h++)
          {
            const float *qv = q + (((gsize) b * st->T + t) * m->heads + h) * dk;
            float *o = out + (((gsize) b * st->T + t) * m->heads + h) * dv;
            guint g = h / group;
            float max = L->sinks ? L->sinks[h] : -INFINITY, sum = 0;
            gboolean any = FALSE;

            for (guint j = 0; j < len; j++)
              {
                gboolean ok = j <= qpos && (st->key_valid == NULL || st->key_valid[(gsize) b * len + j]) &&
                              (L->window == 0 || qpos - j < L->window);
                score[j] = -INFINITY;
                if (ok)
                  {
                    const float *kv = cache->k[layer] + (((gsize) j * cache->batch + b) * m->kv_heads + g) * dk;
                    float s = 0;
                    for (gsize d = 0; d < dk; d++)
                      s += qv[d] * kv[d];
                    score[j] = m->eager_attention ? moe_cpu_round_to (s * m->scaling, m->dtype) : s * m->scaling;
                    max = MAX (max, score[j]);
                    any = TRUE;
                  }
              }
            memset (o, 0, dv * sizeof (float));
            if (!any && L->sinks == NULL)
              continue;   /* a padded query: nothing to attend to */
            for (guint j = 0; j < len; j++)
              if (score[j] != -INFINITY)
                sum += (score[j] = expf (score[j] - max));
            if (L->sinks)
              sum += expf (L->sinks[h] - max);
            for (guint j = 0; j < len; j++)
              if (score[j] != -INFINITY)
                {
                  const float *vv = cache->v[layer] + (((gsize) j * cache->batch + b) * m->kv_heads + g) * dv;
                  float p = m->eager_attention ? moe_cpu_round_to (score[j] / sum, m->dtype) : score[j] / sum;
                  for (gsize d = 0; d < dv; d++)
                    o[d] += p * vv[d];
                }
            round_to_dtype (m, o, dv);
          }
      }
}

/* attend() for every query row, or (@last_rows) for each sequence's last
 * only, into out [B, heads, dv]: a prompt that generates wants no other
 * row's output from the last layer */
static void
attend_rows (MoeTransformer *m, MoeKvCache *cache, guint layer, const Step *st, gboolean last_rows, const float *q,
             float *out)
{
  gsize width = (gsize) m->heads * key_dim (m);
  Step last = { st->B, 1, st->past + st->T - 1, NULL, st->key_valid };
  g_autofree float *q_last = NULL;

  if (!last_rows)
    {
      attend (m, cache, layer, st, q, out);
      return;
    }
  q_last = g_new (float, st->B * width);
  for (guint b = 0; b < st->B; b++)
    memcpy (q_last + b * width, q + ((gsize) b * st->T + st->T - 1) * width, width * sizeof (float));
  attend (m, cache, layer, &last, q_last, out);
}

static void
store_kv (MoeKvCache *cache, guint layer, const Step *st, guint b, guint t, guint head,
          const float *k, const float *v)
{
  MoeTransformer *m = cache->model;
  gsize dk = key_dim (m), dv = m->v_head_dim;
  gsize slot = ((gsize) (st->past + t) * cache->batch + b) * m->kv_heads + head;

  memcpy (cache->k[layer] + slot * dk, k, dk * sizeof (float));
  memcpy (cache->v[layer] + slot * dv, v, dv * sizeof (float));
}

/* q/k/v, RoPE, the KV-cache write and the attention of x's rows, then o
 * into out; with @last_rows only each sequence's last row asks (out: B
 * rows), though every row's keys and values go to the cache */
static void
attention_gqa (MoeTransformer *m, MoeKvCache *cache, guint li, const Step *st, gboolean last_rows, const float *x,
               float *out)
{
  const Layer *L = &m->layer[li];
  gsize rows = (gsize) st->B * st->T, hd = m->head_dim;
  gsize qn = m->heads * hd, kn = m->kv_heads * hd;
  g_autofree float *q = g_new (float, rows * qn);
  g_autofree float *k = g_new (float, rows * kn);
  g_autofree float *v = g_new (float, rows * kn);
  g_autofree float *a = g_new (float, rows * qn);

  linear (m, &L->q, x, rows, q);
  linear (m, &L->k, x, rows, k);
  linear (m, &L->v, x, rows, v);
  if (m->qk_norm == QK_NORM_FULL)
    {
      rms_norm (m, q, rows, qn, qn, L->q_norm, q);
      rms_norm (m, k, rows, kn, kn, L->k_norm, k);
    }
  else if (m->qk_norm == QK_NORM_PER_HEAD)
    {
      rms_norm (m, q, rows * m->heads, hd, hd, L->q_norm, q);
      rms_norm (m, k, rows * m->kv_heads, hd, hd, L->k_norm, k);
    }
  if (m->clip_qkv > 0)
    for (gsize i = 0; i < rows * qn; i++)
      q[i] = CLAMP (q[i], -m->clip_qkv, m->clip_qkv);
  if (m->clip_qkv > 0)
    for (gsize i = 0; i < rows * kn; i++)
      {
        k[i] = CLAMP (k[i], -m->clip_qkv, m->clip_qkv);
        v[i] = CLAMP (v[i], -m->clip_qkv, m->clip_qkv);
      }

  for (guint b = 0; b < st->B; b++)
    for (guint t = 0; t < st->T; t++)
      {
        gsize r = (gsize) b * st->T + t;
        gint64 pos = st->positions[r];
        for (guint h = 0; h < m->heads; h++)
          rope (m, q + r * qn + h * hd, pos);
        for (guint h = 0; h < m->kv_heads; h++)
          {
            rope (m, k + r * kn + h * hd, pos);
            store_kv (cache, li, st, b, t, h, k + r * kn + h * hd, v + r * kn + h * hd);
          }
      }
  attend_rows (m, cache, li, st, last_rows, q, a);
  linear (m, &L->o, a, last_rows ? st->B : rows, out);
}

/* DeepSeek's multi-head latent attention: queries through a low-rank
 * projection, keys and values expanded from a shared compressed latent;
 * RoPE only on the last qk_rope_head_dim dims of each head. */
static void
attention_mla (MoeTransformer *m, MoeKvCache *cache, guint li, const Step *st, gboolean last_rows, const float *x,
               float *out)
{
  const Layer *L = &m->layer[li];
  gsize rows = (gsize) st->B * st->T;
  gsize qk = m->head_dim, nope = m->nope_dim, rd = m->rope_dim, dv = m->v_head_dim;
  gsize kvb = nope + dv, lat = m->kv_lora + rd;
  g_autofree float *q = g_new (float, rows * m->heads * qk);
  g_autofree float *latent = g_new (float, rows * lat);
  g_autofree float *kv = g_new (float, rows * m->heads * kvb);
  g_autofree float *a = g_new (float, rows * m->heads * dv);
  g_autofree float *key = g_new (float, qk);

  if (m->q_lora > 0)
    {
      g_autofree float *qa = g_new (float, rows * m->q_lora);
      linear (m, &L->q_a, x, rows, qa);
      rms_norm (m, qa, rows, m->q_lora, m->q_lora, L->q_a_norm, qa);
      linear (m, &L->q_b, qa, rows, q);
    }
  else
    linear (m, &L->q, x, rows, q);

  linear (m, &L->kv_a, x, rows, latent);
  rms_norm (m, latent, rows, m->kv_lora, lat, L->kv_a_norm, latent);
  {
    g_autofree float *compact = g_new (float, rows * m->kv_lora);
    for (gsize r = 0; r < rows; r++)
      memcpy (compact + r * m->kv_lora, latent + r * lat, m->kv_lora * sizeof (float));
    linear (m, &L->kv_b, compact, rows, kv);
  }

  for (guint b = 0; b < st->B; b++)
    for (guint t = 0; t < st->T; t++)
      {
        gsize r = (gsize) b * st->T + t;
        gint64 pos = st->positions[r];
        float *k_rot = latent + r * lat + m->kv_lora;

        rope (m, k_rot, pos);
        for (guint h = 0; h < m->heads; h++)
          {
            const float *kvh = kv + (r * m->heads + h) * kvb;
            rope (m, q + (r * m->heads + h) * qk + nope, pos);
            memcpy (key, kvh, nope * sizeof (float));
            memcpy (key + nope, k_rot, rd * sizeof (float));
            store_kv (cache, li, st, b, t, h, key, kvh + nope);
          }
      }
  attend_rows (m, cache, li, st, last_rows, q, a);
  linear (m, &L->o, a, last_rows ? st->B : rows, out);
}

/* h's [batch, n_tokens, width] rows → each sequence's last, in place (row
 * b moves up from b·n_tokens + n_tokens − 1 ≥ b); returns batch */
static gsize
keep_last_rows (float *h, guint batch, guint n_tokens, gsize width)
{
  for (guint b = 0; b < batch; b++)
    memmove (h + (gsize) b * width, h + ((gsize) b * n_tokens + n_tokens - 1) * width, width * sizeof (float));
  return batch;
}

static void
dense_mlp (MoeTransformer *m, const Layer *L, const float *x, gsize rows, float *y)
{
  gsize inter = moe_tensor_get_dim (L->gate.weight, 0);
  g_autofree float *g = g_new (float, rows * inter);
  g_autofree float *u = g_new (float, rows * inter);
  MoeCpuGate gate = { .has_gate = FALSE, .activation = m->act_fn, .round = m->dtype };

  linear (m, &L->gate, x, rows, g);
  linear (m, &L->up, x, rows, u);
  moe_cpu_apply_gate (g, rows, inter, &gate, g);
  for (gsize i = 0; i < rows * inter; i++)
    g[i] = moe_cpu_round_to (g[i] * u[i], m->dtype);
  linear (m, &L->down, g, rows, y);
}

/* The top-k of @n scores, largest first (ties: lower index first). */
static void
top_k (const float *scores, guint n, guint k, gint64 *idx)
{
  for (guint s = 0; s < k; s++)
    {
      gint64 best = -1;
      for (guint e = 0; e < n; e++)
        {
          gboolean taken = FALSE;
          for (guint p = 0; p < s; p++)
            taken |= idx[p] == e;
          if (!taken && (best < 0 || scores[e] > scores[best]))
            best = e;
        }
      idx[s] = best;
    }
}

static void
route (MoeTransformer *m, const Layer *L, const float *x, gsize rows, gint64 *ids, float *w)
{
  guint E = m->num_experts, K = m->top_k;
  g_autofree float *logits = g_new (float, E);
  g_autofree float *choice = g_new (float, E);

  for (gsize r = 0; r < rows; r++)
    {
      const float *xr = x + r * m->hidden;
      gint64 *ir = ids + r * K;
      float *wr = w + r * K;

      for (guint e = 0; e < E; e++)
        {
          float s = 0;
          for (guint j = 0; j < m->hidden; j++)
            s += xr[j] * L->router[(gsize) e * m->hidden + j];
          if (L->router_bias)
            s += L->router_bias[e];
          /* DeepSeek routes in float32 whatever the model dtype */
          logits[e] = m->router_kind == ROUTER_SIGMOID_GROUPED ? s : moe_cpu_round_to (s, m->dtype);
        }

      switch (m->router_kind)
        {
        case ROUTER_SOFTMAX_TOPK:
          {
            float max = -INFINITY, sum = 0, kept = 0;
            for (guint e = 0; e < E; e++)
              max = MAX (max, logits[e]);
            for (guint e = 0; e < E; e++)
              sum += (choice[e] = expf (logits[e] - max));
            for (guint e = 0; e < E; e++)
              choice[e] /= sum;
            top_k (choice, E, K, ir);
            for (guint k = 0; k < K; k++)
              kept += (wr[k] = choice[ir[k]]);
            for (guint k = 0; k < K; k++)
              {
                if (m->norm_topk)
                  wr[k] /= kept;
                if (m->weights_in_act_dtype)
                  wr[k] = moe_cpu_round_to (wr[k], m->dtype);
              }
            break;
          }
        case ROUTER_SIGMOID_GROUPED:
          {
            guint per = E / m->n_group;
            g_autofree float *group = g_new (float, m->n_group);
            g_autofree gint64 *keep = g_new (gint64, m->topk_group);
            g_autofree float *sig = g_new (float, E);
            float sum = 0;

            for (guint e = 0; e < E; e++)
              {
                sig[e] = 1.0f / (1.0f + expf (-logits[e]));
                choice[e] = sig[e] + L->score_bias[e];
              }
            for (guint g = 0; g < m->n_group; g++)
              {
                gint64 two[2];
                top_k (choice + g * per, per, 2, two);
                group[g] = choice[g * per + two[0]] + choice[g * per + two[1]];
              }
            top_k (group, m->n_group, m->topk_group, keep);
            for (guint g = 0; g < m->n_group; g++)
              {
                gboolean kept = FALSE;
                for (guint i = 0; i < m->topk_group; i++)
                  kept |= keep[i] == g;
                if (!kept)
                  for (guint e = 0; e < per; e++)
                    choice[g * per + e] = -INFINITY;
              }
            top_k (choice, E, K, ir);
            for (guint k = 0; k < K; k++)
              sum += (wr[k] = sig[ir[k]]);
            for (guint k = 0; k < K; k++)
              {
                if (m->norm_topk)
                  wr[k] /= sum + 1e-20f;
                wr[k] *= (float) m->routed_scale;
              }
            break;
          }
        case ROUTER_TOPK_SOFTMAX:
          {
            float max = -INFINITY, sum = 0;
            top_k (logits, E, K, ir);
            for (guint k = 0; k < K; k++)
              max = MAX (max, logits[ir[k]]);
            for (guint k = 0; k < K; k++)
              sum += (wr[k] = expf (logits[ir[k]] - max));
            for (guint k = 0; k < K; k++)
              wr[k] = moe_cpu_round_to (wr[k] / sum, m->dtype);
            break;
          }
        }
    }
}

static gboolean
moe_block (MoeTransformer *m, const Layer *L, const float *x, gsize rows, float *y, GError **error)
{
  gint64 hs[2] = { (gint64) rows, m->hidden }, ks[2] = { (gint64) rows, m->top_k };
  g_autoptr(MoeTensor) hidden = NULL, index = NULL, weights = NULL, out = NULL;
  gint64 *ids;
  float *w;

  index = moe_tensor_new_empty (NULL, MOE_DTYPE_I64, ks, 2, error);
  weights = index ? moe_tensor_new_empty (NULL, MOE_DTYPE_F32, ks, 2, error) : NULL;
  hidden = weights ? moe_cpu_tensor_from_f32 (x, m->dtype, hs, 2, error) : NULL;
  if (hidden == NULL)
    return FALSE;
  ids = moe_tensor_get_mutable_data (index);
  w = moe_tensor_get_mutable_data (weights);
  route (m, L, x, rows, ids, w);

  out = moe_experts_forward (L->experts, hidden, index, weights, error);
  if (out == NULL)
    return FALSE;
  moe_cpu_convert (moe_tensor_get_dtype (out), moe_tensor_get_data (out), MOE_DTYPE_F32, y, rows * m->hidden);

  if (m->has_shared)
    {
      g_autofree float *s = g_new (float, rows * m->hidden);
      dense_mlp (m, L, x, rows, s);
      if (m->shared_gated)
        {
          g_autofree float *g = g_new (float, rows);
          linear (m, &L->shared_gate, x, rows, g);
          for (gsize r = 0; r < rows; r++)
            {
              float gate = moe_cpu_round_to (1.0f / (1.0f + expf (-g[r])), m->dtype);
              for (guint j = 0; j < m->hidden; j++)
                s[r * m->hidden + j] = moe_cpu_round_to (gate * s[r * m->hidden + j], m->dtype);
            }
        }
      for (gsize i = 0; i < rows * m->hidden; i++)
        y[i] = moe_cpu_round_to (y[i] + s[i], m->dtype);
    }
  return TRUE;
}

gint64
_moe_greedy_token (const float *logits,
                   gint64       vocab)
{
  gint64 best = 0;

  for (gint64 v = 1; v < vocab; v++)
    if (logits[v] > logits[best])
      best = v;
  return best;
}

gboolean
_moe_transformer_forward (MoeTransformer *m,
                          MoeKvCache     *cache,
                          const gint64   *ids,
                          guint           batch,
                          guint           n_tokens,
                          const gint64   *positions,
                          const guint8   *key_valid,
                          gboolean        last_only,
                          float          *logits,
                          const MoeSampling *sampling,
                          gint64         *tokens,
                          GError        **error)
{
  gsize rows = (gsize) batch * n_tokens, H = m->hidden;
  g_autofree float *h = NULL, *x = NULL, *y = NULL;
  Step st = { batch, n_tokens, cache->length, positions, key_valid };

  g_return_val_if_fail (cache->batch == batch, FALSE);
  g_return_val_if_fail (tokens == NULL || last_only, FALSE);

  for (gsize r = 0; r < rows; r++)
    if (ids[r] < 0 || ids[r] >= m->vocab)
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                     "input_ids[%" G_GSIZE_FORMAT ", %" G_GSIZE_FORMAT "] is %" G_GINT64_FORMAT
                     "; token ids must be in 0…%u", r / n_tokens, r % n_tokens, ids[r], m->vocab - 1);
        return FALSE;
      }

  if (m->device_decoder != NULL)
    {
      MoeDecoderStep step = { cache, ids, batch, n_tokens, positions, key_valid, last_only, logits, tokens,
                              tokens != NULL ? sampling : NULL };
      if (!MOE_DEVICE_GET_CLASS (m->device)->decoder_forward (m->device, m->device_decoder, &step, error))
        return FALSE;
      cache->length += n_tokens;
      if (step.sampling != NULL)
        {
          /* the rows the device left to the host (token -1), sampled
           * here from the logits it sent back (rows with no draw keep -1) */
          g_autofree double *draws = g_new (double, batch);
          MoeSampling rest = *sampling;
          gboolean any = FALSE;

          for (guint b = 0; b < batch; b++)
            {
              draws[b] = tokens[b] < 0 ? sampling->draws[b] : -1.0;
              any |= draws[b] >= 0;
            }
          rest.draws = draws;
          if (any)
            _moe_sample_tokens (logits, batch, m->vocab, &rest, tokens);
        }
      return TRUE;
    }

  if (!kv_cache_reserve (cache, cache->length + n_tokens, error))
    return FALSE;

  /* Out of memory must be an error, not an abort: the step's working set is
   * tried once up front (activations, attention and expert temporaries). */
  {
    guint64 widest = MAX (m->head_dim, m->v_head_dim) * (guint64) m->heads;
    guint64 per_row = 8 * (guint64) H + 4 * widest + 6 * (guint64) m->top_k * (H + 2 * 4096)
                      + (guint64) (m->kv_lora + m->q_lora) * 2 + (last_only ? 0 : (guint64) m->vocab);
    guint64 bytes = (guint64) rows * per_row * sizeof (float) + (guint64) (cache->length + n_tokens) * 4 * sizeof (float);
    gpointer probe = bytes < G_MAXSIZE ? g_try_malloc ((gsize) bytes) : NULL;
    if (probe == NULL)
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY,
                     "A forward pass of %" G_GSIZE_FORMAT " tokens needs about %" G_GUINT64_FORMAT
                     " MB of working memory, which could not be allocated", rows, bytes >> 20);
        return FALSE;
      }
    g_free (probe);
  }

  h = g_new (float, rows * H);
  x = g_new (float, rows * H);
  y = g_new (float, rows * H);
  moe_cpu_gather_rows (moe_tensor_get_dtype (m->embed), moe_tensor_get_data (m->embed), H, ids, rows, h);

  for (guint li = 0; li < m->layers; li++)
    {
      const Layer *L = &m->layer[li];
      /* Where only each sequence's last row makes logits, the last layer
       * after its keys and values runs on those rows alone: nothing reads
       * the other rows' output (each row's results are its own) */
      const gboolean last_rows = last_only && li + 1 == m->layers && rows > batch;

      rms_norm (m, h, rows, H, H, L->input_norm, x);
      if (m->family == FAMILY_DEEPSEEK_V3)
        attention_mla (m, cache, li, &st, last_rows, x, y);
      else
        attention_gqa (m, cache, li, &st, last_rows, x, y);
      if (last_rows)
        rows = keep_last_rows (h, batch, n_tokens, H);
      for (gsize i = 0; i < rows * H; i++)
        h[i] = moe_cpu_round_to (h[i] + y[i], m->dtype);

      rms_norm (m, h, rows, H, H, L->post_norm, x);
      if (L->is_moe)
        {
          if (!moe_block (m, L, x, rows, y, error))
            return FALSE;
        }
      else
        dense_mlp (m, L, x, rows, y);
      for (gsize i = 0; i < rows * H; i++)
        h[i] = moe_cpu_round_to (h[i] + y[i], m->dtype);
    }
  cache->length += n_tokens;

  {
    Linear head = { m->lm_head, NULL };

    if (last_only && rows != batch)
      rows = keep_last_rows (h, batch, n_tokens, H);   /* a model of no layers */
    rms_norm (m, h, rows, H, H, m->final_norm, x);
    linear (m, &head, x, rows, logits);
    if (tokens != NULL && sampling != NULL)
      _moe_sample_tokens (logits, batch, m->vocab, sampling, tokens);
    else if (tokens != NULL)
      for (gsize r = 0; r < rows; r++)
        tokens[r] = _moe_greedy_token (logits + r * m->vocab, m->vocab);
  }
  return TRUE;
}
