/* moe-experts-backend.h: the contract every experts backend plugin implements
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <glib-object.h>

#include "moe-types.h"
#include "moe-tensor.h"
#include "moe-device.h"
#include "moe-experts.h"

G_BEGIN_DECLS

#define MOE_TYPE_EXPERTS_BACKEND (moe_experts_backend_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_DERIVABLE_TYPE (MoeExpertsBackend, moe_experts_backend, MOE, EXPERTS_BACKEND, GObject)

/**
 * MoeExpertsBackendClass:
 * @parent_class: the parent class
 * @is_supported: whether this backend can run @experts on @device; on %FALSE
 *   set @error to say why (a missing GPU, an unsupported dtype…)
 * @prepare: optional one-time work on @experts before their first forward
 *   (weight repacking); called at most once per experts object and backend
 * @forward: compute the experts' output for already-validated inputs:
 *   @hidden_states `[T, H]`, @top_k_index `[T, K]` (I64, every id in
 *   `[0, E]`, where E marks a slot that contributes nothing) and
 *   @top_k_weights `[T, K]`; returns `[T, H]` in the dtype of @hidden_states
 *
 * The virtual methods of an experts backend. Backends carry no model
 * knowledge: everything they need is on the [class@Experts] object.
 */
struct _MoeExpertsBackendClass
{
  GObjectClass parent_class;

  gboolean   (*is_supported) (MoeExpertsBackend *self,
                              MoeDevice         *device,
                              MoeExperts        *experts,
                              GError           **error);
  gboolean   (*prepare)      (MoeExpertsBackend *self,
                              MoeExperts        *experts,
                              GError           **error);
  MoeTensor *(*forward)      (MoeExpertsBackend *self,
                              MoeExperts        *experts,
                              MoeTensor         *hidden_states,
                              MoeTensor         *top_k_index,
                              MoeTensor         *top_k_weights,
                              GError           **error);

  /*< private >*/
  gpointer _reserved[8];
};

MOE_AVAILABLE_IN_ALL
const char *moe_experts_backend_get_name     (MoeExpertsBackend *self);
MOE_AVAILABLE_IN_ALL
gboolean    moe_experts_backend_is_supported (MoeExpertsBackend *self,
                                              MoeDevice         *device,
                                              MoeExperts        *experts,
                                              GError           **error);
MOE_AVAILABLE_IN_ALL
gboolean    moe_experts_backend_require_gpu  (MoeExpertsBackend *self,
                                              MoeDevice         *device,
                                              const char        *requirement,
                                              GError           **error);
MOE_AVAILABLE_IN_ALL
MoeTensor  *moe_experts_backend_forward      (MoeExpertsBackend *self,
                                              MoeExperts        *experts,
                                              MoeTensor         *hidden_states,
                                              MoeTensor         *top_k_index,
                                              MoeTensor         *top_k_weights,
                                              GError           **error);

G_END_DECLS
