/* moe-cpu-kernels.h: CPU math shared by the experts backends (plugin API,
 * not introspected)
 *
 * All activations are float32 inside; weights are read in place in their
 * stored dtype (F32, BF16 or F16), never copied per row.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <moe-plugin.h>

G_BEGIN_DECLS

typedef enum {
  MOE_CPU_ACT_SILU,
  MOE_CPU_ACT_GELU,
  MOE_CPU_ACT_GELU_TANH,
  MOE_CPU_ACT_RELU,
} MoeCpuActivation;

/**
 * MoeCpuMatrix: (skip)
 * @dtype: F32, BF16 or F16; F8E4M3 (FP8, block-scaled) or I8 (FP4 e2m1
 *   packed two per byte along @k), both stored `[n, k]`
 * @data: the first element of this matrix
 * @n: output features
 * @k: input features
 * @transposed: %FALSE when stored `[n, k]` (y = x·Wᵀ), %TRUE when stored `[k, n]` (y = x·W)
 * @scale: quantized weights only: FP8 `[scale_rows, ⌈k/128⌉]` (one per
 *   128×128 block), FP4 `[n, k/32]`; the weight is value × scale
 * @scale_dtype: F32 or E8M0
 * @scale_rows: FP8: the scale's rows
 * @scale_split: FP8 gate/up weights whose halves were scaled apart (the
 *   fused per-expert scales of a checkpoint: ⌈I/128⌉ rows each): I, the
 *   rows of the first half; 0 when the blocks run over all @n rows
 *
 * One expert's projection weight, viewed in place.
 */
typedef struct {
  MoeDType      dtype;
  gconstpointer data;
  gsize         n;
  gsize         k;
  gboolean      transposed;
  gconstpointer scale;
  MoeDType      scale_dtype;
  gsize         scale_rows;
  gsize         scale_split;
} MoeCpuMatrix;

/**
 * MoeCpuGate: (skip)
 * @has_gate: %FALSE for ungated experts: out = act(up)
 * @interleaved: GPT-OSS clamped SwiGLU on interleaved gate/up columns
 * @activation: the activation of the gate (or of up when ungated)
 * @alpha: clamped SwiGLU's alpha
 * @limit: clamped SwiGLU's limit
 * @round: F32, or BF16/F16 to round every intermediate value to that
 *   dtype as torch computes in it
 */
typedef struct {
  gboolean         has_gate;
  gboolean         interleaved;
  MoeCpuActivation activation;
  float            alpha;
  float            limit;
  MoeDType         round;
} MoeCpuGate;

/**
 * MoeCpuExperts: (skip)
 *
 * A host view of a [class@Experts] object's weights, for running one
 * expert at a time on contiguous rows.
 */
typedef struct {
  guint          num_experts;
  guint          hidden;
  guint          inter;
  guint          up_out;        /* 2I gated, I ungated */
  gboolean       transposed;
  MoeDType       up_dtype;
  MoeDType       down_dtype;
  const guint8  *up;
  const guint8  *down;
  MoeDType       up_bias_dtype;
  MoeDType       down_bias_dtype;
  const guint8  *up_bias;       /* nullable */
  const guint8  *down_bias;     /* nullable */
  MoeCpuGate     gate;
  /* quantized weights: scales of all experts, as MoeCpuMatrix describes */
  const guint8  *up_scale;      /* nullable */
  const guint8  *down_scale;    /* nullable */
  MoeDType       up_scale_dtype;
  MoeDType       down_scale_dtype;
  gsize          up_scale_rows;
  gsize          down_scale_rows;
  gsize          up_scale_split;
} MoeCpuExperts;

MOE_AVAILABLE_IN_ALL
void     moe_cpu_experts_init (MoeCpuExperts      *view,
                               MoeExperts         *experts,
                               MoeDType            act_dtype);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_experts_run  (const MoeCpuExperts *view,
                               guint               expert,
                               const float        *x,
                               gsize               m,
                               float              *y);

MOE_AVAILABLE_IN_ALL
float     *moe_cpu_tensor_dup_f32  (MoeTensor     *tensor);
MOE_AVAILABLE_IN_ALL
MoeTensor *moe_cpu_tensor_from_f32 (const float   *data,
                                    MoeDType       dtype,
                                    const gint64  *shape,
                                    guint          n_dims,
                                    GError       **error);

MOE_AVAILABLE_IN_ALL
gboolean moe_cpu_activation_from_name (const char        *name,
                                       MoeCpuActivation  *act);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_matmul      (const float        *x,
                              gsize               m,
                              const MoeCpuMatrix *w,
                              float              *y);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_round_array (float              *x,
                              gsize               n,
                              MoeDType            dtype);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_add_bias    (float              *rows,
                              gsize               m,
                              gsize               n,
                              MoeDType            dtype,
                              gconstpointer       bias);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_apply_gate  (const float        *up,
                              gsize               m,
                              gsize               inter,
                              const MoeCpuGate   *gate,
                              float              *out);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_convert     (MoeDType            src_dtype,
                              gconstpointer       src,
                              MoeDType            dst_dtype,
                              gpointer            dst,
                              gsize               n);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_gather_rows (MoeDType            dtype,
                              gconstpointer       src,
                              gsize               width,
                              const gint64       *rows,
                              gsize               n_rows,
                              float              *dst);
MOE_AVAILABLE_IN_ALL
float    moe_cpu_round_to    (float               v,
                              MoeDType            dtype);

/* Writes to every page of @mem (@size bytes that are about to be
 * overwritten) from several threads, so that a fresh buffer's first-touch
 * page faults are taken in parallel rather than one at a time by the copy
 * that fills it; below MOE_CPU_FAULT_IN_MIN bytes it does nothing */
#define MOE_CPU_FAULT_IN_MIN ((gsize) 8 << 20)
MOE_AVAILABLE_IN_ALL
void     moe_cpu_fault_in    (gpointer            mem,
                              gsize               size);

MOE_AVAILABLE_IN_ALL
gboolean moe_cpu_matrix_is_quantized   (const MoeCpuMatrix *w);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_dequantize_rows       (const MoeCpuMatrix *w,
                                        gsize               row0,
                                        gsize               rows,
                                        float              *dst);
MOE_AVAILABLE_IN_ALL
void     moe_cpu_quantize_activations  (const float        *x,
                                        gsize               m,
                                        gsize               k,
                                        float              *dst);
MOE_AVAILABLE_IN_ALL
float    moe_e4m3_to_f32               (guint8              v);
MOE_AVAILABLE_IN_ALL
float    moe_e8m0_to_f32               (guint8              v);
MOE_AVAILABLE_IN_ALL
float    moe_fp4_to_f32                (guint8              code);
MOE_AVAILABLE_IN_ALL
float    moe_f32_round_to_e4m3         (float               v);

static inline float
moe_bf16_to_f32 (guint16 v)
{
  union { guint32 u; float f; } c = { .u = (guint32) v << 16 };
  return c.f;
}

static inline guint16
moe_f32_to_bf16 (float f)
{
  union { float f; guint32 u; } c = { .f = f };
  if ((c.u & 0x7fffffff) > 0x7f800000)          /* NaN: keep it quiet */
    return (guint16) ((c.u >> 16) | 0x40);
  c.u += 0x7fff + ((c.u >> 16) & 1);            /* round to nearest even */
  return (guint16) (c.u >> 16);
}

MOE_AVAILABLE_IN_ALL
float    moe_f16_to_f32      (guint16             h);
MOE_AVAILABLE_IN_ALL
guint16  moe_f32_to_f16      (float               f);

G_END_DECLS
