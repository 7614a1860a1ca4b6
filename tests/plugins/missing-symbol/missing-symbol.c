/* missing-symbol.c: a module exporting the wrong entry symbol
 *
 * Its keyfile says Module=missing_symbol, so libmoe looks for
 * moe_plugin_missing_symbol_get_desc(); the module exports
 * moe_plugin_something_else_get_desc() instead.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

MOE_PLUGIN_DEFINE (something_else, fixture_init_must_not_run)
