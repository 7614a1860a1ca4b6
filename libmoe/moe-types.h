/* moe-types.h: enumerations and forward declarations shared by libmoe's API
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <glib-object.h>

#include "moe-version-macros.h"

G_BEGIN_DECLS

/**
 * MoeDType:
 * @MOE_DTYPE_F32: IEEE float32
 * @MOE_DTYPE_F16: IEEE float16
 * @MOE_DTYPE_BF16: bfloat16
 * @MOE_DTYPE_F64: IEEE float64 (reference data)
 * @MOE_DTYPE_F8E4M3: float8 e4m3 (finite, "fn" variant)
 * @MOE_DTYPE_E8M0: unsigned 8-bit exponent, value 2^(e-127) (UE8M0 scales)
 * @MOE_DTYPE_I8: signed 8-bit integer (also FP4 e2m1 packed two per byte)
 * @MOE_DTYPE_U8: unsigned 8-bit integer
 * @MOE_DTYPE_I16: signed 16-bit integer
 * @MOE_DTYPE_I32: signed 32-bit integer
 * @MOE_DTYPE_I64: signed 64-bit integer
 * @MOE_DTYPE_BOOL: boolean, one byte
 *
 * The element type of a [class@Tensor].
 */
typedef enum {
  MOE_DTYPE_F32,
  MOE_DTYPE_F16,
  MOE_DTYPE_BF16,
  MOE_DTYPE_F64,
  MOE_DTYPE_F8E4M3,
  MOE_DTYPE_E8M0,
  MOE_DTYPE_I8,
  MOE_DTYPE_U8,
  MOE_DTYPE_I16,
  MOE_DTYPE_I32,
  MOE_DTYPE_I64,
  MOE_DTYPE_BOOL,
} MoeDType;

/**
 * MoeGateLayout:
 * @MOE_GATE_LAYOUT_CONCATENATED: the 2I axis holds all gate rows, then all up rows
 * @MOE_GATE_LAYOUT_INTERLEAVED: the 2I axis alternates gate, up, gate, up… and the
 *   gate is GPT-OSS's clamped SwiGLU (`(up + 1) · gate · σ(alpha · gate)`)
 *
 * How the gate and up projections share the fused `gate_up` weight.
 */
typedef enum {
  MOE_GATE_LAYOUT_CONCATENATED,
  MOE_GATE_LAYOUT_INTERLEAVED,
} MoeGateLayout;

/**
 * MoeExpertsSchedule:
 * @MOE_EXPERTS_SCHEDULE_PER_EXPERT: loop over the experts that were hit, one
 *   matrix product per expert over its rows ("eager")
 * @MOE_EXPERTS_SCHEDULE_PER_ROW: one row per (token, slot), each multiplying
 *   its own expert's weights read in place ("batched_mm")
 * @MOE_EXPERTS_SCHEDULE_GROUPED: rows sorted by expert, one grouped matrix
 *   product per projection over contiguous row ranges ("grouped_mm")
 * @MOE_EXPERTS_SCHEDULE_DEEPGEMM: rows sorted by expert into groups padded to
 *   the GEMM's m-tile, grouped GEMMs compiled just in time for the shapes
 *   with the CUDA toolkit; bf16 or FP8 block-scaled experts, SM90+ ("deepgemm")
 * @MOE_EXPERTS_SCHEDULE_FUSED: the whole routed forward (gather, gated up
 *   projection, activation, down projection, weighted combine) in a few
 *   fused kernels; bf16, gated experts, SM90+ ("sonicmoe")
 * @MOE_EXPERTS_SCHEDULE_FUSED_EXPERT_PARALLEL: one kernel doing dispatch,
 *   both projections and combine across expert-parallel ranks; FP4 experts
 *   with UE8M0 scales on Blackwell (SM100) ("deepgemm_megamoe")
 *
 * How an experts backend orders the experts' matrix products; a device
 * other than the CPU runs the built-in backends by their schedule.
 */
typedef enum {
  MOE_EXPERTS_SCHEDULE_PER_EXPERT,
  MOE_EXPERTS_SCHEDULE_PER_ROW,
  MOE_EXPERTS_SCHEDULE_GROUPED,
  MOE_EXPERTS_SCHEDULE_DEEPGEMM,
  MOE_EXPERTS_SCHEDULE_FUSED,
  MOE_EXPERTS_SCHEDULE_FUSED_EXPERT_PARALLEL,
} MoeExpertsSchedule;

MOE_AVAILABLE_IN_ALL
gsize        moe_dtype_get_size   (MoeDType dtype);
MOE_AVAILABLE_IN_ALL
const char  *moe_dtype_get_name   (MoeDType dtype);
MOE_AVAILABLE_IN_ALL
gboolean     moe_dtype_from_name  (const char *name,
                                   MoeDType   *dtype);
MOE_AVAILABLE_IN_ALL
gboolean     moe_dtype_is_float   (MoeDType dtype);

typedef struct _MoeTensor MoeTensor;
typedef struct _MoeDevice MoeDevice;
typedef struct _MoeExperts MoeExperts;
typedef struct _MoeExpertsBackend MoeExpertsBackend;
typedef struct _MoeModel MoeModel;

G_END_DECLS
