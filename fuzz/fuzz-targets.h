/* fuzz-targets.h: the fuzz targets, shared by the libFuzzer harnesses
 * (fuzz/fuzz-main.c) and the regression replay test
 * (tests/fuzz-regressions/test-fuzz-replay.c)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <glib.h>

G_BEGIN_DECLS

/* Runs one input through a target; returns 0 (libFuzzer's convention). An
 * input the library mishandles crashes: a sanitizer report, an abort, or a
 * fatal GLib warning or critical. */
typedef int (*MoeFuzzFunc) (const guint8 *data,
                            gsize         size);

typedef struct
{
  const char  *name;     /* the directory name under fuzz/corpus/ and tests/fuzz-regressions/ */
  MoeFuzzFunc  func;
} MoeFuzzTarget;

/* Every target, ended by { NULL, NULL }. */
extern const MoeFuzzTarget moe_fuzz_targets[];

const MoeFuzzTarget *moe_fuzz_target_lookup       (const char   *name);

/* Makes warnings and criticals fatal, prepares the scratch directories
 * (once, removed at exit). Called by every target; idempotent. */
void                 moe_fuzz_setup               (void);

int                  moe_fuzz_safetensors         (const guint8 *data,
                                                   gsize         size);
int                  moe_fuzz_index               (const guint8 *data,
                                                   gsize         size);
int                  moe_fuzz_config              (const guint8 *data,
                                                   gsize         size);
int                  moe_fuzz_plugin              (const guint8 *data,
                                                   gsize         size);
int                  moe_fuzz_generation_config   (const guint8 *data,
                                                   gsize         size);

G_END_DECLS
