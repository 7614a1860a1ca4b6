/* name-mismatch.c: exports moe_plugin_name_mismatch_get_desc() as its
 * keyfile's Module=name_mismatch asks, but the descriptor calls the module
 * "someone_else"
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

static const MoePluginDesc desc = {
  MOE_PLUGIN_ABI_VERSION, MOE_MAJOR_VERSION, MOE_MINOR_VERSION, "someone_else",
  fixture_init_must_not_run, { NULL, }
};
FIXTURE_DEFINE_DESC (name_mismatch, &desc)
