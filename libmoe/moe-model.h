/* moe-model.h: a Mixture-of-Experts language model
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <gio/gio.h>

#include "moe-types.h"
#include "moe-tensor.h"
#include "moe-config.h"
#include "moe-load-options.h"
#include "moe-generation-config.h"

G_BEGIN_DECLS

/**
 * MoePhase:
 * @MOE_PHASE_IDLE: no generation is running
 * @MOE_PHASE_PREFILL: the prompt is being processed
 * @MOE_PHASE_DECODE: new tokens are being generated one step at a time
 *
 * Where a generation is.
 */
typedef enum {
  MOE_PHASE_IDLE,
  MOE_PHASE_PREFILL,
  MOE_PHASE_DECODE,
} MoePhase;

/**
 * MoeTokenCallback:
 * @model: the model
 * @tokens: `[B]` I64: the token each sequence produced in this step
 * @user_data: the data passed with the callback
 *
 * Called once per generated step, on the main context of the caller of
 * [method@Model.generate_async].
 */
typedef void (*MoeTokenCallback) (MoeModel  *model,
                                  MoeTensor *tokens,
                                  gpointer   user_data);

#define MOE_TYPE_MODEL (moe_model_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoeModel, moe_model, MOE, MODEL, GObject)

MOE_AVAILABLE_IN_ALL
MoeModel     *moe_model_new_from_pretrained          (const char           *path,
                                                      MoeLoadOptions       *options,
                                                      GCancellable         *cancellable,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
void          moe_model_new_from_pretrained_async    (const char           *path,
                                                      MoeLoadOptions       *options,
                                                      GCancellable         *cancellable,
                                                      GAsyncReadyCallback   callback,
                                                      gpointer              user_data);
MOE_AVAILABLE_IN_ALL
MoeModel     *moe_model_new_from_pretrained_finish   (GAsyncResult         *result,
                                                      GError              **error);

MOE_AVAILABLE_IN_ALL
MoeTensor    *moe_model_forward                      (MoeModel             *self,
                                                      MoeTensor            *input_ids,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
MoeTensor    *moe_model_forward_with_mask            (MoeModel             *self,
                                                      MoeTensor            *input_ids,
                                                      MoeTensor            *attention_mask,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
MoeTensor    *moe_model_generate                     (MoeModel             *self,
                                                      MoeTensor            *input_ids,
                                                      MoeGenerationConfig  *config,
                                                      GCancellable         *cancellable,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
MoeTensor    *moe_model_generate_with_mask           (MoeModel             *self,
                                                      MoeTensor            *input_ids,
                                                      MoeTensor            *attention_mask,
                                                      MoeGenerationConfig  *config,
                                                      GCancellable         *cancellable,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
void          moe_model_generate_async               (MoeModel             *self,
                                                      MoeTensor            *input_ids,
                                                      MoeTensor            *attention_mask,
                                                      MoeGenerationConfig  *config,
                                                      MoeTokenCallback      token_callback,
                                                      gpointer              token_data,
                                                      GDestroyNotify        token_destroy,
                                                      GCancellable         *cancellable,
                                                      GAsyncReadyCallback   callback,
                                                      gpointer              user_data);
MOE_AVAILABLE_IN_ALL
MoeTensor    *moe_model_generate_finish              (MoeModel             *self,
                                                      GAsyncResult         *result,
                                                      GError              **error);

MOE_AVAILABLE_IN_ALL
gboolean      moe_model_set_experts_implementation   (MoeModel             *self,
                                                      const char           *name,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
gboolean      moe_model_set_experts_implementation_map (MoeModel           *self,
                                                      GHashTable           *map,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
GHashTable   *moe_model_get_experts_implementation   (MoeModel             *self);
MOE_AVAILABLE_IN_ALL
char         *moe_model_dup_experts_implementation_for (MoeModel           *self,
                                                      const char           *key);
MOE_AVAILABLE_IN_ALL
gboolean      moe_model_set_experts_implementation_for (MoeModel           *self,
                                                      const char           *key,
                                                      const char           *name,
                                                      GError              **error);
MOE_AVAILABLE_IN_ALL
char         *moe_model_dup_experts_implementation_name (MoeModel          *self);

MOE_AVAILABLE_IN_ALL
MoeConfig    *moe_model_get_config                   (MoeModel             *self);
MOE_AVAILABLE_IN_ALL
const char   *moe_model_get_device                   (MoeModel             *self);
MOE_AVAILABLE_IN_ALL
const char   *moe_model_get_dtype                    (MoeModel             *self);
MOE_AVAILABLE_IN_ALL
MoeGenerationConfig *moe_model_get_generation_config (MoeModel             *self);
MOE_AVAILABLE_IN_ALL
MoeDecodeSwitch moe_model_get_decode_switch          (MoeModel             *self);
MOE_AVAILABLE_IN_ALL
void          moe_model_set_decode_switch            (MoeModel             *self,
                                                      MoeDecodeSwitch       policy);
MOE_AVAILABLE_IN_ALL
MoePhase      moe_model_get_phase                    (MoeModel             *self);
MOE_AVAILABLE_IN_ALL
gint64        moe_model_get_vocab_size               (MoeModel             *self);

G_END_DECLS
