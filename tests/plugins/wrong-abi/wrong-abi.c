/* wrong-abi.c: fixture modules whose descriptor libmoe refuses
 *
 * Built once per variant (FIXTURE_VARIANT): a plugin ABI of 999, a newer
 * minor version of libmoe, another major version, or no descriptor at
 * all. Their keyfiles all say Abi=1. The init function aborts: it must
 * never run.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

#if FIXTURE_VARIANT == 1
static const MoePluginDesc desc = {
  999, MOE_MAJOR_VERSION, MOE_MINOR_VERSION, "wrong_abi", fixture_init_must_not_run, { NULL, }
};
FIXTURE_DEFINE_DESC (wrong_abi, &desc)
#elif FIXTURE_VARIANT == 2
static const MoePluginDesc desc = {
  MOE_PLUGIN_ABI_VERSION, MOE_MAJOR_VERSION, MOE_MINOR_VERSION + 1, "newer_minor",
  fixture_init_must_not_run, { NULL, }
};
FIXTURE_DEFINE_DESC (newer_minor, &desc)
#elif FIXTURE_VARIANT == 3
static const MoePluginDesc desc = {
  MOE_PLUGIN_ABI_VERSION, MOE_MAJOR_VERSION + 1, 0, "other_major", fixture_init_must_not_run, { NULL, }
};
FIXTURE_DEFINE_DESC (other_major, &desc)
#elif FIXTURE_VARIANT == 4
FIXTURE_DEFINE_DESC (null_desc, NULL)
#else
# error "FIXTURE_VARIANT must be 1 to 4"
#endif
