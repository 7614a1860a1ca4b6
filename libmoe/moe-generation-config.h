/* moe-generation-config.h: what moe_model_generate() does
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

#define MOE_TYPE_GENERATION_CONFIG (moe_generation_config_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoeGenerationConfig, moe_generation_config, MOE, GENERATION_CONFIG, GObject)

MOE_AVAILABLE_IN_ALL
MoeGenerationConfig *moe_generation_config_new            (void);
MOE_AVAILABLE_IN_ALL
MoeGenerationConfig *moe_generation_config_new_from_file  (const char          *path,
                                                           GError             **error);
MOE_AVAILABLE_IN_ALL
MoeGenerationConfig *moe_generation_config_copy           (MoeGenerationConfig *self);
MOE_AVAILABLE_IN_ALL
const gint64        *moe_generation_config_get_eos_token_ids (MoeGenerationConfig *self,
                                                              guint               *n_ids);
MOE_AVAILABLE_IN_ALL
void                 moe_generation_config_set_eos_token_ids (MoeGenerationConfig *self,
                                                              const gint64        *ids,
                                                              guint                n_ids);

G_END_DECLS
