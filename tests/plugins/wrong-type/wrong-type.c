/* wrong-type.c: registers MoeTestWrongTypeBackend, but its keyfile says
 * Type=MoeTestNoSuchBackend
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

FIXTURE_DEFINE_BACKEND (MoeTestWrongTypeBackend, moe_test_wrong_type_backend)

static gboolean
wrong_type_init (GError **error)
{
  g_type_ensure (moe_test_wrong_type_backend_get_type ());
  return TRUE;
}

MOE_PLUGIN_DEFINE (wrong_type, wrong_type_init)
