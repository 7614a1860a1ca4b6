/* moe-private.h: libmoe's internal API (never installed)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include "libmoe.h"
#include "moe-plugin.h"
#include "moe-cpu-kernels.h"

G_BEGIN_DECLS

/* GLib's GMutex sits on futexes ThreadSanitizer cannot see; libmoe's own
 * locks tell it about the ordering they establish, so a TSan build checks
 * libmoe's locking instead of reporting every access under a lock. */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire (void *addr);
void __tsan_release (void *addr);
# define moe_mutex_lock(m)   G_STMT_START { g_mutex_lock (m); __tsan_acquire (m); } G_STMT_END
# define moe_mutex_unlock(m) G_STMT_START { __tsan_release (m); g_mutex_unlock (m); } G_STMT_END
/* data handed to another thread through GLib (a GTask worker, an idle on
 * another thread's context): released by the sender, acquired by the taker */
# define moe_handoff_release(p) __tsan_release (p)
# define moe_handoff_acquire(p) __tsan_acquire (p)
#else
# define moe_mutex_lock(m)   g_mutex_lock (m)
# define moe_mutex_unlock(m) g_mutex_unlock (m)
# define moe_handoff_release(p) ((void) (p))
# define moe_handoff_acquire(p) ((void) (p))
#endif

/* Expert and linear weights stored quantized: FP8 (F8E4M3) or FP4 packed
 * two per byte (I8). */
static inline gboolean
_moe_dtype_is_quantized_weight (MoeDType d)
{
  return d == MOE_DTYPE_F8E4M3 || d == MOE_DTYPE_I8;
}

/* moe-cpu-quant.c: moe_cpu_matmul() on FP8/FP4 weights (dynamic activations) */
void     _moe_cpu_matmul_quantized    (const float        *x,
                                       gsize               m,
                                       const MoeCpuMatrix *w,
                                       float              *y);

MoeConfig *_moe_config_dup_object    (MoeConfig     *self,
                                       const char    *key);

/* moe-cpu-quant.c: a quantized weight ([n, k] or [E, n, k]) multiplied out
 * to @dtype; @split as MoeCpuMatrix's scale_split */
MoeTensor *_moe_dequantize           (MoeTensor     *weight,
                                      MoeTensor     *scale,
                                      gsize          split,
                                      MoeDType       dtype,
                                      GError       **error);

gboolean _moe_shape_n_elements        (const gint64  *shape,
                                       guint          n_dims,
                                       gint64        *n_elements,
                                       GError       **error);

/* Sets @error to "…; available: a, b, c" listing the registry's backends. */
void     _moe_set_unknown_backend     (GError       **error,
                                       MoePluginRegistry *registry,
                                       const char    *name);

gboolean _moe_env_is_trusted          (void);

GType    _moe_cpu_device_get_type     (void);

G_END_DECLS

#include <json-glib/json-glib.h>

G_BEGIN_DECLS
/* Whether fused experts gate_up [E, ·, ·] and down [E, ·, ·] are stored
 * transposed ([E, H, 2I] and [E, I, H], as Qwen3-VL-MoE's checkpoints)
 * rather than as transformers holds them ([E, 2I, H] and [E, H, I]). */
gboolean    _moe_fused_experts_transposed (const gint64 *up,
                                           const gint64 *down);
gboolean    _moe_checkpoint_check_file  (const char  *dir,
                                         const char  *name,
                                         GError     **error);
JsonObject *_moe_config_get_json_object (MoeConfig  *self);
gboolean    _moe_json_is_single_value   (const char *data,
                                         gsize       length);
MoeConfig  *_moe_config_new_for_json    (JsonNode   *node,
                                         const char *name);

/* Checks shapes, dtypes and ids; on success @index_out is the index as I64. */
gboolean _moe_experts_check_inputs (MoeExperts  *experts,
                                    MoeTensor   *hidden_states,
                                    MoeTensor   *top_k_index,
                                    MoeTensor   *top_k_weights,
                                    MoeTensor  **index_out,
                                    GError     **error);
G_END_DECLS
