/* libmoe.h: the only header applications include
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#define LIBMOE_INSIDE
# include "moe-version.h"
# include "moe-version-macros.h"
# include "moe-types.h"
# include "moe-enum-types.h"
# include "moe-error.h"
# include "moe-tensor.h"
# include "moe-device.h"
# include "moe-config.h"
# include "moe-experts.h"
# include "moe-experts-backend.h"
# include "moe-checkpoint.h"
# include "moe-plugin-info.h"
# include "moe-plugin-registry.h"
# include "moe-load-options.h"
# include "moe-generation-config.h"
# include "moe-model.h"
# include "moe-quantize.h"
#undef LIBMOE_INSIDE
