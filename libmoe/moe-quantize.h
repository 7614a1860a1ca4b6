/* moe-quantize.h: FP8 and FP4 quantization of expert weights
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <gio/gio.h>

#include "moe-types.h"
#include "moe-tensor.h"

G_BEGIN_DECLS

/**
 * MoeQuantFormat:
 * @MOE_QUANT_FORMAT_FP8: e4m3 weights, one float32 scale per 128×128 block
 *   (amax / 448): DeepSeek-V3's format, `scale_fmt: "float"`
 * @MOE_QUANT_FORMAT_FP8_UE8M0: the same with the scales rounded up to
 *   powers of two and stored as UE8M0, `scale_fmt: "ue8m0"`
 * @MOE_QUANT_FORMAT_FP4: e2m1 codes packed two per byte (I8), one UE8M0
 *   scale per row and 32 inputs (amax / 6 rounded up to a power of two),
 *   `expert_dtype: "fp4"`
 *
 * How [method@Tensor.quantize] and [func@quantize_checkpoint] quantize.
 */
typedef enum {
  MOE_QUANT_FORMAT_FP8,
  MOE_QUANT_FORMAT_FP8_UE8M0,
  MOE_QUANT_FORMAT_FP4,
} MoeQuantFormat;

MOE_AVAILABLE_IN_ALL
gboolean    moe_quant_format_from_name (const char      *name,
                                        MoeQuantFormat  *format);

MOE_AVAILABLE_IN_ALL
MoeTensor  *moe_tensor_quantize        (MoeTensor       *self,
                                        MoeQuantFormat   format,
                                        MoeTensor      **scale,
                                        GError         **error);

MOE_AVAILABLE_IN_ALL
gboolean    moe_quantize_checkpoint    (const char      *source,
                                        const char      *destination,
                                        MoeQuantFormat   format,
                                        GCancellable    *cancellable,
                                        GError         **error);

G_END_DECLS
