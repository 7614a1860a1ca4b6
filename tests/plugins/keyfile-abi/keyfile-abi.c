/* keyfile-abi.c: a good module whose keyfile declares Abi=2
 *
 * libmoe must refuse the plugin from its keyfile alone: the module records
 * it if it is ever opened (MOE_TEST_OPENED_keyfile_abi).
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

FIXTURE_DEFINE_BACKEND (MoeTestKeyfileAbiBackend, moe_test_keyfile_abi_backend)
FIXTURE_RECORD_OPEN (keyfile_abi)

static gboolean
keyfile_abi_init (GError **error)
{
  g_type_ensure (moe_test_keyfile_abi_backend_get_type ());
  return TRUE;
}

MOE_PLUGIN_DEFINE (keyfile_abi, keyfile_abi_init)
