/* moe-plugin-info-private.h
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include "moe-plugin-info.h"

G_BEGIN_DECLS

GType _moe_plugin_info_load (MoePluginInfo  *self,
                             GError        **error);

G_END_DECLS
