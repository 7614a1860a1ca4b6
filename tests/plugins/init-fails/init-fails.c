/* init-fails.c: plugins whose init function fails
 *
 * Module init_fails returns FALSE with an error; init_fails_silently (built
 * with FIXTURE_SILENT) returns FALSE without one. Each counts its calls in
 * the exported fixture_init_calls, so a test can check that libmoe tries a
 * failed plugin once.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

G_MODULE_EXPORT int fixture_init_calls;

static gboolean
failing_init (GError **error)
{
  fixture_init_calls++;
#ifndef FIXTURE_SILENT
  g_set_error_literal (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                       "the fixture has no accelerator to drive");
#endif
  return FALSE;
}

#ifdef FIXTURE_SILENT
MOE_PLUGIN_DEFINE (init_fails_silently, failing_init)
#else
MOE_PLUGIN_DEFINE (init_fails, failing_init)
#endif
