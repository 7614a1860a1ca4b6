/* moe-plugin-registry.h: discovers plugins and opens them on first use
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <gio/gio.h>

#include "moe-types.h"
#include "moe-plugin-info.h"
#include "moe-experts-backend.h"

G_BEGIN_DECLS

#define MOE_TYPE_PLUGIN_REGISTRY (moe_plugin_registry_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoePluginRegistry, moe_plugin_registry, MOE, PLUGIN_REGISTRY, GObject)

MOE_AVAILABLE_IN_ALL
MoePluginRegistry  *moe_plugin_registry_get_default     (void);
MOE_AVAILABLE_IN_ALL
MoePluginRegistry  *moe_plugin_registry_new             (void);
MOE_AVAILABLE_IN_ALL
void                moe_plugin_registry_add_search_path (MoePluginRegistry  *self,
                                                         const char         *path);
MOE_AVAILABLE_IN_ALL
void                moe_plugin_registry_rescan          (MoePluginRegistry  *self);
MOE_AVAILABLE_IN_ALL
char              **moe_plugin_registry_list_backends   (MoePluginRegistry  *self);
MOE_AVAILABLE_IN_ALL
char              **moe_plugin_registry_list_backends_for_device (MoePluginRegistry *self,
                                                                  const char        *device);
MOE_AVAILABLE_IN_ALL
char              **moe_plugin_registry_list_devices    (MoePluginRegistry  *self);
MOE_AVAILABLE_IN_ALL
MoePluginInfo      *moe_plugin_registry_lookup          (MoePluginRegistry  *self,
                                                         MoePluginKind       kind,
                                                         const char         *name);
MOE_AVAILABLE_IN_ALL
GPtrArray          *moe_plugin_registry_dup_rejected    (MoePluginRegistry  *self);
MOE_AVAILABLE_IN_ALL
MoeExpertsBackend  *moe_plugin_registry_get_backend     (MoePluginRegistry  *self,
                                                         const char         *name,
                                                         GError            **error);
MOE_AVAILABLE_IN_ALL
MoeDevice          *moe_plugin_registry_get_device      (MoePluginRegistry  *self,
                                                         const char         *name,
                                                         GError            **error);

G_END_DECLS
