/* good.c: a fixture plugin that works (backend "good")
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

FIXTURE_DEFINE_BACKEND (MoeTestGoodBackend, moe_test_good_backend)
FIXTURE_RECORD_OPEN (good)

static gboolean
good_init (GError **error)
{
  g_type_ensure (moe_test_good_backend_get_type ());
  return TRUE;
}

MOE_PLUGIN_DEFINE (good, good_init)
