/* moe-batched-mm.c: the "batched_mm" experts backend
 *
 * One row per (token, slot): each row multiplies its own expert's weights,
 * read in place (never one weight copy per row, which is what makes
 * transformers' batched_mm run out of memory). The K slots of a token are
 * summed in slot order and rounded once.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>

#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

#define MOE_TYPE_BATCHED_MM_BACKEND (moe_batched_mm_backend_get_type ())
G_DECLARE_FINAL_TYPE (MoeBatchedMmBackend, moe_batched_mm_backend, MOE, BATCHED_MM_BACKEND, MoeExpertsBackend)

struct _MoeBatchedMmBackend
{
  MoeExpertsBackend parent_instance;
};

G_DEFINE_FINAL_TYPE (MoeBatchedMmBackend, moe_batched_mm_backend, MOE_TYPE_EXPERTS_BACKEND)

static MoeTensor *
moe_batched_mm_backend_forward (MoeExpertsBackend *backend,
                                MoeExperts        *experts,
                                MoeTensor         *hidden_states,
                                MoeTensor         *top_k_index,
                                MoeTensor         *top_k_weights,
                                GError           **error)
{
  MoeCpuExperts view;
  MoeDType dtype = moe_tensor_get_dtype (hidden_states);
  gsize T = moe_tensor_get_dim (hidden_states, 0);
  gsize K = moe_tensor_get_dim (top_k_index, 1);
  gsize H;
  const gint64 *ids = moe_tensor_get_data (top_k_index);
  g_autofree float *w = moe_cpu_tensor_dup_f32 (top_k_weights);
  g_autofree float *x = moe_cpu_tensor_dup_f32 (hidden_states);
  g_autofree float *out = NULL;
  g_autofree float *y = NULL;

  moe_cpu_experts_init (&view, experts, dtype);
  H = view.hidden;
  out = g_new0 (float, MAX (T * H, 1));
  y = g_new (float, H);

  for (gsize t = 0; t < T; t++)
    for (gsize k = 0; k < K; k++)
      {
        gint64 e = ids[t * K + k];
        float wt = w[t * K + k];
        float *o = out + t * H;

        if (e >= (gint64) view.num_experts)
          continue;   /* expert-parallel slot this rank does not own */
        moe_cpu_experts_run (&view, (guint) e, x + t * H, 1, y);
        for (gsize j = 0; j < H; j++)
          o[j] += y[j] * wt;
      }

  return moe_cpu_tensor_from_f32 (out, dtype, moe_tensor_get_shape (hidden_states, NULL), 2, error);
}

static void
moe_batched_mm_backend_class_init (MoeBatchedMmBackendClass *klass)
{
  MoeExpertsBackendClass *backend_class = MOE_EXPERTS_BACKEND_CLASS (klass);

  backend_class->forward = moe_batched_mm_backend_forward;
  /* on other devices than the CPU the device runs this schedule */
  moe_experts_backend_class_set_device_schedule (backend_class, MOE_EXPERTS_SCHEDULE_PER_ROW);
}

static void
moe_batched_mm_backend_init (MoeBatchedMmBackend *self)
{
}

static gboolean
batched_mm_plugin_init (GError **error)
{
  g_type_ensure (MOE_TYPE_BATCHED_MM_BACKEND);
  return TRUE;
}

MOE_PLUGIN_DEFINE (batched_mm, batched_mm_plugin_init)
