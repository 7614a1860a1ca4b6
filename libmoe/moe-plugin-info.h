/* moe-plugin-info.h: what a plugin's .plugin keyfile says about it
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
 * MoePluginKind:
 * @MOE_PLUGIN_KIND_EXPERTS_BACKEND: the plugin provides an experts backend
 * @MOE_PLUGIN_KIND_DEVICE: the plugin provides a device
 *
 * What a plugin provides (the keyfile's `Kind=`).
 */
typedef enum {
  MOE_PLUGIN_KIND_EXPERTS_BACKEND,
  MOE_PLUGIN_KIND_DEVICE,
} MoePluginKind;

#define MOE_TYPE_PLUGIN_INFO (moe_plugin_info_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoePluginInfo, moe_plugin_info, MOE, PLUGIN_INFO, GObject)

MOE_AVAILABLE_IN_ALL
MoePluginInfo      *moe_plugin_info_new_from_file      (const char    *path,
                                                        GError       **error);
MOE_AVAILABLE_IN_ALL
const char         *moe_plugin_info_get_name           (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
const char         *moe_plugin_info_get_module_name    (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
const char         *moe_plugin_info_get_module_path    (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
const char         *moe_plugin_info_get_keyfile_path   (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
const char         *moe_plugin_info_get_type_name      (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
const char         *moe_plugin_info_get_description    (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
const char         *moe_plugin_info_get_version        (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
MoePluginKind       moe_plugin_info_get_kind           (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
int                 moe_plugin_info_get_priority       (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
guint               moe_plugin_info_get_abi            (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
const char * const *moe_plugin_info_get_devices        (MoePluginInfo *self);
MOE_AVAILABLE_IN_ALL
char               *moe_plugin_info_dup_extra          (MoePluginInfo *self,
                                                        const char    *key);
MOE_AVAILABLE_IN_ALL
gboolean            moe_plugin_info_is_loaded          (MoePluginInfo *self);

G_END_DECLS
