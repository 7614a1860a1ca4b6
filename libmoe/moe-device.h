/* moe-device.h: where tensors live and computation runs
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <glib-object.h>

#include "moe-types.h"

G_BEGIN_DECLS

#define MOE_TYPE_DEVICE (moe_device_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_DERIVABLE_TYPE (MoeDevice, moe_device, MOE, DEVICE, GObject)

/**
 * MoeDeviceClass:
 * @parent_class: the parent class
 * @alloc: allocate @size bytes of device memory
 * @free: free memory returned by @alloc
 * @copy_from_host: copy @size bytes from host memory to device memory
 * @copy_to_host: copy @size bytes from device memory to host memory
 * @synchronize: wait until all queued work on the device is done
 * @supports_experts: whether the device can run @experts with @schedule;
 *   on %FALSE set @error to say why
 * @run_experts: run @experts on already-validated inputs living on the
 *   device (see [vfunc@ExpertsBackend.forward]); the result stays on the
 *   device and may still be computing when this returns
 * @decoder_new: make the device's state for running a whole model's
 *   decoder stack, @model being libmoe's internal description of it
 *   (`moe-transformer-private.h`: for devices built with libmoe)
 * @decoder_free: free what @decoder_new returned
 * @decoder_forward: run one step of the decoder (an internal
 *   `MoeDecoderStep`), its KV cache kept by the device in @step
 * @decoder_cache_free: free a KV cache that @decoder_forward made
 *
 * The virtual methods a device implements. The CPU device lives in the core;
 * other devices come from plugins.
 */
struct _MoeDeviceClass
{
  GObjectClass parent_class;

  gpointer (*alloc)          (MoeDevice     *self,
                              gsize          size,
                              GError       **error);
  void     (*free)           (MoeDevice     *self,
                              gpointer       ptr);
  gboolean (*copy_from_host) (MoeDevice     *self,
                              gpointer       dst,
                              gconstpointer  src,
                              gsize          size,
                              GError       **error);
  gboolean (*copy_to_host)   (MoeDevice     *self,
                              gpointer       dst,
                              gconstpointer  src,
                              gsize          size,
                              GError       **error);
  gboolean (*synchronize)    (MoeDevice     *self,
                              GError       **error);
  gboolean (*supports_experts) (MoeDevice          *self,
                                MoeExpertsSchedule  schedule,
                                MoeExperts         *experts,
                                GError            **error);
  MoeTensor *(*run_experts)  (MoeDevice          *self,
                              MoeExpertsSchedule  schedule,
                              MoeExperts         *experts,
                              MoeTensor          *hidden_states,
                              MoeTensor          *top_k_index,
                              MoeTensor          *top_k_weights,
                              GError            **error);
  gpointer (*decoder_new)    (MoeDevice          *self,
                              gconstpointer       model,
                              GError            **error);
  void     (*decoder_free)   (MoeDevice          *self,
                              gpointer            decoder);
  gboolean (*decoder_forward) (MoeDevice         *self,
                               gpointer           decoder,
                               gpointer           step,
                               GError           **error);
  void     (*decoder_cache_free) (MoeDevice      *self,
                                  gpointer        cache);

  /*< private >*/
  gpointer _reserved[2];
};

MOE_AVAILABLE_IN_ALL
MoeDevice   *moe_device_get_cpu    (void);
MOE_AVAILABLE_IN_ALL
MoeDevice   *moe_device_get_for_name (const char  *name,
                                      GError     **error);
MOE_AVAILABLE_IN_ALL
const char  *moe_device_get_name   (MoeDevice   *self);
MOE_AVAILABLE_IN_ALL
gboolean     moe_device_is_cpu     (MoeDevice   *self);
MOE_AVAILABLE_IN_ALL
gboolean     moe_device_synchronize (MoeDevice  *self,
                                     GError    **error);

G_END_DECLS
