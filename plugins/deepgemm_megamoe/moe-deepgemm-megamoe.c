/* moe-deepgemm-megamoe.c: the "deepgemm_megamoe" experts backend
 *
 * DeepGEMM's Mega MoE (transformers' "deepgemm_megamoe"): one kernel doing
 * dispatch, both projections and combine across expert-parallel ranks, for
 * FP4 experts with UE8M0 scales on Blackwell (SM100). It needs an
 * expert-parallel process group, which libmoe does not have: this backend
 * checks what it can (the CPU, the device, the weights) so that the user
 * learns every missing piece, then always refuses. There is no kernel.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <moe-plugin.h>

#define REQUIREMENT "NVIDIA Blackwell (SM100) GPUs"

#define MOE_TYPE_DEEPGEMM_MEGAMOE_BACKEND (moe_deepgemm_megamoe_backend_get_type ())
G_DECLARE_FINAL_TYPE (MoeDeepgemmMegamoeBackend, moe_deepgemm_megamoe_backend,
                      MOE, DEEPGEMM_MEGAMOE_BACKEND, MoeExpertsBackend)

struct _MoeDeepgemmMegamoeBackend
{
  MoeExpertsBackend parent_instance;
};

G_DEFINE_FINAL_TYPE (MoeDeepgemmMegamoeBackend, moe_deepgemm_megamoe_backend, MOE_TYPE_EXPERTS_BACKEND)

static void
set_no_expert_parallel_error (GError **error)
{
  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
               "deepgemm_megamoe needs an expert-parallel process group (one rank per GPU, "
               "exchanging tokens over NVLink); libmoe has no expert-parallel runtime yet, "
               "so it cannot run");
}

static gboolean
moe_deepgemm_megamoe_backend_is_supported (MoeExpertsBackend *backend,
                                           MoeDevice         *device,
                                           MoeExperts        *experts,
                                           GError           **error)
{
  MoeTensor *scale = moe_experts_get_up_weight_scale (experts);

  if (!moe_experts_backend_require_gpu (backend, device, REQUIREMENT, error) ||
      !MOE_EXPERTS_BACKEND_CLASS (moe_deepgemm_megamoe_backend_parent_class)->is_supported (backend, device,
                                                                                            experts, error))
    return FALSE;

  if (moe_tensor_get_dtype (moe_experts_get_up_weight (experts)) != MOE_DTYPE_I8 ||
      scale == NULL || moe_tensor_get_dtype (scale) != MOE_DTYPE_E8M0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "deepgemm_megamoe runs FP4 experts with UE8M0 scales (expert_dtype=\"fp4\", "
                   "scale_fmt=\"ue8m0\"); these experts are %s with %s scales",
                   moe_experts_get_expert_dtype (experts),
                   scale != NULL ? moe_dtype_get_name (moe_tensor_get_dtype (scale)) : "no");
      return FALSE;
    }
  set_no_expert_parallel_error (error);
  return FALSE;
}

static MoeTensor *
moe_deepgemm_megamoe_backend_forward (MoeExpertsBackend *backend,
                                      MoeExperts        *experts,
                                      MoeTensor         *hidden_states,
                                      MoeTensor         *top_k_index,
                                      MoeTensor         *top_k_weights,
                                      GError           **error)
{
  set_no_expert_parallel_error (error);
  return NULL;
}

static void
moe_deepgemm_megamoe_backend_class_init (MoeDeepgemmMegamoeBackendClass *klass)
{
  MoeExpertsBackendClass *backend_class = MOE_EXPERTS_BACKEND_CLASS (klass);

  backend_class->is_supported = moe_deepgemm_megamoe_backend_is_supported;
  backend_class->forward = moe_deepgemm_megamoe_backend_forward;
  moe_experts_backend_class_set_device_schedule (backend_class, MOE_EXPERTS_SCHEDULE_FUSED_EXPERT_PARALLEL);
}

static void
moe_deepgemm_megamoe_backend_init (MoeDeepgemmMegamoeBackend *self)
{
}

static gboolean
deepgemm_megamoe_plugin_init (GError **error)
{
  g_type_ensure (MOE_TYPE_DEEPGEMM_MEGAMOE_BACKEND);
  return TRUE;
}

MOE_PLUGIN_DEFINE (deepgemm_megamoe, deepgemm_megamoe_plugin_init)
