/* moe-version-macros.h: symbol visibility and availability annotations
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <glib.h>

#include "moe-version.h"

#ifndef _MOE_EXTERN
# define _MOE_EXTERN __attribute__((visibility ("default"))) extern
#endif

#define MOE_VERSION_1_0 (G_ENCODE_VERSION (1, 0))

#ifndef MOE_VERSION_MIN_REQUIRED
# define MOE_VERSION_MIN_REQUIRED MOE_VERSION_1_0
#endif

#define MOE_AVAILABLE_IN_ALL _MOE_EXTERN
#define MOE_AVAILABLE_IN_1_0 _MOE_EXTERN
#define MOE_DEPRECATED_IN_1_0 G_DEPRECATED _MOE_EXTERN
#define MOE_DEPRECATED_IN_1_0_FOR(f) G_DEPRECATED_FOR (f) _MOE_EXTERN
