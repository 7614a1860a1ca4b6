/* moe-experts.h: one MoE layer's expert weights and how to run them
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

G_BEGIN_DECLS

#define MOE_TYPE_EXPERTS (moe_experts_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoeExperts, moe_experts, MOE, EXPERTS, GObject)

MOE_AVAILABLE_IN_ALL
MoeExperts    *moe_experts_new                   (MoeTensor    *up_weight,
                                                  MoeTensor    *down_weight);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_experts_forward               (MoeExperts   *self,
                                                  MoeTensor    *hidden_states,
                                                  MoeTensor    *top_k_index,
                                                  MoeTensor    *top_k_weights,
                                                  GError      **error);
MOE_AVAILABLE_IN_ALL
gboolean       moe_experts_validate              (MoeExperts   *self,
                                                  GError      **error);
MOE_AVAILABLE_IN_ALL
MoeExperts    *moe_experts_to_device             (MoeExperts   *self,
                                                  const char   *device,
                                                  GError      **error);

MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_experts_get_up_weight         (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_experts_get_down_weight       (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_experts_get_up_bias           (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_up_bias           (MoeExperts   *self,
                                                  MoeTensor    *bias);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_experts_get_down_bias         (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_down_bias         (MoeExperts   *self,
                                                  MoeTensor    *bias);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_experts_get_up_weight_scale   (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_up_weight_scale   (MoeExperts   *self,
                                                  MoeTensor    *scale);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_experts_get_down_weight_scale (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_down_weight_scale (MoeExperts   *self,
                                                  MoeTensor    *scale);
MOE_AVAILABLE_IN_ALL
const char    *moe_experts_get_expert_dtype      (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
const char    *moe_experts_get_activation        (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_activation        (MoeExperts   *self,
                                                  const char   *activation);
MOE_AVAILABLE_IN_ALL
gboolean       moe_experts_get_has_gate          (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_has_gate          (MoeExperts   *self,
                                                  gboolean      has_gate);
MOE_AVAILABLE_IN_ALL
gboolean       moe_experts_get_is_transposed     (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_is_transposed     (MoeExperts   *self,
                                                  gboolean      is_transposed);
MOE_AVAILABLE_IN_ALL
MoeGateLayout  moe_experts_get_gate_layout       (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_gate_layout       (MoeExperts   *self,
                                                  MoeGateLayout layout);
MOE_AVAILABLE_IN_ALL
double         moe_experts_get_swiglu_alpha      (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_swiglu_alpha      (MoeExperts   *self,
                                                  double        alpha);
MOE_AVAILABLE_IN_ALL
double         moe_experts_get_swiglu_limit      (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_swiglu_limit      (MoeExperts   *self,
                                                  double        limit);
MOE_AVAILABLE_IN_ALL
const char    *moe_experts_get_implementation    (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_implementation    (MoeExperts   *self,
                                                  const char   *implementation);
MOE_AVAILABLE_IN_ALL
const char    *moe_experts_get_device            (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_device            (MoeExperts   *self,
                                                  const char   *device);
MOE_AVAILABLE_IN_ALL
guint          moe_experts_get_num_experts       (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
guint          moe_experts_get_hidden_size       (MoeExperts   *self);
MOE_AVAILABLE_IN_ALL
guint          moe_experts_get_intermediate_size (MoeExperts   *self);

G_END_DECLS
