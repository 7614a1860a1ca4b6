/* moe-error.h: libmoe's error domain
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <glib.h>

#include "moe-version-macros.h"

G_BEGIN_DECLS

/**
 * MOE_ERROR:
 *
 * The error domain of libmoe: errors in it carry a [enum@Error] code.
 */
#define MOE_ERROR (moe_error_quark ())

/**
 * MoeError:
 * @MOE_ERROR_FAILED: a failure with no more specific code
 * @MOE_ERROR_INVALID_ARGUMENT: an argument is out of its valid range
 * @MOE_ERROR_SHAPE_MISMATCH: a tensor has the wrong shape
 * @MOE_ERROR_DTYPE_MISMATCH: a tensor has the wrong element type
 * @MOE_ERROR_UNKNOWN_BACKEND: no experts backend has that name
 * @MOE_ERROR_NOT_SUPPORTED: the backend or device cannot run this input here
 * @MOE_ERROR_NO_DEVICE: the device does not exist or has no hardware
 * @MOE_ERROR_PLUGIN_KEYFILE: a `.plugin` keyfile is malformed
 * @MOE_ERROR_PLUGIN_LOAD: a plugin module could not be opened
 * @MOE_ERROR_PLUGIN_SYMBOL: a plugin module lacks its entry symbol
 * @MOE_ERROR_PLUGIN_ABI: a plugin was built for another plugin ABI or libmoe version
 * @MOE_ERROR_PLUGIN_INIT: a plugin's init failed or registered the wrong type
 * @MOE_ERROR_INVALID_CHECKPOINT: a checkpoint file is truncated or inconsistent
 * @MOE_ERROR_NOT_FOUND: a tensor or file named by the caller does not exist
 * @MOE_ERROR_MISSING_KEY: a required config key is missing
 * @MOE_ERROR_INVALID_CONFIG: a config value has the wrong type or range
 * @MOE_ERROR_OUT_OF_MEMORY: memory could not be allocated
 *
 * Error codes in the %MOE_ERROR domain.
 */
typedef enum {
  MOE_ERROR_FAILED,
  MOE_ERROR_INVALID_ARGUMENT,
  MOE_ERROR_SHAPE_MISMATCH,
  MOE_ERROR_DTYPE_MISMATCH,
  MOE_ERROR_UNKNOWN_BACKEND,
  MOE_ERROR_NOT_SUPPORTED,
  MOE_ERROR_NO_DEVICE,
  MOE_ERROR_PLUGIN_KEYFILE,
  MOE_ERROR_PLUGIN_LOAD,
  MOE_ERROR_PLUGIN_SYMBOL,
  MOE_ERROR_PLUGIN_ABI,
  MOE_ERROR_PLUGIN_INIT,
  MOE_ERROR_INVALID_CHECKPOINT,
  MOE_ERROR_NOT_FOUND,
  MOE_ERROR_MISSING_KEY,
  MOE_ERROR_INVALID_CONFIG,
  MOE_ERROR_OUT_OF_MEMORY,
} MoeError;

MOE_AVAILABLE_IN_ALL
GQuark moe_error_quark (void);

G_END_DECLS
