/* moe-config.h: a model's config.json and its sub-configs
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <gio/gio.h>

#include "moe-types.h"

G_BEGIN_DECLS

#define MOE_TYPE_CONFIG (moe_config_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoeConfig, moe_config, MOE, CONFIG, GObject)

MOE_AVAILABLE_IN_ALL
MoeConfig    *moe_config_new_from_file       (const char  *path,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
MoeConfig    *moe_config_new_from_data       (const char  *data,
                                              gssize       length,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
const char   *moe_config_get_name            (MoeConfig   *self);
MOE_AVAILABLE_IN_ALL
MoeConfig    *moe_config_get_parent          (MoeConfig   *self);
MOE_AVAILABLE_IN_ALL
const char   *moe_config_get_model_type      (MoeConfig   *self);
MOE_AVAILABLE_IN_ALL
char        **moe_config_list_keys           (MoeConfig   *self);
MOE_AVAILABLE_IN_ALL
char        **moe_config_list_sub_configs    (MoeConfig   *self);
MOE_AVAILABLE_IN_ALL
MoeConfig    *moe_config_get_sub_config      (MoeConfig   *self,
                                              const char  *name);
MOE_AVAILABLE_IN_ALL
gboolean      moe_config_has_key             (MoeConfig   *self,
                                              const char  *key);
MOE_AVAILABLE_IN_ALL
gboolean      moe_config_is_null             (MoeConfig   *self,
                                              const char  *key);
MOE_AVAILABLE_IN_ALL
gint64        moe_config_get_int             (MoeConfig   *self,
                                              const char  *key,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
gint64        moe_config_get_int_or          (MoeConfig   *self,
                                              const char  *key,
                                              gint64       fallback,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
double        moe_config_get_double          (MoeConfig   *self,
                                              const char  *key,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
double        moe_config_get_double_or       (MoeConfig   *self,
                                              const char  *key,
                                              double       fallback,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
gboolean      moe_config_get_boolean         (MoeConfig   *self,
                                              const char  *key,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
gboolean      moe_config_get_boolean_or      (MoeConfig   *self,
                                              const char  *key,
                                              gboolean     fallback,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
char         *moe_config_dup_string          (MoeConfig   *self,
                                              const char  *key,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
char         *moe_config_dup_string_or       (MoeConfig   *self,
                                              const char  *key,
                                              const char  *fallback,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
GArray       *moe_config_get_int_array       (MoeConfig   *self,
                                              const char  *key,
                                              GError     **error);
MOE_AVAILABLE_IN_ALL
char         *moe_config_to_string           (MoeConfig   *self);

G_END_DECLS
