/* moe-load-options.h: how moe_model_new_from_pretrained() loads a model
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

/**
 * MoeDecodeSwitch:
 * @MOE_DECODE_SWITCH_AUTO: as transformers: switch `grouped_mm` entries to
 *   `batched_mm` for the decode loop on devices other than the CPU
 * @MOE_DECODE_SWITCH_ALWAYS: switch on every device, the CPU included
 * @MOE_DECODE_SWITCH_NEVER: never switch
 * @MOE_DECODE_SWITCH_BY_TOKENS: beyond transformers, on every device: a
 *   step (prefill or decode) runs `batched_mm` in place of `grouped_mm`
 *   when its (token, slot) rows are at most the layer's number of experts
 *   — where `batched_mm` was the faster of the two on every shape measured
 *   on an H200 (BENCHMARKS.md): a short prompt's prefill switches too, a
 *   large batch's decode does not
 *
 * When [method@Model.generate] runs steps with `batched_mm` in place of
 * `grouped_mm`.
 */
typedef enum {
  MOE_DECODE_SWITCH_AUTO,
  MOE_DECODE_SWITCH_ALWAYS,
  MOE_DECODE_SWITCH_NEVER,
  MOE_DECODE_SWITCH_BY_TOKENS,
} MoeDecodeSwitch;

#define MOE_TYPE_LOAD_OPTIONS (moe_load_options_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoeLoadOptions, moe_load_options, MOE, LOAD_OPTIONS, GObject)

MOE_AVAILABLE_IN_ALL
MoeLoadOptions  *moe_load_options_new                              (void);
MOE_AVAILABLE_IN_ALL
const char      *moe_load_options_get_dtype                        (MoeLoadOptions *self);
MOE_AVAILABLE_IN_ALL
void             moe_load_options_set_dtype                        (MoeLoadOptions *self,
                                                                    const char     *dtype);
MOE_AVAILABLE_IN_ALL
const char      *moe_load_options_get_device                       (MoeLoadOptions *self);
MOE_AVAILABLE_IN_ALL
void             moe_load_options_set_device                       (MoeLoadOptions *self,
                                                                    const char     *device);
MOE_AVAILABLE_IN_ALL
const char      *moe_load_options_get_experts_implementation       (MoeLoadOptions *self);
MOE_AVAILABLE_IN_ALL
void             moe_load_options_set_experts_implementation       (MoeLoadOptions *self,
                                                                    const char     *name);
MOE_AVAILABLE_IN_ALL
GHashTable      *moe_load_options_dup_experts_implementation_map   (MoeLoadOptions *self);
MOE_AVAILABLE_IN_ALL
void             moe_load_options_set_experts_implementation_map   (MoeLoadOptions *self,
                                                                    GHashTable     *map);
MOE_AVAILABLE_IN_ALL
gboolean         moe_load_options_get_dequantize                   (MoeLoadOptions *self);
MOE_AVAILABLE_IN_ALL
void             moe_load_options_set_dequantize                   (MoeLoadOptions *self,
                                                                    gboolean        dequantize);
MOE_AVAILABLE_IN_ALL
MoeDecodeSwitch  moe_load_options_get_decode_switch                (MoeLoadOptions *self);
MOE_AVAILABLE_IN_ALL
void             moe_load_options_set_decode_switch                (MoeLoadOptions *self,
                                                                    MoeDecodeSwitch policy);

G_END_DECLS
