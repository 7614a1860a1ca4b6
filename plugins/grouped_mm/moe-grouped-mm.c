/* moe-grouped-mm.c: the "grouped_mm" experts backend
 *
 * Sort the (token, slot) rows by expert, gather them once into one
 * contiguous buffer, and run one GEMM per expert over its row range
 * (a grouped GEMM); then weight, un-permute and sum the K slots in slot
 * order, rounding once. Slots holding the expert-parallel sentinel id E
 * sort past the last group and contribute zero.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>

#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

#define MOE_TYPE_GROUPED_MM_BACKEND (moe_grouped_mm_backend_get_type ())
G_DECLARE_FINAL_TYPE (MoeGroupedMmBackend, moe_grouped_mm_backend, MOE, GROUPED_MM_BACKEND, MoeExpertsBackend)

struct _MoeGroupedMmBackend
{
  MoeExpertsBackend parent_instance;
};

G_DEFINE_FINAL_TYPE (MoeGroupedMmBackend, moe_grouped_mm_backend, MOE_TYPE_EXPERTS_BACKEND)

static MoeTensor *
moe_grouped_mm_backend_forward (MoeExpertsBackend *backend,
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
  gsize S = T * K, H, E;
  const gint64 *ids = moe_tensor_get_data (top_k_index);
  g_autofree float *w = moe_cpu_tensor_dup_f32 (top_k_weights);
  g_autofree gsize *offsets = NULL;   /* offsets[e] = first sorted row of expert e */
  g_autofree gsize *sorted_pos = NULL; /* slot s -> its row in sorted order */
  g_autofree gint64 *sorted_token = NULL;
  g_autofree float *xg = NULL;
  g_autofree float *yg = NULL;
  g_autofree float *out = NULL;

  moe_cpu_experts_init (&view, experts, dtype);
  H = view.hidden;
  E = view.num_experts;

  /* counting sort by expert id: stable, sentinels (id E) last */
  offsets = g_new0 (gsize, E + 2);
  for (gsize s = 0; s < S; s++)
    offsets[ids[s] + 1]++;
  for (gsize e = 0; e <= E; e++)
    offsets[e + 1] += offsets[e];

  sorted_pos = g_new (gsize, MAX (S, 1));
  sorted_token = g_new (gint64, MAX (S, 1));
  {
    g_autofree gsize *fill = g_memdup2 (offsets, (E + 1) * sizeof (gsize));
    for (gsize s = 0; s < S; s++)
      {
        gsize r = fill[ids[s]]++;
        sorted_pos[s] = r;
        sorted_token[r] = (gint64) (s / K);
      }
  }

  /* one gather of the routed rows (sentinel rows are not computed) */
  xg = g_new (float, MAX (offsets[E] * H, 1));
  yg = g_new (float, MAX (offsets[E] * H, 1));
  moe_cpu_gather_rows (dtype, moe_tensor_get_data (hidden_states), H, sorted_token, offsets[E], xg);

  for (gsize e = 0; e < E; e++)
    moe_cpu_experts_run (&view, (guint) e, xg + offsets[e] * H, offsets[e + 1] - offsets[e],
                         yg + offsets[e] * H);

  /* weight, un-permute and sum the K slots in slot order */
  out = g_new0 (float, MAX (T * H, 1));
  for (gsize t = 0; t < T; t++)
    {
      float *o = out + t * H;
      for (gsize k = 0; k < K; k++)
        {
          gsize s = t * K + k;
          const float *yr;
          float wt;

          if (ids[s] >= (gint64) E)
            continue;
          yr = yg + sorted_pos[s] * H;
          wt = w[s];
          for (gsize j = 0; j < H; j++)
            o[j] += yr[j] * wt;
        }
    }

  return moe_cpu_tensor_from_f32 (out, dtype, moe_tensor_get_shape (hidden_states, NULL), 2, error);
}

static void
moe_grouped_mm_backend_class_init (MoeGroupedMmBackendClass *klass)
{
  MoeExpertsBackendClass *backend_class = MOE_EXPERTS_BACKEND_CLASS (klass);

  backend_class->forward = moe_grouped_mm_backend_forward;
  /* on other devices than the CPU the device runs this schedule */
  moe_experts_backend_class_set_device_schedule (backend_class, MOE_EXPERTS_SCHEDULE_GROUPED);
}

static void
moe_grouped_mm_backend_init (MoeGroupedMmBackend *self)
{
}

static gboolean
grouped_mm_plugin_init (GError **error)
{
  g_type_ensure (MOE_TYPE_GROUPED_MM_BACKEND);
  return TRUE;
}

MOE_PLUGIN_DEFINE (grouped_mm, grouped_mm_plugin_init)
