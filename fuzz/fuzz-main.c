/* fuzz-main.c: the libFuzzer entry points of one fuzz target
 *
 * Compiled once per target with -DMOE_FUZZ_TARGET=moe_fuzz_<name>; the
 * target's body is in fuzz-targets.c, shared with the replay test.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <stddef.h>
#include <stdint.h>

#include "fuzz-targets.h"

#ifndef MOE_FUZZ_TARGET
# error "MOE_FUZZ_TARGET must name the target function"
#endif

int LLVMFuzzerInitialize (int *argc, char ***argv);
int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerInitialize (int    *argc,
                      char ***argv)
{
  moe_fuzz_setup ();
  return 0;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data,
                        size_t         size)
{
  return MOE_FUZZ_TARGET (data, size);
}
