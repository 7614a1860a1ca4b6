/* moe-deepgemm.c: the "deepgemm" experts backend
 *
 * DeepGEMM's M-grouped GEMMs (transformers' "deepgemm"): rows sorted by
 * expert into groups padded to the GEMM's m-tile, the GEMMs compiled just
 * in time for the shapes with the CUDA toolkit; bf16 experts, FP8 (e4m3)
 * experts with block scales, or FP4 experts on Blackwell. There is no CPU
 * code: the cuda device runs the DEEPGEMM schedule and checks the compute
 * capability, the toolkit and the hidden states' dtype; this class refuses
 * the CPU and weights DeepGEMM has no kernel for.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <moe-plugin.h>

#define REQUIREMENT "NVIDIA GPUs of compute capability 9.0 (Hopper) or 10.x (Blackwell)"

#define MOE_TYPE_DEEPGEMM_BACKEND (moe_deepgemm_backend_get_type ())
G_DECLARE_FINAL_TYPE (MoeDeepgemmBackend, moe_deepgemm_backend, MOE, DEEPGEMM_BACKEND, MoeExpertsBackend)

struct _MoeDeepgemmBackend
{
  MoeExpertsBackend parent_instance;
};

G_DEFINE_FINAL_TYPE (MoeDeepgemmBackend, moe_deepgemm_backend, MOE_TYPE_EXPERTS_BACKEND)

static gboolean
moe_deepgemm_backend_is_supported (MoeExpertsBackend *backend,
                                   MoeDevice         *device,
                                   MoeExperts        *experts,
                                   GError           **error)
{
  if (!moe_experts_backend_require_gpu (backend, device, REQUIREMENT, error) ||
      !MOE_EXPERTS_BACKEND_CLASS (moe_deepgemm_backend_parent_class)->is_supported (backend, device, experts, error))
    return FALSE;

  switch (moe_tensor_get_dtype (moe_experts_get_up_weight (experts)))
    {
    case MOE_DTYPE_BF16:
    case MOE_DTYPE_F8E4M3:
    case MOE_DTYPE_I8:       /* FP4, packed; the device checks for SM100 */
      return TRUE;
    default:
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "deepgemm runs bf16 experts, FP8 (e4m3) experts with 128×128 or 1×128 block scales "
                   "in float32 or UE8M0, or FP4 experts with UE8M0 scales (SM100); these are %s",
                   moe_experts_get_expert_dtype (experts));
      return FALSE;
    }
}

/* Only ever given CPU tensors, which is_supported refuses. */
static MoeTensor *
moe_deepgemm_backend_forward (MoeExpertsBackend *backend,
                              MoeExperts        *experts,
                              MoeTensor         *hidden_states,
                              MoeTensor         *top_k_index,
                              MoeTensor         *top_k_weights,
                              GError           **error)
{
  moe_experts_backend_require_gpu (backend, moe_device_get_cpu (), REQUIREMENT, error);
  return NULL;
}

static void
moe_deepgemm_backend_class_init (MoeDeepgemmBackendClass *klass)
{
  MoeExpertsBackendClass *backend_class = MOE_EXPERTS_BACKEND_CLASS (klass);

  backend_class->is_supported = moe_deepgemm_backend_is_supported;
  backend_class->forward = moe_deepgemm_backend_forward;
  moe_experts_backend_class_set_device_schedule (backend_class, MOE_EXPERTS_SCHEDULE_DEEPGEMM);
}

static void
moe_deepgemm_backend_init (MoeDeepgemmBackend *self)
{
}

static gboolean
deepgemm_plugin_init (GError **error)
{
  g_type_ensure (MOE_TYPE_DEEPGEMM_BACKEND);
  return TRUE;
}

MOE_PLUGIN_DEFINE (deepgemm, deepgemm_plugin_init)
