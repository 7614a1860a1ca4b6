/* moe-checkpoint.h: Hugging Face safetensors checkpoints, memory-mapped
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
#include "moe-experts.h"

G_BEGIN_DECLS

#define MOE_TYPE_CHECKPOINT (moe_checkpoint_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoeCheckpoint, moe_checkpoint, MOE, CHECKPOINT, GObject)

MOE_AVAILABLE_IN_ALL
MoeCheckpoint  *moe_checkpoint_open               (const char     *path,
                                                   GError        **error);
MOE_AVAILABLE_IN_ALL
const char     *moe_checkpoint_get_path           (MoeCheckpoint  *self);
MOE_AVAILABLE_IN_ALL
char          **moe_checkpoint_list_tensors       (MoeCheckpoint  *self);
MOE_AVAILABLE_IN_ALL
gboolean        moe_checkpoint_has_tensor         (MoeCheckpoint  *self,
                                                   const char     *name);
MOE_AVAILABLE_IN_ALL
MoeTensor      *moe_checkpoint_get_tensor         (MoeCheckpoint  *self,
                                                   const char     *name,
                                                   GError        **error);
MOE_AVAILABLE_IN_ALL
gboolean        moe_checkpoint_get_tensor_info    (MoeCheckpoint  *self,
                                                   const char     *name,
                                                   MoeDType       *dtype,
                                                   GArray        **shape,
                                                   GError        **error);
MOE_AVAILABLE_IN_ALL
GHashTable     *moe_checkpoint_get_metadata       (MoeCheckpoint  *self);
MOE_AVAILABLE_IN_ALL
const char     *moe_checkpoint_get_metadata_value (MoeCheckpoint  *self,
                                                   const char     *key);
MOE_AVAILABLE_IN_ALL
MoeExperts     *moe_checkpoint_load_experts       (MoeCheckpoint  *self,
                                                   const char     *prefix,
                                                   GError        **error);

G_END_DECLS
