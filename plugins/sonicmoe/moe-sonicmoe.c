/* moe-sonicmoe.c: the "sonicmoe" experts backend
 *
 * SonicMoE (transformers' "sonicmoe"): the whole routed forward (gather,
 * gated up projection, activation, down projection, weighted combine) in a
 * few fused kernels, for bf16 gated experts with SwiGLU, GeGLU or ReGLU.
 * There is no CPU code: the cuda device runs the FUSED schedule and checks
 * the compute capability; this class refuses the CPU and, as transformers
 * does on the first forward, experts SonicMoE cannot compute.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <moe-plugin.h>

#define REQUIREMENT "NVIDIA GPUs of compute capability 9.0 or newer"

#define MOE_TYPE_SONICMOE_BACKEND (moe_sonicmoe_backend_get_type ())
G_DECLARE_FINAL_TYPE (MoeSonicmoeBackend, moe_sonicmoe_backend, MOE, SONICMOE_BACKEND, MoeExpertsBackend)

struct _MoeSonicmoeBackend
{
  MoeExpertsBackend parent_instance;
};

G_DEFINE_FINAL_TYPE (MoeSonicmoeBackend, moe_sonicmoe_backend, MOE_TYPE_EXPERTS_BACKEND)

/* transformers' mapping of config.hidden_act to SonicMoE's activations
 * (gelu_pytorch_tanh is not in it) */
static const char * const activations[] = { "silu", "gelu", "relu", NULL };

static gboolean
moe_sonicmoe_backend_is_supported (MoeExpertsBackend *backend,
                                   MoeDevice         *device,
                                   MoeExperts        *experts,
                                   GError           **error)
{
  const char *act = moe_experts_get_activation (experts);

  if (!moe_experts_backend_require_gpu (backend, device, REQUIREMENT, error) ||
      !MOE_EXPERTS_BACKEND_CLASS (moe_sonicmoe_backend_parent_class)->is_supported (backend, device, experts, error))
    return FALSE;

  if (!moe_experts_get_has_gate (experts))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "sonicmoe needs gated experts (gate_up); these experts are ungated");
      return FALSE;
    }
  if (!g_strv_contains (activations, act))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "sonicmoe runs the activations silu (SwiGLU), gelu (GeGLU) and relu (ReGLU); "
                   "these experts use “%s”", act);
      return FALSE;
    }
  if (moe_experts_get_gate_layout (experts) == MOE_GATE_LAYOUT_INTERLEAVED)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "sonicmoe runs SwiGLU, GeGLU or ReGLU; GPT-OSS's interleaved clamped SwiGLU "
                   "(gate_layout=interleaved) is none of them");
      return FALSE;
    }
  if (moe_tensor_get_dtype (moe_experts_get_up_weight (experts)) != MOE_DTYPE_BF16)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "sonicmoe runs bf16 experts; these are %s", moe_experts_get_expert_dtype (experts));
      return FALSE;
    }
  return TRUE;
}

/* Only ever given CPU tensors, which is_supported refuses. */
static MoeTensor *
moe_sonicmoe_backend_forward (MoeExpertsBackend *backend,
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
moe_sonicmoe_backend_class_init (MoeSonicmoeBackendClass *klass)
{
  MoeExpertsBackendClass *backend_class = MOE_EXPERTS_BACKEND_CLASS (klass);

  backend_class->is_supported = moe_sonicmoe_backend_is_supported;
  backend_class->forward = moe_sonicmoe_backend_forward;
  moe_experts_backend_class_set_device_schedule (backend_class, MOE_EXPERTS_SCHEDULE_FUSED);
}

static void
moe_sonicmoe_backend_init (MoeSonicmoeBackend *self)
{
}

static gboolean
sonicmoe_plugin_init (GError **error)
{
  g_type_ensure (MOE_TYPE_SONICMOE_BACKEND);
  return TRUE;
}

MOE_PLUGIN_DEFINE (sonicmoe, sonicmoe_plugin_init)
