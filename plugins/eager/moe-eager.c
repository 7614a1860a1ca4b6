/* moe-eager.c: the "eager" experts backend
 *
 * transformers' own loop: for every expert that was hit, in ascending id,
 * gather its tokens, run the expert over them, scale by the routing weight
 * and add into the output in the hidden dtype.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

#define MOE_TYPE_EAGER_BACKEND (moe_eager_backend_get_type ())
G_DECLARE_FINAL_TYPE (MoeEagerBackend, moe_eager_backend, MOE, EAGER_BACKEND, MoeExpertsBackend)

struct _MoeEagerBackend
{
  MoeExpertsBackend parent_instance;
};

G_DEFINE_FINAL_TYPE (MoeEagerBackend, moe_eager_backend, MOE_TYPE_EXPERTS_BACKEND)

static MoeTensor *
moe_eager_backend_forward (MoeExpertsBackend *backend,
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
  gsize H, E;
  const gint64 *ids = moe_tensor_get_data (top_k_index);
  g_autofree float *w = moe_cpu_tensor_dup_f32 (top_k_weights);
  g_autofree float *out = NULL;
  g_autofree gsize *counts = NULL;
  g_autofree gint64 *tokens = NULL;
  g_autofree gsize *slots = NULL;
  g_autofree float *x = NULL;
  g_autofree float *y = NULL;

  moe_cpu_experts_init (&view, experts, dtype);
  H = view.hidden;
  E = view.num_experts;

  out = g_new0 (float, MAX (T * H, 1));
  counts = g_new0 (gsize, E + 1);
  tokens = g_new (gint64, MAX (T * K, 1));
  slots = g_new (gsize, MAX (T * K, 1));
  x = g_new (float, MAX (T * H, 1));
  y = g_new (float, MAX (T * H, 1));

  for (gsize i = 0; i < T * K; i++)
    counts[ids[i]]++;

  for (gsize e = 0; e < E; e++)
    {
      gsize n = 0;

      if (counts[e] == 0)
        continue;
      /* transformers' where(mask[e]): slot-major, then token */
      for (gsize k = 0; k < K; k++)
        for (gsize t = 0; t < T; t++)
          if ((gsize) ids[t * K + k] == e)
            {
              tokens[n] = (gint64) t;
              slots[n] = k;
              n++;
            }

      moe_cpu_gather_rows (dtype, moe_tensor_get_data (hidden_states), H, tokens, n, x);
      moe_cpu_experts_run (&view, (guint) e, x, n, y);

      /* each contribution is rounded to the hidden dtype before it is added */
      for (gsize r = 0; r < n; r++)
        {
          float wt = w[tokens[r] * K + slots[r]];
          float *o = out + tokens[r] * H;
          const float *yr = y + r * H;
          for (gsize j = 0; j < H; j++)
            o[j] = moe_cpu_round_to (o[j] + moe_cpu_round_to (yr[j] * wt, dtype), dtype);
        }
    }

  return moe_cpu_tensor_from_f32 (out, dtype, moe_tensor_get_shape (hidden_states, NULL), 2, error);
}

static void
moe_eager_backend_class_init (MoeEagerBackendClass *klass)
{
  MoeExpertsBackendClass *backend_class = MOE_EXPERTS_BACKEND_CLASS (klass);

  backend_class->forward = moe_eager_backend_forward;
  /* on other devices than the CPU the device runs this schedule */
  moe_experts_backend_class_set_device_schedule (backend_class, MOE_EXPERTS_SCHEDULE_PER_EXPERT);
}

static void
moe_eager_backend_init (MoeEagerBackend *self)
{
}

static gboolean
eager_plugin_init (GError **error)
{
  g_type_ensure (MOE_TYPE_EAGER_BACKEND);
  return TRUE;
}

MOE_PLUGIN_DEFINE (eager, eager_plugin_init)
