/* fixture-backend.h: the small experts backend the fixture plugins share
 *
 * Only for tests/plugins: a working backend whose output is easy to check,
 * out[t] = x[t] · Σ_k w[t,k] over the slots that name an expert (a slot
 * holding the sentinel id E adds nothing), and macros to declare types and
 * descriptors by hand where a fixture must get them wrong.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

static G_GNUC_UNUSED MoeTensor *
fixture_backend_forward (MoeExpertsBackend *backend,
                         MoeExperts        *experts,
                         MoeTensor         *hidden_states,
                         MoeTensor         *top_k_index,
                         MoeTensor         *top_k_weights,
                         GError           **error)
{
  gsize T = moe_tensor_get_dim (hidden_states, 0);
  gsize H = moe_tensor_get_dim (hidden_states, 1);
  gsize K = moe_tensor_get_dim (top_k_index, 1);
  gint64 E = moe_experts_get_num_experts (experts);
  const gint64 *ids = moe_tensor_get_data (top_k_index);
  g_autofree float *x = moe_cpu_tensor_dup_f32 (hidden_states);
  g_autofree float *w = moe_cpu_tensor_dup_f32 (top_k_weights);

  for (gsize t = 0; t < T; t++)
    {
      float s = 0;
      for (gsize k = 0; k < K; k++)
        if (ids[t * K + k] < E)
          s += w[t * K + k];
      for (gsize j = 0; j < H; j++)
        x[t * H + j] *= s;
    }
  return moe_cpu_tensor_from_f32 (x, moe_tensor_get_dtype (hidden_states),
                                  moe_tensor_get_shape (hidden_states, NULL), 2, error);
}

/* A final MoeExpertsBackend subclass running fixture_backend_forward(). */
#define FIXTURE_DEFINE_BACKEND(TypeName, type_name)                            \
  typedef struct { MoeExpertsBackend parent_instance; } TypeName;              \
  typedef struct { MoeExpertsBackendClass parent_class; } TypeName##Class;     \
  static GType type_name##_get_type (void);                                    \
  G_DEFINE_FINAL_TYPE (TypeName, type_name, MOE_TYPE_EXPERTS_BACKEND)          \
  static void                                                                  \
  type_name##_class_init (TypeName##Class *klass)                              \
  {                                                                            \
    MOE_EXPERTS_BACKEND_CLASS (klass)->forward = fixture_backend_forward;      \
  }                                                                            \
  static void                                                                  \
  type_name##_init (TypeName *self)                                            \
  {                                                                            \
  }

/* What MOE_PLUGIN_DEFINE expands to, with every field chosen by the
 * fixture: the exported moe_plugin_<module>_get_desc() returning @desc_expr
 * (a `const MoePluginDesc *`). */
#define FIXTURE_DEFINE_DESC(module, desc_expr)                                 \
  G_MODULE_EXPORT const MoePluginDesc *G_PASTE (G_PASTE (moe_plugin_, module), _get_desc) (void); \
  G_MODULE_EXPORT const MoePluginDesc *                                        \
  G_PASTE (G_PASTE (moe_plugin_, module), _get_desc) (void)                    \
  {                                                                            \
    return (desc_expr);                                                        \
  }

/* An init function for descriptors that libmoe must refuse before init. */
static G_GNUC_UNUSED gboolean
fixture_init_must_not_run (GError **error)
{
  g_error ("a plugin whose descriptor is refused was initialised");
  return FALSE;
}

/* Records in the environment (process-wide, and it outlives dlclose()) that
 * the module was opened: MOE_TEST_OPENED_<module>=1. */
#define FIXTURE_RECORD_OPEN(module)                                            \
  __attribute__ ((constructor)) static void                                    \
  fixture_record_open (void)                                                   \
  {                                                                            \
    g_setenv ("MOE_TEST_OPENED_" G_STRINGIFY (module), "1", TRUE);             \
  }
