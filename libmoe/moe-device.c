/* moe-device.c: the device base class and the CPU device
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <string.h>

#include "moe-private.h"

/**
 * MoeDevice:
 *
 * Where tensors live and computation runs. The CPU device is part of the
 * core ([func@Device.get_cpu]); other devices, such as "cuda", come from
 * device plugins and are found by name with [func@Device.get_for_name].
 */

typedef struct
{
  char *name;
} MoeDevicePrivate;

enum {
  PROP_0,
  PROP_NAME,
  N_PROPS
};

static GParamSpec *properties[N_PROPS];

G_DEFINE_ABSTRACT_TYPE_WITH_PRIVATE (MoeDevice, moe_device, G_TYPE_OBJECT)

static void
moe_device_finalize (GObject *object)
{
  MoeDevicePrivate *priv = moe_device_get_instance_private (MOE_DEVICE (object));

  g_free (priv->name);
  G_OBJECT_CLASS (moe_device_parent_class)->finalize (object);
}

static void
moe_device_get_property (GObject    *object,
                         guint       prop_id,
                         GValue     *value,
                         GParamSpec *pspec)
{
  MoeDevicePrivate *priv = moe_device_get_instance_private (MOE_DEVICE (object));

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
moe_device_set_property (GObject      *object,
                         guint         prop_id,
                         const GValue *value,
                         GParamSpec   *pspec)
{
  MoeDevicePrivate *priv = moe_device_get_instance_private (MOE_DEVICE (object));

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

static gboolean
moe_device_real_synchronize (MoeDevice  *self,
                             GError    **error)
{
  return TRUE;
}

static void
moe_device_class_init (MoeDeviceClass *klass)
{
  GObjectClass *object_class = G_OBJECT_CLASS (klass);

  object_class->finalize = moe_device_finalize;
  object_class->get_property = moe_device_get_property;
  object_class->set_property = moe_device_set_property;
  klass->synchronize = moe_device_real_synchronize;

  /**
   * MoeDevice:name: (getter get_name)
   *
   * The device's name: "cpu", "cuda", "cuda:1"…
   */
  properties[PROP_NAME] =
    g_param_spec_string ("name", NULL, NULL, "cpu",
                         G_PARAM_READWRITE | G_PARAM_CONSTRUCT_ONLY | G_PARAM_STATIC_STRINGS);
  g_object_class_install_properties (object_class, N_PROPS, properties);
}

static void
moe_device_init (MoeDevice *self)
{
}

/**
 * moe_device_get_name:
 * @self: a device
 *
 * Returns: the device's name
 */
const char *
moe_device_get_name (MoeDevice *self)
{
  MoeDevicePrivate *priv;

  g_return_val_if_fail (MOE_IS_DEVICE (self), NULL);
  priv = moe_device_get_instance_private (self);
  return priv->name;
}

/**
 * moe_device_is_cpu:
 * @self: a device
 *
 * Returns: %TRUE if this is the CPU device (host memory)
 */
gboolean
moe_device_is_cpu (MoeDevice *self)
{
  g_return_val_if_fail (MOE_IS_DEVICE (self), FALSE);
  return G_TYPE_FROM_INSTANCE (self) == _moe_cpu_device_get_type ();
}

/**
 * moe_device_synchronize:
 * @self: a device
 * @error: return location for a #GError
 *
 * Waits until the work queued on the device has finished.
 *
 * Returns: %TRUE on success
 */
gboolean
moe_device_synchronize (MoeDevice  *self,
                        GError    **error)
{
  g_return_val_if_fail (MOE_IS_DEVICE (self), FALSE);
  return MOE_DEVICE_GET_CLASS (self)->synchronize (self, error);
}

/* The CPU device: host memory, the kernels in moe-cpu-kernels.c. */

typedef struct { MoeDevice parent_instance; } MoeCpuDevice;
typedef struct { MoeDeviceClass parent_class; } MoeCpuDeviceClass;

G_DEFINE_FINAL_TYPE (MoeCpuDevice, _moe_cpu_device, MOE_TYPE_DEVICE)

static gpointer
cpu_alloc (MoeDevice *self, gsize size, GError **error)
{
  gpointer p = g_try_malloc (size);
  if (p == NULL)
    g_set_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY,
                 "Could not allocate %" G_GSIZE_FORMAT " bytes", size);
  return p;
}

static void
cpu_free (MoeDevice *self, gpointer ptr)
{
  g_free (ptr);
}

static gboolean
cpu_copy (MoeDevice *self, gpointer dst, gconstpointer src, gsize size, GError **error)
{
  memcpy (dst, src, size);
  return TRUE;
}

static void
_moe_cpu_device_class_init (MoeCpuDeviceClass *klass)
{
  MoeDeviceClass *device_class = MOE_DEVICE_CLASS (klass);

  device_class->alloc = cpu_alloc;
  device_class->free = cpu_free;
  device_class->copy_from_host = cpu_copy;
  device_class->copy_to_host = cpu_copy;
}

static void
_moe_cpu_device_init (MoeCpuDevice *self)
{
}

/**
 * moe_device_get_cpu:
 *
 * Returns: (transfer none): the CPU device
 */
MoeDevice *
moe_device_get_cpu (void)
{
  static gsize cpu;

  if (g_once_init_enter (&cpu))
    g_once_init_leave (&cpu, (gsize) g_object_new (_moe_cpu_device_get_type (), "name", "cpu", NULL));
  return (MoeDevice *) cpu;
}

/**
 * moe_device_get_for_name:
 * @name: "cpu", or a device a plugin provides ("cuda", "cuda:0"…)
 * @error: return location for a #GError
 *
 * Finds a device. Devices other than the CPU come from device plugins; a
 * plugin that finds no hardware reports %MOE_ERROR_NO_DEVICE.
 *
 * Returns: (transfer none): the device, or %NULL with @error set
 */
MoeDevice *
moe_device_get_for_name (const char  *name,
                         GError     **error)
{
  g_return_val_if_fail (name != NULL, NULL);

  if (g_str_equal (name, "cpu"))
    return moe_device_get_cpu ();
  return moe_plugin_registry_get_device (moe_plugin_registry_get_default (), name, error);
}

/**
 * moe_device_supports_experts: (skip)
 * @self: a device
 * @schedule: how the backend orders the experts' products
 * @experts: validated experts whose weights live on @self
 * @error: return location for a #GError saying why not
 *
 * For backend plugins: whether @self runs @experts with @schedule. The CPU
 * device says %TRUE: the backends carry their own CPU code.
 *
 * Returns: %TRUE if supported
 */
gboolean
moe_device_supports_experts (MoeDevice           *self,
                             MoeExpertsSchedule   schedule,
                             MoeExperts          *experts,
                             GError             **error)
{
  MoeDeviceClass *klass;

  g_return_val_if_fail (MOE_IS_DEVICE (self), FALSE);
  g_return_val_if_fail (MOE_IS_EXPERTS (experts), FALSE);

  if (moe_device_is_cpu (self))
    return TRUE;
  klass = MOE_DEVICE_GET_CLASS (self);
  if (klass->supports_experts == NULL || klass->run_experts == NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "The device “%s” runs no experts backends", moe_device_get_name (self));
      return FALSE;
    }
  return klass->supports_experts (self, schedule, experts, error);
}

/**
 * moe_device_run_experts: (skip)
 * @self: a device other than the CPU
 * @schedule: how to order the experts' products
 * @experts: the experts, on @self
 * @hidden_states: `[T, H]` on @self
 * @top_k_index: `[T, K]` I64 ids, on @self or on the CPU, already checked
 * @top_k_weights: `[T, K]` on @self
 * @error: return location for a #GError
 *
 * For backend plugins: runs @experts on the device with @schedule, after
 * moe_device_supports_experts() said %TRUE.
 *
 * Returns: (transfer full): `[T, H]` on @self, or %NULL with @error set
 */
MoeTensor *
moe_device_run_experts (MoeDevice           *self,
                        MoeExpertsSchedule   schedule,
                        MoeExperts          *experts,
                        MoeTensor           *hidden_states,
                        MoeTensor           *top_k_index,
                        MoeTensor           *top_k_weights,
                        GError             **error)
{
  g_return_val_if_fail (MOE_IS_DEVICE (self), NULL);
  g_return_val_if_fail (!moe_device_is_cpu (self), NULL);
  g_return_val_if_fail (MOE_DEVICE_GET_CLASS (self)->run_experts != NULL, NULL);

  return MOE_DEVICE_GET_CLASS (self)->run_experts (self, schedule, experts, hidden_states,
                                                   top_k_index, top_k_weights, error);
}
