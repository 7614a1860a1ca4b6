/* moe-experts-backend.c: the contract every experts backend plugin implements
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include "moe-private.h"

/**
 * MoeExpertsBackend:
 *
 * How the experts' matrix products run. Each backend ("eager",
 * "batched_mm", "grouped_mm"…) is a subclass provided by a plugin and
 * instantiated once by the [class@PluginRegistry]; it keeps no model
 * knowledge and reads everything from the [class@Experts] it is given.
 */

typedef struct
{
  char   *name;
  GMutex  prepare_lock;
} MoeExpertsBackendPrivate;

enum {
  PROP_0,
  PROP_NAME,
  N_PROPS
};

static GParamSpec *properties[N_PROPS];

G_DEFINE_ABSTRACT_TYPE_WITH_PRIVATE (MoeExpertsBackend, moe_experts_backend, G_TYPE_OBJECT)


static void
moe_experts_backend_finalize (GObject *object)
{
  MoeExpertsBackendPrivate *priv =
    moe_experts_backend_get_instance_private (MOE_EXPERTS_BACKEND (object));

  g_free (priv->name);
  g_mutex_clear (&priv->prepare_lock);
  G_OBJECT_CLASS (moe_experts_backend_parent_class)->finalize (object);
}

static void
moe_experts_backend_get_property (GObject    *object,
                                  guint       prop_id,
                                  GValue     *value,
                                  GParamSpec *pspec)
{
  MoeExpertsBackendPrivate *priv =
    moe_experts_backend_get_instance_private (MOE_EXPERTS_BACKEND (object));

  switch (prop_id)
    {
    case PROP_NAME:
      g_value_set_string (value, priv->name);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static void
moe_experts_backend_set_property (GObject      *object,
                                  guint         prop_id,
                                  const GValue *value,
                                  GParamSpec   *pspec)
{
  MoeExpertsBackendPrivate *priv =
    moe_experts_backend_get_instance_private (MOE_EXPERTS_BACKEND (object));

  switch (prop_id)
    {
    case PROP_NAME:
      g_free (priv->name);
      priv->name = g_value_dup_string (value);
      break;
    default:
      G_OBJECT_WARN_INVALID_PROPERTY_ID (object, prop_id, pspec);
    }
}

static GQuark
device_schedule_quark (void)
{
  return g_quark_from_static_string ("moe-experts-backend-device-schedule");
}

/* the schedule a backend class hands to other devices, or -1 */
static int
get_device_schedule (MoeExpertsBackend *self)
{
  return GPOINTER_TO_INT (g_type_get_qdata (G_TYPE_FROM_INSTANCE (self), device_schedule_quark ())) - 1;
}

/**
 * moe_experts_backend_class_set_device_schedule: (skip)
 * @klass: a backend class
 * @schedule: how the backend orders the experts' products
 *
 * For backend plugins: on devices other than the CPU, have the device run
 * the experts with @schedule ([vfunc@Device.run_experts]) instead of the
 * class's forward, which then only sees CPU tensors. The built-in backends
 * do this; a backend that brings its own device code does not.
 */
void
moe_experts_backend_class_set_device_schedule (MoeExpertsBackendClass *klass,
                                               MoeExpertsSchedule      schedule)
{
  g_return_if_fail (MOE_IS_EXPERTS_BACKEND_CLASS (klass));
  g_type_set_qdata (G_TYPE_FROM_CLASS (klass), device_schedule_quark (), GINT_TO_POINTER ((int) schedule + 1));
}

/**
 * moe_experts_backend_require_gpu: (skip)
 * @self: a backend
 * @device: the device the experts would run on
 * @requirement: what the backend runs on, to complete "<name> runs on …",
 *   such as "NVIDIA GPUs of compute capability 9.0 or newer"
 * @error: return location for a #GError
 *
 * For backend plugins that have no CPU code (their device runs them): fails
 * with %MOE_ERROR_NOT_SUPPORTED, naming @requirement and how to move the
 * experts, when @device is the CPU. Call it first in the class's
 * is_supported, then chain up (the device checks the rest).
 *
 * Returns: %FALSE with @error set if @device is the CPU
 */
gboolean
moe_experts_backend_require_gpu (MoeExpertsBackend *self,
                                 MoeDevice         *device,
                                 const char        *requirement,
                                 GError           **error)
{
  g_return_val_if_fail (MOE_IS_EXPERTS_BACKEND (self), FALSE);
  g_return_val_if_fail (MOE_IS_DEVICE (device), FALSE);
  g_return_val_if_fail (requirement != NULL, FALSE);

  if (!moe_device_is_cpu (device))
    return TRUE;
  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
               "%s runs on %s through the cuda device; these experts are on %s "
               "(move them with moe_tensor_to_device or load the model with device=cuda)",
               moe_experts_backend_get_name (self), requirement, moe_device_get_name (device));
  return FALSE;
}

static gboolean
moe_experts_backend_real_is_supported (MoeExpertsBackend *self,
                                       MoeDevice         *device,
                                       MoeExperts        *experts,
                                       GError           **error)
{
  int schedule = get_device_schedule (self);

  if (moe_device_is_cpu (device))
    return TRUE;
  if (schedule >= 0)
    return moe_device_supports_experts (device, (MoeExpertsSchedule) schedule, experts, error);
  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
               "The “%s” experts backend runs on the CPU only, not on “%s”",
               moe_experts_backend_get_name (self), moe_device_get_name (device));
  return FALSE;
}

static void
moe_experts_backend_class_init (MoeExpertsBackendClass *klass)
{
  GObjectClass *object_class = G_OBJECT_CLASS (klass);

  object_class->finalize = moe_experts_backend_finalize;
  object_class->get_property = moe_experts_backend_get_property;
  object_class->set_property = moe_experts_backend_set_property;
  klass->is_supported = moe_experts_backend_real_is_supported;


  /**
   * MoeExpertsBackend:name: (getter get_name)
   *
   * The name users select the backend by, from the plugin's keyfile.
   */
  properties[PROP_NAME] =
    g_param_spec_string ("name", NULL, NULL, NULL,
                         G_PARAM_READWRITE | G_PARAM_CONSTRUCT_ONLY | G_PARAM_STATIC_STRINGS);
  g_object_class_install_properties (object_class, N_PROPS, properties);
}

static void
moe_experts_backend_init (MoeExpertsBackend *self)
{
  MoeExpertsBackendPrivate *priv = moe_experts_backend_get_instance_private (self);

  g_mutex_init (&priv->prepare_lock);
}

/**
 * moe_experts_backend_get_name:
 * @self: a backend
 *
 * Returns: the backend's name
 */
const char *
moe_experts_backend_get_name (MoeExpertsBackend *self)
{
  MoeExpertsBackendPrivate *priv;

  g_return_val_if_fail (MOE_IS_EXPERTS_BACKEND (self), NULL);
  priv = moe_experts_backend_get_instance_private (self);
  return priv->name;
}

/**
 * moe_experts_backend_is_supported:
 * @self: a backend
 * @device: the device the experts would run on
 * @experts: the experts
 * @error: return location for a #GError saying why not
 *
 * Returns: %TRUE if this backend can run @experts on @device
 */
gboolean
moe_experts_backend_is_supported (MoeExpertsBackend *self,
                                  MoeDevice         *device,
                                  MoeExperts        *experts,
                                  GError           **error)
{
  g_return_val_if_fail (MOE_IS_EXPERTS_BACKEND (self), FALSE);
  g_return_val_if_fail (MOE_IS_DEVICE (device), FALSE);
  g_return_val_if_fail (MOE_IS_EXPERTS (experts), FALSE);

  return MOE_EXPERTS_BACKEND_GET_CLASS (self)->is_supported (self, device, experts, error);
}

/* Runs the backend's prepare() once per experts object; a failure is not
 * remembered, so a later forward tries again. */
static gboolean
ensure_prepared (MoeExpertsBackend *self,
                 MoeExperts        *experts,
                 GError           **error)
{
  MoeExpertsBackendClass *klass = MOE_EXPERTS_BACKEND_GET_CLASS (self);
  MoeExpertsBackendPrivate *priv = moe_experts_backend_get_instance_private (self);
  g_autofree char *key = NULL;
  gboolean ok = TRUE;

  if (klass->prepare == NULL)
    return TRUE;

  key = g_strdup_printf ("moe-prepared-%p", (gpointer) self);
  moe_mutex_lock (&priv->prepare_lock);
  if (g_object_get_data (G_OBJECT (experts), key) == NULL)
    {
      ok = klass->prepare (self, experts, error);
      if (ok)
        g_object_set_data (G_OBJECT (experts), key, GINT_TO_POINTER (1));
    }
  moe_mutex_unlock (&priv->prepare_lock);
  return ok;
}

/**
 * moe_experts_backend_forward:
 * @self: a backend
 * @experts: the experts to run
 * @hidden_states: `[T, H]` activations (F32, BF16 or F16)
 * @top_k_index: `[T, K]` expert ids (I64 or I32); id E means "not mine"
 * @top_k_weights: `[T, K]` routing weights (F32, BF16 or F16)
 * @error: return location for a #GError
 *
 * Validates the inputs against @experts, checks that the backend supports
 * them on the experts' device, prepares the backend once, and runs it.
 *
 * Returns: (transfer full): `[T, H]` in the dtype of @hidden_states
 */
MoeTensor *
moe_experts_backend_forward (MoeExpertsBackend *self,
                             MoeExperts        *experts,
                             MoeTensor         *hidden_states,
                             MoeTensor         *top_k_index,
                             MoeTensor         *top_k_weights,
                             GError           **error)
{
  g_autoptr(MoeTensor) index = NULL;
  MoeDevice *device;

  g_return_val_if_fail (MOE_IS_EXPERTS_BACKEND (self), NULL);
  g_return_val_if_fail (MOE_IS_EXPERTS (experts), NULL);
  g_return_val_if_fail (MOE_IS_TENSOR (hidden_states), NULL);
  g_return_val_if_fail (MOE_IS_TENSOR (top_k_index), NULL);
  g_return_val_if_fail (MOE_IS_TENSOR (top_k_weights), NULL);

  if (!_moe_experts_check_inputs (experts, hidden_states, top_k_index, top_k_weights, &index, error))
    return NULL;

  device = moe_tensor_get_device (moe_experts_get_up_weight (experts));
  if (!moe_experts_backend_is_supported (self, device, experts, error))
    return NULL;
  if (!ensure_prepared (self, experts, error))
    return NULL;

  if (!moe_device_is_cpu (device) && get_device_schedule (self) >= 0)
    return moe_device_run_experts (device, (MoeExpertsSchedule) get_device_schedule (self), experts,
                                   hidden_states, index, top_k_weights, error);
  return MOE_EXPERTS_BACKEND_GET_CLASS (self)->forward (self, experts, hidden_states,
                                                         index, top_k_weights, error);
}
