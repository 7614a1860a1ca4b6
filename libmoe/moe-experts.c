/* moe-experts.c: one MoE layer's expert weights and how to run them
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <string.h>

#include "moe-private.h"
#include "moe-cpu-kernels.h"

/**
 * MoeExperts:
 *
 * One MoE layer's experts: the fused `gate_up` (or `up`) and `down`
 * weights of every expert, their layout, and the name of the experts
 * backend that runs them. Usable on its own, like transformers' Experts
 * modules:
 *
 * |[<!-- language="Python" -->
 * experts = Moe.Experts.new(gate_up, down)        # [E, 2I, H], [E, H, I]
 * experts.props.implementation = "grouped_mm"
 * out = experts.forward(hidden, top_k_index, top_k_weights)
 * ]|
 *
 * Layouts: by default `up-weight` is `[E, 2I, H]` with the gate rows first
 * and `down-weight` is `[E, H, I]` (y = x·Wᵀ); with `is-transposed` they are
 * `[E, H, 2I]` and `[E, I, H]` (y = x·W). Without a gate (`has-gate` false)
 * `up-weight` holds I rows and the activation applies to it alone. Biases
 * are `[E, 2I]` (or `[E, I]`) and `[E, H]`.
 *
 * Quantized experts (untransposed layout): FP8 weights are F8E4M3 with
 * `up-weight-scale` `[E, ⌈2I/128⌉, ⌈H/128⌉]` and `down-weight-scale`
 * `[E, ⌈H/128⌉, ⌈I/128⌉]` (F32 or E8M0, one per 128×128 block); FP4
 * weights are I8 `[E, 2I, H/2]` and `[E, H, I/2]` holding two e2m1 codes
 * per byte (element 2j in the low nibble) with E8M0 scales `[E, 2I, H/32]`
 * and `[E, H, I/32]`. Each weight is its value × its scale (transformers'
 * `*_scale_inv`). The CPU backends run them with the activations quantized
 * dynamically (per token and 128-wide group to e4m3, scale amax / 448) and
 * float32 sums.
 */
struct _MoeExperts
{
  GObject        parent_instance;

  MoeTensor     *up_weight;
  MoeTensor     *down_weight;
  MoeTensor     *up_bias;
  MoeTensor     *down_bias;
  MoeTensor     *up_weight_scale;
  MoeTensor     *down_weight_scale;
  char          *activation;
  gboolean       has_gate;
  gboolean       is_transposed;
  MoeGateLayout  gate_layout;
  double         swiglu_alpha;
  double         swiglu_limit;
  char          *implementation;
  char          *device;
};

enum {
  PROP_0,
  PROP_UP_WEIGHT,
  PROP_DOWN_WEIGHT,
  PROP_UP_BIAS,
  PROP_DOWN_BIAS,
  PROP_UP_WEIGHT_SCALE,
  PROP_DOWN_WEIGHT_SCALE,
  PROP_EXPERT_DTYPE,
  PROP_ACTIVATION,
  PROP_HAS_GATE,
  PROP_IS_TRANSPOSED,
  PROP_GATE_LAYOUT,
  PROP_SWIGLU_ALPHA,
  PROP_SWIGLU_LIMIT,
  PROP_IMPLEMENTATION,
  PROP_DEVICE,
  PROP_NUM_EXPERTS,
  PROP_HIDDEN_SIZE,
  PROP_INTERMEDIATE_SIZE,
  N_PROPS
};

static GParamSpec *properties[N_PROPS];

G_DEFINE_FINAL_TYPE (MoeExperts, moe_experts, G_TYPE_OBJECT)

static void
moe_experts_finalize (GObject *object)
{
  MoeExperts *self = MOE_EXPERTS (object);

  g_clear_object (&self->up_weight);
  g_clear_object (&self->down_weight);
  g_clear_object (&self->up_bias);
  g_clear_object (&self->down_bias);
  g_clear_object (&self->up_weight_scale);
  g_clear_object (&self->down_weight_scale);
  g_free (self->activation);
  g_free (self->implementation);
  g_free (self->device);

  G_OBJECT_CLASS (moe_experts_parent_class)->finalize (object);
}

static void
moe_experts_get_property (GObject    *object,
                          guint       prop_id,
                          GValue     *value,
                          GParamSpec *pspec)
{
  MoeExperts *self = MOE_EXPERTS (object);

  switch (prop_id)
    {
    case PROP_UP_WEIGHT: g_value_set_object (value, self->up_weight); break;
    case PROP_DOWN_WEIGHT: g_value_set_object (value, self->down_weight); break;
    case PROP_UP_BIAS: g_value_set_object (value, self->up_bias); break;
    case PROP_DOWN_BIAS: g_value_set_object (value, self->down_bias); break;
    case PROP_UP_WEIGHT_SCALE: g_value_set_object (value, self->up_weight_scale); break;
    case PROP_DOWN_WEIGHT_SCALE: g_value_set_object (value, self->down_weight_scale); break;
    case PROP_EXPERT_DTYPE: g_value_set_string (value, moe_experts_get_expert_dtype (self)); break;
    case PROP_ACTIVATION: g_value_set_string (value, self->activation); break;
    case PROP_HAS_GATE: g_value_set_boolean (value, self->has_gate); break;
    case PROP_IS_TRANSPOSED: g_value_set_boolean (value, self->is_transposed); break;
    case PROP_GATE_LAYOUT: g_value_set_enum (value, self->gate_layout); break;
    case PROP_SWIGLU_ALPHA: g_value_set_double (value, self->swiglu_alpha); break;
    case PROP_SWIGLU_LIMIT: g_value_set_double (value, self->swiglu_limit); break;
    case PROP_IMPLEMENTATION: g_value_set_string (value, self->implementation); break;
    case PROP_DEVICE: g_value_set_string (value, self->device); break;
    case PROP_NUM_EXPERTS: g_value_set_uint (value, moe_experts_get_num_experts (self)); break;
    case PROP_HIDDEN_SIZE: g_value_set_uint (value, moe_experts_get_hidden_size (self)); break;
    case PROP_INTERMEDIATE_SIZE: g_value_set_uint (value, moe_experts_get_intermediate_size (self)); break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_experts_set_property (GObject      *object,
                          guint         prop_id,
                          const GValue *value,
                          GParamSpec   *pspec)
{
  MoeExperts *self = MOE_EXPERTS (object);

  switch (prop_id)
    {
    case PROP_UP_WEIGHT: g_set_object (&self->up_weight, g_value_get_object (value)); break;
    case PROP_DOWN_WEIGHT: g_set_object (&self->down_weight, g_value_get_object (value)); break;
    case PROP_UP_BIAS: moe_experts_set_up_bias (self, g_value_get_object (value)); break;
    case PROP_DOWN_BIAS: moe_experts_set_down_bias (self, g_value_get_object (value)); break;
    case PROP_UP_WEIGHT_SCALE: moe_experts_set_up_weight_scale (self, g_value_get_object (value)); break;
    case PROP_DOWN_WEIGHT_SCALE: moe_experts_set_down_weight_scale (self, g_value_get_object (value)); break;
    case PROP_ACTIVATION: moe_experts_set_activation (self, g_value_get_string (value)); break;
    case PROP_HAS_GATE: moe_experts_set_has_gate (self, g_value_get_boolean (value)); break;
    case PROP_IS_TRANSPOSED: moe_experts_set_is_transposed (self, g_value_get_boolean (value)); break;
    case PROP_GATE_LAYOUT: moe_experts_set_gate_layout (self, g_value_get_enum (value)); break;
    case PROP_SWIGLU_ALPHA: moe_experts_set_swiglu_alpha (self, g_value_get_double (value)); break;
    case PROP_SWIGLU_LIMIT: moe_experts_set_swiglu_limit (self, g_value_get_double (value)); break;
    case PROP_IMPLEMENTATION: moe_experts_set_implementation (self, g_value_get_string (value)); break;
    case PROP_DEVICE: moe_experts_set_device (self, g_value_get_string (value)); break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_experts_class_init (MoeExpertsClass *klass)
{
  GObjectClass *object_class = G_OBJECT_CLASS (klass);
  const GParamFlags rw = G_PARAM_READWRITE | G_PARAM_EXPLICIT_NOTIFY | G_PARAM_STATIC_STRINGS;
  const GParamFlags ro = G_PARAM_READABLE | G_PARAM_STATIC_STRINGS;

  object_class->finalize = moe_experts_finalize;
  object_class->get_property = moe_experts_get_property;
  object_class->set_property = moe_experts_set_property;

  /**
   * MoeExperts:up-weight: (getter get_up_weight)
   *
   * `gate_up` `[E, 2I, H]` (`[E, H, 2I]` transposed), or `up` `[E, I, H]`
   * without a gate.
   */
  properties[PROP_UP_WEIGHT] =
    g_param_spec_object ("up-weight", NULL, NULL, MOE_TYPE_TENSOR,
                         G_PARAM_READWRITE | G_PARAM_CONSTRUCT_ONLY | G_PARAM_STATIC_STRINGS);
  /**
   * MoeExperts:down-weight: (getter get_down_weight)
   *
   * `down` `[E, H, I]` (`[E, I, H]` transposed).
   */
  properties[PROP_DOWN_WEIGHT] =
    g_param_spec_object ("down-weight", NULL, NULL, MOE_TYPE_TENSOR,
                         G_PARAM_READWRITE | G_PARAM_CONSTRUCT_ONLY | G_PARAM_STATIC_STRINGS);
  /**
   * MoeExperts:up-bias: (getter get_up_bias) (setter set_up_bias)
   *
   * Optional `[E, 2I]` bias added after the up projection, before the
   * activation.
   */
  properties[PROP_UP_BIAS] =
    g_param_spec_object ("up-bias", NULL, NULL, MOE_TYPE_TENSOR, rw);
  /**
   * MoeExperts:down-bias: (getter get_down_bias) (setter set_down_bias)
   *
   * Optional `[E, H]` bias added after the down projection.
   */
  properties[PROP_DOWN_BIAS] =
    g_param_spec_object ("down-bias", NULL, NULL, MOE_TYPE_TENSOR, rw);
  /**
   * MoeExperts:up-weight-scale: (getter get_up_weight_scale) (setter set_up_weight_scale)
   *
   * The dequantization scales of a quantized `up-weight` (F32 or E8M0):
   * FP8 `[E, ⌈2I/128⌉, ⌈H/128⌉]`, FP4 `[E, 2I, H/32]`.
   */
  properties[PROP_UP_WEIGHT_SCALE] =
    g_param_spec_object ("up-weight-scale", NULL, NULL, MOE_TYPE_TENSOR, rw);
  /**
   * MoeExperts:down-weight-scale: (getter get_down_weight_scale) (setter set_down_weight_scale)
   *
   * The dequantization scales of a quantized `down-weight`: FP8
   * `[E, ⌈H/128⌉, ⌈I/128⌉]`, FP4 `[E, H, I/32]`.
   */
  properties[PROP_DOWN_WEIGHT_SCALE] =
    g_param_spec_object ("down-weight-scale", NULL, NULL, MOE_TYPE_TENSOR, rw);
  /**
   * MoeExperts:expert-dtype: (getter get_expert_dtype)
   *
   * What the expert weights hold: "fp8" (F8E4M3), "fp4" (I8, packed
   * e2m1), or the dtype of plain weights ("f32", "bf16", "f16").
   */
  properties[PROP_EXPERT_DTYPE] =
    g_param_spec_string ("expert-dtype", NULL, NULL, NULL, ro);
  /**
   * MoeExperts:activation: (getter get_activation) (setter set_activation)
   *
   * "silu", "gelu" (erf), "gelu_pytorch_tanh" or "relu".
   */
  properties[PROP_ACTIVATION] =
    g_param_spec_string ("activation", NULL, NULL, "silu", rw);
  /**
   * MoeExperts:has-gate: (getter get_has_gate) (setter set_has_gate)
   *
   * %FALSE for ungated experts: `down(act(up(x)))`.
   */
  properties[PROP_HAS_GATE] =
    g_param_spec_boolean ("has-gate", NULL, NULL, TRUE, rw);
  /**
   * MoeExperts:is-transposed: (getter get_is_transposed) (setter set_is_transposed)
   *
   * %TRUE when the weights are stored `[E, in, out]` (y = x·W), as GPT-OSS does.
   */
  properties[PROP_IS_TRANSPOSED] =
    g_param_spec_boolean ("is-transposed", NULL, NULL, FALSE, rw);
  /**
   * MoeExperts:gate-layout: (getter get_gate_layout) (setter set_gate_layout)
   *
   * How gate and up share the fused weight; interleaved means GPT-OSS's
   * clamped SwiGLU.
   */
  properties[PROP_GATE_LAYOUT] =
    g_param_spec_enum ("gate-layout", NULL, NULL, MOE_TYPE_GATE_LAYOUT,
                       MOE_GATE_LAYOUT_CONCATENATED, rw);
  /**
   * MoeExperts:swiglu-alpha: (getter get_swiglu_alpha) (setter set_swiglu_alpha)
   *
   * The clamped SwiGLU's alpha (interleaved layout only).
   */
  properties[PROP_SWIGLU_ALPHA] =
    g_param_spec_double ("swiglu-alpha", NULL, NULL, -G_MAXDOUBLE, G_MAXDOUBLE, 1.702, rw);
  /**
   * MoeExperts:swiglu-limit: (getter get_swiglu_limit) (setter set_swiglu_limit)
   *
   * The clamped SwiGLU's limit (interleaved layout only).
   */
  properties[PROP_SWIGLU_LIMIT] =
    g_param_spec_double ("swiglu-limit", NULL, NULL, 0.0, G_MAXDOUBLE, 7.0, rw);
  /**
   * MoeExperts:implementation: (getter get_implementation) (setter set_implementation)
   *
   * The experts backend that [method@Experts.forward] runs. An unknown
   * name is reported by the next forward, with the list of valid names.
   */
  properties[PROP_IMPLEMENTATION] =
    g_param_spec_string ("implementation", NULL, NULL, "grouped_mm", rw);
  /**
   * MoeExperts:device: (getter get_device) (setter set_device)
   *
   * The device the experts run on. The weights must live there.
   */
  properties[PROP_DEVICE] =
    g_param_spec_string ("device", NULL, NULL, "cpu", rw);
  /**
   * MoeExperts:num-experts: (getter get_num_experts)
   *
   * E, the number of experts held.
   */
  properties[PROP_NUM_EXPERTS] =
    g_param_spec_uint ("num-experts", NULL, NULL, 0, G_MAXUINT, 0, ro);
  /**
   * MoeExperts:hidden-size: (getter get_hidden_size)
   *
   * H, the model's hidden size.
   */
  properties[PROP_HIDDEN_SIZE] =
    g_param_spec_uint ("hidden-size", NULL, NULL, 0, G_MAXUINT, 0, ro);
  /**
   * MoeExperts:intermediate-size: (getter get_intermediate_size)
   *
   * I, each expert's intermediate size.
   */
  properties[PROP_INTERMEDIATE_SIZE] =
    g_param_spec_uint ("intermediate-size", NULL, NULL, 0, G_MAXUINT, 0, ro);

  g_object_class_install_properties (object_class, N_PROPS, properties);
}

static void
moe_experts_init (MoeExperts *self)
{
  self->activation = g_strdup ("silu");
  self->has_gate = TRUE;
  self->gate_layout = MOE_GATE_LAYOUT_CONCATENATED;
  self->swiglu_alpha = 1.702;
  self->swiglu_limit = 7.0;
  self->implementation = g_strdup ("grouped_mm");
  self->device = g_strdup ("cpu");
}

/**
 * moe_experts_new:
 * @up_weight: `gate_up` `[E, 2I, H]`, or `up` `[E, I, H]` for ungated experts
 * @down_weight: `down` `[E, H, I]`
 *
 * Creates experts with the default layout (set `is-transposed`,
 * `has-gate` and `gate-layout` for the others). Shapes are checked by
 * [method@Experts.validate] and by every forward.
 *
 * Returns: (transfer full): new experts
 */
MoeExperts *
moe_experts_new (MoeTensor *up_weight,
                 MoeTensor *down_weight)
{
  g_return_val_if_fail (MOE_IS_TENSOR (up_weight), NULL);
  g_return_val_if_fail (MOE_IS_TENSOR (down_weight), NULL);

  return g_object_new (MOE_TYPE_EXPERTS,
                       "up-weight", up_weight,
                       "down-weight", down_weight,
                       NULL);
}

/**
 * moe_experts_to_device:
 * @self: experts
 * @device: a device name, such as "cuda"
 * @error: return location for a #GError
 *
 * A copy of @self whose weights, biases and scales live on @device and
 * whose [property@Experts:device] is @device, as torch's `module.to()`.
 * Every other property is copied as it is.
 *
 * Returns: (transfer full): the copy, or %NULL with @error set (no such
 *   device, or out of device memory)
 */
MoeExperts *
moe_experts_to_device (MoeExperts  *self,
                       const char  *device,
                       GError     **error)
{
  g_autofree GParamSpec **specs = NULL;
  g_autoptr(GArray) values = g_array_new (FALSE, TRUE, sizeof (GValue));
  g_autoptr(GPtrArray) names = g_ptr_array_new ();
  MoeDevice *dev;
  guint n;

  g_return_val_if_fail (MOE_IS_EXPERTS (self), NULL);
  g_return_val_if_fail (device != NULL, NULL);

  dev = moe_device_get_for_name (device, error);
  if (dev == NULL)
    return NULL;
  g_array_set_clear_func (values, (GDestroyNotify) g_value_unset);

  /* every writable property, tensors moved: one list, so that a property
   * added later is copied too */
  specs = g_object_class_list_properties (G_OBJECT_GET_CLASS (self), &n);
  for (guint i = 0; i < n; i++)
    {
      GValue v = G_VALUE_INIT;

      if (!(specs[i]->flags & G_PARAM_WRITABLE) || g_str_equal (specs[i]->name, "device"))
        continue;
      g_value_init (&v, specs[i]->value_type);
      g_object_get_property (G_OBJECT (self), specs[i]->name, &v);
      if (specs[i]->value_type == MOE_TYPE_TENSOR && g_value_get_object (&v) != NULL)
        {
          MoeTensor *moved = moe_tensor_to_device (g_value_get_object (&v), dev, error);
          if (moved == NULL)
            {
              g_value_unset (&v);
              return NULL;
            }
          g_value_take_object (&v, moved);
        }
      g_ptr_array_add (names, (gpointer) specs[i]->name);
      g_array_append_val (values, v);
    }
  g_ptr_array_add (names, (gpointer) "device");
  {
    GValue v = G_VALUE_INIT;
    g_value_init (&v, G_TYPE_STRING);
    g_value_set_string (&v, device);
    g_array_append_val (values, v);
  }
  return MOE_EXPERTS (g_object_new_with_properties (MOE_TYPE_EXPERTS, names->len,
                                                    (const char **) names->pdata,
                                                    (const GValue *) values->data));
}

#define DEFINE_TENSOR_ACCESSORS(field, prop)                                   \
  MoeTensor *moe_experts_get_##field (MoeExperts *self)                        \
  {                                                                            \
    g_return_val_if_fail (MOE_IS_EXPERTS (self), NULL);                        \
    return self->field;                                                        \
  }

/**
 * moe_experts_get_up_weight:
 * @self: experts
 *
 * Returns: (transfer none): the `gate_up` or `up` weight
 */
DEFINE_TENSOR_ACCESSORS (up_weight, PROP_UP_WEIGHT)
/**
 * moe_experts_get_down_weight:
 * @self: experts
 *
 * Returns: (transfer none): the `down` weight
 */
DEFINE_TENSOR_ACCESSORS (down_weight, PROP_DOWN_WEIGHT)
/**
 * moe_experts_get_up_bias:
 * @self: experts
 *
 * Returns: (transfer none) (nullable): the up bias
 */
DEFINE_TENSOR_ACCESSORS (up_bias, PROP_UP_BIAS)
/**
 * moe_experts_get_down_bias:
 * @self: experts
 *
 * Returns: (transfer none) (nullable): the down bias
 */
DEFINE_TENSOR_ACCESSORS (down_bias, PROP_DOWN_BIAS)
/**
 * moe_experts_get_up_weight_scale:
 * @self: experts
 *
 * Returns: (transfer none) (nullable): the up weight's dequantization scales
 */
DEFINE_TENSOR_ACCESSORS (up_weight_scale, PROP_UP_WEIGHT_SCALE)
/**
 * moe_experts_get_down_weight_scale:
 * @self: experts
 *
 * Returns: (transfer none) (nullable): the down weight's dequantization scales
 */
DEFINE_TENSOR_ACCESSORS (down_weight_scale, PROP_DOWN_WEIGHT_SCALE)

/**
 * moe_experts_set_up_weight_scale:
 * @self: experts
 * @scale: (nullable): the up weight's dequantization scales
 */
void
moe_experts_set_up_weight_scale (MoeExperts *self,
                                 MoeTensor  *scale)
{
  g_return_if_fail (MOE_IS_EXPERTS (self));
  if (g_set_object (&self->up_weight_scale, scale))
    g_object_notify_by_pspec (G_OBJECT (self), properties[PROP_UP_WEIGHT_SCALE]);
}

/**
 * moe_experts_set_down_weight_scale:
 * @self: experts
 * @scale: (nullable): the down weight's dequantization scales
 */
void
moe_experts_set_down_weight_scale (MoeExperts *self,
                                   MoeTensor  *scale)
{
  g_return_if_fail (MOE_IS_EXPERTS (self));
  if (g_set_object (&self->down_weight_scale, scale))
    g_object_notify_by_pspec (G_OBJECT (self), properties[PROP_DOWN_WEIGHT_SCALE]);
}

/**
 * moe_experts_get_expert_dtype:
 * @self: experts
 *
 * Returns: (nullable): "fp8", "fp4", or the plain weights' dtype in lower
 *   case ("f32", "bf16", "f16"); %NULL without weights
 */
const char *
moe_experts_get_expert_dtype (MoeExperts *self)
{
  MoeDType d;

  g_return_val_if_fail (MOE_IS_EXPERTS (self), NULL);
  if (self->up_weight == NULL)
    return NULL;
  d = moe_tensor_get_dtype (self->up_weight);
  switch (d)
    {
    case MOE_DTYPE_F8E4M3: return "fp8";
    case MOE_DTYPE_I8: return "fp4";
    case MOE_DTYPE_F32: return "f32";
    case MOE_DTYPE_BF16: return "bf16";
    case MOE_DTYPE_F16: return "f16";
    default: return g_intern_string (moe_dtype_get_name (d));
    }
}

/**
 * moe_experts_set_up_bias:
 * @self: experts
 * @bias: (nullable): `[E, 2I]` (or `[E, I]` ungated), or %NULL for none
 */
void
moe_experts_set_up_bias (MoeExperts *self,
                         MoeTensor  *bias)
{
  g_return_if_fail (MOE_IS_EXPERTS (self));
  if (g_set_object (&self->up_bias, bias))
    g_object_notify_by_pspec (G_OBJECT (self), properties[PROP_UP_BIAS]);
}

/**
 * moe_experts_set_down_bias:
 * @self: experts
 * @bias: (nullable): `[E, H]`, or %NULL for none
 */
void
moe_experts_set_down_bias (MoeExperts *self,
                           MoeTensor  *bias)
{
  g_return_if_fail (MOE_IS_EXPERTS (self));
  if (g_set_object (&self->down_bias, bias))
    g_object_notify_by_pspec (G_OBJECT (self), properties[PROP_DOWN_BIAS]);
}

static gboolean
replace_str (char       **field,
             const char  *value)
{
  if (g_strcmp0 (*field, value) == 0)
    return FALSE;
  g_free (*field);
  *field = g_strdup (value);
  return TRUE;
}

#define DEFINE_STRING_ACCESSORS(field, prop, fallback)                         \
  const char *moe_experts_get_##field (MoeExperts *self)                       \
  {                                                                            \
    g_return_val_if_fail (MOE_IS_EXPERTS (self), NULL);                        \
    return self->field;                                                        \
  }                                                                            \
  void moe_experts_set_##field (MoeExperts *self, const char *value)           \
  {                                                                            \
    g_return_if_fail (MOE_IS_EXPERTS (self));                                  \
    if (value == NULL)                                                         \
      value = fallback;                                                        \
    if (replace_str (&self->field, value))                                       \
      g_object_notify_by_pspec (G_OBJECT (self), properties[prop]);            \
  }

/**
 * moe_experts_get_activation:
 * @self: experts
 *
 * Returns: the activation's name
 */
/**
 * moe_experts_set_activation:
 * @self: experts
 * @activation: (nullable): "silu", "gelu", "gelu_pytorch_tanh" or "relu";
 *   %NULL for "silu"
 */
DEFINE_STRING_ACCESSORS (activation, PROP_ACTIVATION, "silu")
/**
 * moe_experts_get_implementation:
 * @self: experts
 *
 * Returns: the experts backend's name
 */
/**
 * moe_experts_set_implementation:
 * @self: experts
 * @implementation: (nullable): a backend name; %NULL for "grouped_mm"
 */
DEFINE_STRING_ACCESSORS (implementation, PROP_IMPLEMENTATION, "grouped_mm")
/**
 * moe_experts_get_device:
 * @self: experts
 *
 * Returns: the device's name
 */
/**
 * moe_experts_set_device:
 * @self: experts
 * @device: (nullable): a device name; %NULL for "cpu"
 */
DEFINE_STRING_ACCESSORS (device, PROP_DEVICE, "cpu")

#define DEFINE_VALUE_ACCESSORS(type, field, prop)                              \
  type moe_experts_get_##field (MoeExperts *self)                              \
  {                                                                            \
    g_return_val_if_fail (MOE_IS_EXPERTS (self), 0);                           \
    return self->field;                                                        \
  }                                                                            \
  void moe_experts_set_##field (MoeExperts *self, type value)                  \
  {                                                                            \
    g_return_if_fail (MOE_IS_EXPERTS (self));                                  \
    if (self->field == value)                                                  \
      return;                                                                  \
    self->field = value;                                                       \
    g_object_notify_by_pspec (G_OBJECT (self), properties[prop]);              \
  }

/**
 * moe_experts_get_has_gate:
 * @self: experts
 *
 * Returns: whether the experts are gated
 */
/**
 * moe_experts_set_has_gate:
 * @self: experts
 * @has_gate: %FALSE for `act(up(x))`
 */
DEFINE_VALUE_ACCESSORS (gboolean, has_gate, PROP_HAS_GATE)
/**
 * moe_experts_get_is_transposed:
 * @self: experts
 *
 * Returns: whether the weights are stored `[E, in, out]`
 */
/**
 * moe_experts_set_is_transposed:
 * @self: experts
 * @is_transposed: %TRUE for `[E, in, out]` storage
 */
DEFINE_VALUE_ACCESSORS (gboolean, is_transposed, PROP_IS_TRANSPOSED)
/**
 * moe_experts_get_gate_layout:
 * @self: experts
 *
 * Returns: the gate layout
 */
/**
 * moe_experts_set_gate_layout:
 * @self: experts
 * @layout: the gate layout
 */
DEFINE_VALUE_ACCESSORS (MoeGateLayout, gate_layout, PROP_GATE_LAYOUT)
/**
 * moe_experts_get_swiglu_alpha:
 * @self: experts
 *
 * Returns: the clamped SwiGLU's alpha
 */
/**
 * moe_experts_set_swiglu_alpha:
 * @self: experts
 * @alpha: the clamped SwiGLU's alpha
 */
DEFINE_VALUE_ACCESSORS (double, swiglu_alpha, PROP_SWIGLU_ALPHA)
/**
 * moe_experts_get_swiglu_limit:
 * @self: experts
 *
 * Returns: the clamped SwiGLU's limit
 */
/**
 * moe_experts_set_swiglu_limit:
 * @self: experts
 * @limit: the clamped SwiGLU's limit
 */
DEFINE_VALUE_ACCESSORS (double, swiglu_limit, PROP_SWIGLU_LIMIT)

/**
 * moe_experts_get_num_experts:
 * @self: experts
 *
 * Returns: E, or 0 if the weights are not 3-D
 */
guint
moe_experts_get_num_experts (MoeExperts *self)
{
  g_return_val_if_fail (MOE_IS_EXPERTS (self), 0);
  if (self->up_weight == NULL || moe_tensor_get_n_dims (self->up_weight) != 3)
    return 0;
  return (guint) moe_tensor_get_dim (self->up_weight, 0);
}

/**
 * moe_experts_get_hidden_size:
 * @self: experts
 *
 * Returns: H, or 0 if the down weight is not 3-D
 */
guint
moe_experts_get_hidden_size (MoeExperts *self)
{
  g_return_val_if_fail (MOE_IS_EXPERTS (self), 0);
  if (self->down_weight == NULL || moe_tensor_get_n_dims (self->down_weight) != 3)
    return 0;
  return (guint) moe_tensor_get_dim (self->down_weight, self->is_transposed ? 2 : 1);
}

/**
 * moe_experts_get_intermediate_size:
 * @self: experts
 *
 * Returns: I, or 0 if the down weight is not 3-D
 */
guint
moe_experts_get_intermediate_size (MoeExperts *self)
{
  g_return_val_if_fail (MOE_IS_EXPERTS (self), 0);
  if (self->down_weight == NULL || moe_tensor_get_n_dims (self->down_weight) != 3)
    return 0;
  /* FP4 packs two values per byte along the input axis */
  if (moe_tensor_get_dtype (self->down_weight) == MOE_DTYPE_I8 && !self->is_transposed)
    return 2 * (guint) moe_tensor_get_dim (self->down_weight, 2);
  return (guint) moe_tensor_get_dim (self->down_weight, self->is_transposed ? 1 : 2);
}

static gboolean
check_weight_dtype (MoeTensor   *t,
                    const char  *what,
                    GError     **error)
{
  MoeDType d = moe_tensor_get_dtype (t);

  if (d == MOE_DTYPE_F32 || d == MOE_DTYPE_BF16 || d == MOE_DTYPE_F16)
    return TRUE;
  g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
               "The experts' %s is %s; expected F32, BF16 or F16", what, moe_dtype_get_name (d));
  return FALSE;
}

static gboolean
check_shape (MoeTensor    *t,
             const char   *what,
             const gint64 *shape,
             guint         n_dims,
             const char   *layout,
             GError      **error)
{
  g_autofree char *have = NULL;
  GString *want;

  if (moe_tensor_has_shape (t, shape, n_dims))
    return TRUE;

  have = moe_tensor_to_string (t);
  want = g_string_new ("[");
  for (guint i = 0; i < n_dims; i++)
    g_string_append_printf (want, "%s%" G_GINT64_FORMAT, i ? ", " : "", shape[i]);
  g_string_append_c (want, ']');
  g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
               "The experts' %s is %s; expected %s (%s)", what, have, want->str, layout);
  g_string_free (want, TRUE);
  return FALSE;
}

/* Plain weights (F32/BF16/F16, any mix), or FP8 or FP4 weights on both
 * projections with their scales, untransposed. */
static gboolean
check_weights_format (MoeExperts  *self,
                      GError     **error)
{
  MoeDType up = moe_tensor_get_dtype (self->up_weight), down = moe_tensor_get_dtype (self->down_weight);

  if (!_moe_dtype_is_quantized_weight (up) && !_moe_dtype_is_quantized_weight (down))
    {
      const char *which = self->up_weight_scale != NULL ? "up-weight-scale" : "down-weight-scale";
      if (!check_weight_dtype (self->up_weight, "up-weight", error) ||
          !check_weight_dtype (self->down_weight, "down-weight", error))
        return FALSE;
      if (self->up_weight_scale != NULL || self->down_weight_scale != NULL)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                       "The experts' %s is set but their weights are %s: scales belong to FP8 "
                       "(F8E4M3) or FP4 (I8) weights", which, moe_dtype_get_name (up));
          return FALSE;
        }
      return TRUE;
    }
  if (up != down)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "The experts' up-weight is %s and down-weight %s; quantized experts need both "
                   "F8E4M3 (FP8) or both I8 (FP4)", moe_dtype_get_name (up), moe_dtype_get_name (down));
      return FALSE;
    }
  if (self->is_transposed)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "Quantized experts are stored [E, out, in]; is-transposed must be false");
      return FALSE;
    }
  if (self->up_weight_scale == NULL || self->down_weight_scale == NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "%s experts need up-weight-scale and down-weight-scale (the checkpoint's *_scale_inv)",
                   up == MOE_DTYPE_I8 ? "FP4" : "FP8");
      return FALSE;
    }
  return TRUE;
}

static gboolean
check_one_scale (MoeTensor    *scale,
                 const char   *what,
                 MoeDType      weight_dtype,
                 const gint64 *shape,
                 const gint64 *alt_shape,
                 GError      **error)
{
  MoeDType d = moe_tensor_get_dtype (scale);

  if (weight_dtype == MOE_DTYPE_I8 ? d != MOE_DTYPE_E8M0 : (d != MOE_DTYPE_F32 && d != MOE_DTYPE_E8M0))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH, "The experts' %s is %s; expected %s",
                   what, moe_dtype_get_name (d), weight_dtype == MOE_DTYPE_I8 ? "E8M0 (F8_E8M0)" : "F32 or E8M0 (F8_E8M0)");
      return FALSE;
    }
  if (alt_shape != NULL && moe_tensor_has_shape (scale, alt_shape, 3))
    return TRUE;
  return check_shape (scale, what, shape, 3,
                      weight_dtype == MOE_DTYPE_I8 ? "FP4: one scale per row and 32 inputs"
                                                   : "FP8: one scale per 128×128 block", error);
}

static gboolean
check_scales (MoeExperts  *self,
              gint64       E,
              gint64       H,
              gint64       I,
              gint64       up_out,
              GError     **error)
{
  MoeDType w = moe_tensor_get_dtype (self->up_weight);

  if (!_moe_dtype_is_quantized_weight (w))
    return TRUE;
  if (w == MOE_DTYPE_I8)
    {
      gint64 us[3] = { E, up_out, H / 32 }, ds[3] = { E, H, I / 32 };
      if (H % 32 != 0 || I % 32 != 0)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                       "FP4 experts need H and I multiples of 32 (one scale per 32 inputs); H=%"
                       G_GINT64_FORMAT ", I=%" G_GINT64_FORMAT, H, I);
          return FALSE;
        }
      return check_one_scale (self->up_weight_scale, "up-weight-scale", w, us, NULL, error) &&
             check_one_scale (self->down_weight_scale, "down-weight-scale", w, ds, NULL, error);
    }
  {
    gint64 us[3] = { E, (up_out + 127) / 128, (H + 127) / 128 };
    gint64 ds[3] = { E, (H + 127) / 128, (I + 127) / 128 };
    /* or gate and up scaled as two matrices (fused per-expert checkpoint
     * scales; newer transformers' two rows when 2I < 128) */
    gint64 us2[3] = { E, 2 * ((I + 127) / 128), (H + 127) / 128 };
    return check_one_scale (self->up_weight_scale, "up-weight-scale", w, us,
                            self->has_gate ? us2 : NULL, error) &&
           check_one_scale (self->down_weight_scale, "down-weight-scale", w, ds, NULL, error);
  }
}

/**
 * moe_experts_validate:
 * @self: experts
 * @error: return location for a #GError
 *
 * Checks that weights, biases, layout flags and activation agree.
 *
 * Returns: %TRUE if the experts can run
 */
gboolean
moe_experts_validate (MoeExperts  *self,
                      GError     **error)
{
  MoeCpuActivation act;
  gint64 E, H, I, up_out;
  const char *layout;

  g_return_val_if_fail (MOE_IS_EXPERTS (self), FALSE);

  if (self->up_weight == NULL || self->down_weight == NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "The experts need both an up-weight and a down-weight");
      return FALSE;
    }
  if (moe_tensor_get_n_dims (self->up_weight) != 3 || moe_tensor_get_n_dims (self->down_weight) != 3)
    {
      g_autofree char *u = moe_tensor_to_string (self->up_weight);
      g_autofree char *d = moe_tensor_to_string (self->down_weight);
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "The experts' weights must be 3-D [E, out, in] (or [E, in, out] transposed); got up %s, down %s",
                   u, d);
      return FALSE;
    }
  if (!check_weights_format (self, error))
    return FALSE;

  E = moe_tensor_get_dim (self->up_weight, 0);
  H = moe_experts_get_hidden_size (self);
  I = moe_experts_get_intermediate_size (self);
  up_out = self->has_gate ? 2 * I : I;
  if (E <= 0 || H <= 0 || I <= 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "The experts' dimensions must be positive (E=%" G_GINT64_FORMAT ", H=%"
                   G_GINT64_FORMAT ", I=%" G_GINT64_FORMAT ")", E, H, I);
      return FALSE;
    }

  layout = self->is_transposed
    ? (self->has_gate ? "transposed: up [E, H, 2I], down [E, I, H]" : "transposed, ungated: up [E, H, I], down [E, I, H]")
    : (self->has_gate ? "up [E, 2I, H], down [E, H, I]" : "ungated: up [E, I, H], down [E, H, I]");
  if (moe_tensor_get_dtype (self->up_weight) == MOE_DTYPE_I8)
    layout = self->has_gate ? "FP4: up [E, 2I, H/2], down [E, H, I/2]" : "FP4, ungated: up [E, I, H/2], down [E, H, I/2]";
  {
    gint64 up_in = moe_tensor_get_dtype (self->up_weight) == MOE_DTYPE_I8 ? H / 2 : H;
    gint64 up_shape[3] = { E, self->is_transposed ? H : up_out, self->is_transposed ? up_out : up_in };
    if (!check_shape (self->up_weight, "up-weight", up_shape, 3, layout, error))
      return FALSE;
  }
  if (!check_scales (self, E, H, I, up_out, error))
    return FALSE;
  if (self->up_bias != NULL)
    {
      gint64 s[2] = { E, up_out };
      if (!check_shape (self->up_bias, "up-bias", s, 2, "[E, up features]", error) ||
          !check_weight_dtype (self->up_bias, "up-bias", error))
        return FALSE;
    }
  if (self->down_bias != NULL)
    {
      gint64 s[2] = { E, H };
      if (!check_shape (self->down_bias, "down-bias", s, 2, "[E, H]", error) ||
          !check_weight_dtype (self->down_bias, "down-bias", error))
        return FALSE;
    }
  if (!moe_cpu_activation_from_name (self->activation, &act))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "Unknown activation “%s”; valid: silu, gelu, gelu_pytorch_tanh, relu",
                   self->activation);
      return FALSE;
    }
  if (self->gate_layout == MOE_GATE_LAYOUT_INTERLEAVED && !self->has_gate)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "An interleaved gate layout needs gated experts (has-gate is false)");
      return FALSE;
    }

  {
    MoeDevice *dev = moe_tensor_get_device (self->up_weight);
    MoeTensor *others[] = { self->down_weight, self->up_bias, self->down_bias, self->up_weight_scale, self->down_weight_scale };
    for (guint i = 0; i < G_N_ELEMENTS (others); i++)
      if (others[i] != NULL && moe_tensor_get_device (others[i]) != dev)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                       "The experts' tensors live on different devices");
          return FALSE;
        }
  }
  return TRUE;
}

gboolean
_moe_experts_check_inputs (MoeExperts  *self,
                           MoeTensor   *hidden_states,
                           MoeTensor   *top_k_index,
                           MoeTensor   *top_k_weights,
                           MoeTensor  **index_out,
                           GError     **error)
{
  g_autoptr(MoeTensor) index = NULL;
  g_autoptr(GBytes) host = NULL;
  MoeDType hd = moe_tensor_get_dtype (hidden_states);
  MoeDType wd = moe_tensor_get_dtype (top_k_weights);
  MoeDType id = moe_tensor_get_dtype (top_k_index);
  gint64 T, K, E, H;
  const gint64 *ids;

  if (!moe_experts_validate (self, error))
    return FALSE;

  E = moe_experts_get_num_experts (self);
  H = moe_experts_get_hidden_size (self);

  if (moe_tensor_get_n_dims (hidden_states) != 2 || moe_tensor_get_dim (hidden_states, 1) != H)
    {
      g_autofree char *s = moe_tensor_to_string (hidden_states);
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "hidden_states is %s; expected [T, %" G_GINT64_FORMAT "]", s, H);
      return FALSE;
    }
  if (hd != MOE_DTYPE_F32 && hd != MOE_DTYPE_BF16 && hd != MOE_DTYPE_F16)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "hidden_states is %s; expected F32, BF16 or F16", moe_dtype_get_name (hd));
      return FALSE;
    }
  T = moe_tensor_get_dim (hidden_states, 0);

  if (moe_tensor_get_n_dims (top_k_index) != 2 || moe_tensor_get_dim (top_k_index, 0) != T ||
      moe_tensor_get_dim (top_k_index, 1) < 1)
    {
      g_autofree char *s = moe_tensor_to_string (top_k_index);
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "top_k_index is %s; expected [%" G_GINT64_FORMAT ", K] with K ≥ 1", s, T);
      return FALSE;
    }
  K = moe_tensor_get_dim (top_k_index, 1);
  if (id != MOE_DTYPE_I64 && id != MOE_DTYPE_I32)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "top_k_index is %s; expected I64 or I32", moe_dtype_get_name (id));
      return FALSE;
    }
  {
    gint64 s[2] = { T, K };
    if (!moe_tensor_has_shape (top_k_weights, s, 2))
      {
        g_autofree char *d = moe_tensor_to_string (top_k_weights);
        g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                     "top_k_weights is %s; expected [%" G_GINT64_FORMAT ", %" G_GINT64_FORMAT "] like top_k_index",
                     d, T, K);
        return FALSE;
      }
  }
  if (wd != MOE_DTYPE_F32 && wd != MOE_DTYPE_BF16 && wd != MOE_DTYPE_F16)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "top_k_weights is %s; expected F32, BF16 or F16", moe_dtype_get_name (wd));
      return FALSE;
    }
  {
    MoeDevice *dev = moe_tensor_get_device (moe_experts_get_up_weight (self));
    if (moe_tensor_get_device (hidden_states) != dev || moe_tensor_get_device (top_k_weights) != dev)
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                     "hidden_states and top_k_weights must live on the experts' device “%s”",
                     moe_device_get_name (dev));
        return FALSE;
      }
  }

  /* I64 ids on a device are checked there, as the kernels run, so that a
   * forward never waits for the device (see moe_experts_forward()). */
  if (id == MOE_DTYPE_I64 && !moe_device_is_cpu (moe_tensor_get_device (top_k_index)))
    {
      *index_out = g_object_ref (top_k_index);
      return TRUE;
    }

  /* Elsewhere on the host: a bad id would read out of bounds. */
  host = moe_tensor_dup_bytes (top_k_index, error);
  if (host == NULL)
    return FALSE;
  if (id == MOE_DTYPE_I64)
    index = g_object_ref (top_k_index);
  else
    {
      gint64 s[2] = { T, K };
      const gint32 *src = g_bytes_get_data (host, NULL);
      gint64 *dst;
      index = moe_tensor_new_empty (NULL, MOE_DTYPE_I64, s, 2, error);
      if (index == NULL)
        return FALSE;
      dst = moe_tensor_get_mutable_data (index);
      for (gint64 i = 0; i < T * K; i++)
        dst[i] = src[i];
      g_clear_pointer (&host, g_bytes_unref);
      host = moe_tensor_dup_bytes (index, error);
    }
  ids = g_bytes_get_data (host, NULL);
  for (gint64 i = 0; i < T * K; i++)
    if (ids[i] < 0 || ids[i] > E)
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                     "top_k_index[%" G_GINT64_FORMAT ", %" G_GINT64_FORMAT "] is %" G_GINT64_FORMAT
                     "; valid expert ids are 0…%" G_GINT64_FORMAT ", and %" G_GINT64_FORMAT
                     " for a slot that contributes nothing",
                     i / K, i % K, ids[i], E - 1, E);
        return FALSE;
      }

  *index_out = g_steal_pointer (&index);
  return TRUE;
}

/**
 * moe_experts_forward:
 * @self: experts
 * @hidden_states: `[T, H]` (F32, BF16 or F16)
 * @top_k_index: `[T, K]` expert ids (I64 or I32); the id E marks an
 *   expert-parallel slot this rank does not own, which contributes nothing
 * @top_k_weights: `[T, K]` routing weights
 * @error: return location for a #GError
 *
 * Runs the experts through the backend named by `implementation`:
 * `out[t] = Σ_k w[t,k] · down_e(act(gate_e(x[t])) · up_e(x[t]))` with
 * `e = top_k_index[t,k]`.
 *
 * On a device other than the CPU the work is queued and this returns
 * without waiting for it. I64 ids living on such a device are then checked
 * by the device itself: a bad id leaves its slot out and makes the next
 * call that waits for the device (reading a result, such as
 * moe_tensor_dup_bytes(), or moe_device_synchronize()) fail with
 * %MOE_ERROR_INVALID_ARGUMENT naming it. Ids on the CPU are checked before
 * anything runs.
 *
 * Returns: (transfer full): `[T, H]` in the dtype of @hidden_states
 */
MoeTensor *
moe_experts_forward (MoeExperts  *self,
                     MoeTensor   *hidden_states,
                     MoeTensor   *top_k_index,
                     MoeTensor   *top_k_weights,
                     GError     **error)
{
  MoeExpertsBackend *backend;
  MoeDevice *device;

  g_return_val_if_fail (MOE_IS_EXPERTS (self), NULL);

  device = moe_device_get_for_name (self->device, error);
  if (device == NULL)
    return NULL;
  if (self->up_weight != NULL && moe_tensor_get_device (self->up_weight) != device)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "The experts' device is “%s” but their weights live on “%s”",
                   self->device, moe_device_get_name (moe_tensor_get_device (self->up_weight)));
      return NULL;
    }

  backend = moe_plugin_registry_get_backend (moe_plugin_registry_get_default (),
                                             self->implementation, error);
  if (backend == NULL)
    return NULL;
  return moe_experts_backend_forward (backend, self, hidden_states, top_k_index, top_k_weights, error);
}

/**
 * moe_experts_get_backend_data: (skip)
 * @self: experts
 * @backend: the backend asking
 *
 * Returns: (nullable): what @backend stored with moe_experts_set_backend_data()
 */
gpointer
moe_experts_get_backend_data (MoeExperts        *self,
                              MoeExpertsBackend *backend)
{
  g_autofree char *key = g_strdup_printf ("moe-backend-data-%p", (gpointer) backend);
  return g_object_get_data (G_OBJECT (self), key);
}

/**
 * moe_experts_set_backend_data: (skip)
 * @self: experts
 * @backend: the backend storing
 * @data: (nullable): the data
 * @destroy: (nullable): frees @data with the experts, or when replaced
 */
void
moe_experts_set_backend_data (MoeExperts        *self,
                              MoeExpertsBackend *backend,
                              gpointer           data,
                              GDestroyNotify     destroy)
{
  g_autofree char *key = g_strdup_printf ("moe-backend-data-%p", (gpointer) backend);
  g_object_set_data_full (G_OBJECT (self), key, data, destroy);
}
