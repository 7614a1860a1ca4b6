/* test-gpu-backends.c: the backends that need a GPU (deepgemm, sonicmoe,
 * deepgemm_megamoe), as the build's plugins, on a machine without one
 *
 * On the CPU each refuses with MOE_ERROR_NOT_SUPPORTED naming what it needs.
 * On another device each hands its schedule to the device (a fake one here,
 * which says yes or no) and then checks what only the experts object tells:
 * the weights' dtype, the gate and the activation, the scales, and, for
 * deepgemm_megamoe, the expert-parallel group libmoe does not have. The cuda
 * device's own checks are the gpu suite's.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>

#include <libmoe.h>
#include <moe-plugin.h>

#include "moe-test-experts-fixture.h"

#define CPU_HINT "through the cuda device; these experts are on cpu " \
  "(move them with moe_tensor_to_device or load the model with device=cuda)"
#define NO_EXPERT_PARALLEL "deepgemm_megamoe needs an expert-parallel process group (one rank per GPU, " \
  "exchanging tokens over NVLink); libmoe has no expert-parallel runtime yet, so it cannot run"

typedef struct {
  const char         *name;
  MoeExpertsSchedule  schedule;
  const char         *cpu_message;
  const char         *forward_message;  /* the class's forward's, if ever reached */
} GpuBackend;

static const GpuBackend gpu_backends[] = {
  { "deepgemm", MOE_EXPERTS_SCHEDULE_DEEPGEMM,
    "deepgemm runs on NVIDIA GPUs of compute capability 9.0 (Hopper) or 10.x (Blackwell) " CPU_HINT,
    "deepgemm runs on NVIDIA GPUs of compute capability 9.0 (Hopper) or 10.x (Blackwell) " CPU_HINT },
  { "sonicmoe", MOE_EXPERTS_SCHEDULE_FUSED,
    "sonicmoe runs on NVIDIA GPUs of compute capability 9.0 or newer " CPU_HINT,
    "sonicmoe runs on NVIDIA GPUs of compute capability 9.0 or newer " CPU_HINT },
  { "deepgemm_megamoe", MOE_EXPERTS_SCHEDULE_FUSED_EXPERT_PARALLEL,
    "deepgemm_megamoe runs on NVIDIA Blackwell (SM100) GPUs " CPU_HINT, NO_EXPERT_PARALLEL },
};

/* --- a fake GPU: remembers the schedule it was asked about, says yes or no */

#define TEST_TYPE_FAKE_GPU (test_fake_gpu_get_type ())
G_DECLARE_FINAL_TYPE (TestFakeGpu, test_fake_gpu, TEST, FAKE_GPU, MoeDevice)

struct _TestFakeGpu
{
  MoeDevice parent_instance;
  gboolean  supports;
  int       asked;      /* the last schedule asked about, or -1 */
};

G_DEFINE_FINAL_TYPE (TestFakeGpu, test_fake_gpu, MOE_TYPE_DEVICE)

static gboolean
fake_gpu_supports_experts (MoeDevice *device, MoeExpertsSchedule schedule, MoeExperts *experts, GError **error)
{
  TestFakeGpu *self = TEST_FAKE_GPU (device);

  self->asked = schedule;
  if (!self->supports)
    g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED, "fake-gpu says no");
  return self->supports;
}

static MoeTensor *
fake_gpu_run_experts (MoeDevice *device, MoeExpertsSchedule schedule, MoeExperts *experts,
                      MoeTensor *hidden_states, MoeTensor *top_k_index, MoeTensor *top_k_weights, GError **error)
{
  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED, "fake-gpu runs nothing");
  return NULL;
}

static void
test_fake_gpu_class_init (TestFakeGpuClass *klass)
{
  MOE_DEVICE_CLASS (klass)->supports_experts = fake_gpu_supports_experts;
  MOE_DEVICE_CLASS (klass)->run_experts = fake_gpu_run_experts;
}

static void
test_fake_gpu_init (TestFakeGpu *self)
{
  self->supports = TRUE;
  self->asked = -1;
}

/* --- helpers ---------------------------------------------------------------- */

static MoeExpertsBackend *
get_backend (const char *name)
{
  g_autoptr(GError) error = NULL;
  MoeExpertsBackend *backend = moe_plugin_registry_get_backend (moe_plugin_registry_get_default (), name, &error);

  g_assert_no_error (error);
  g_assert_cmpstr (moe_experts_backend_get_name (backend), ==, name);
  return backend;
}

/* --- tests -------------------------------------------------------------- */

/* Installed with the build, listed for the cuda device, not for the CPU. */
static void
test_listed (void)
{
  MoePluginRegistry *registry = moe_plugin_registry_get_default ();
  g_auto(GStrv) all = moe_plugin_registry_list_backends (registry);
  g_auto(GStrv) cpu = moe_plugin_registry_list_backends_for_device (registry, "cpu");
  g_auto(GStrv) cuda = moe_plugin_registry_list_backends_for_device (registry, "cuda");

  for (guint i = 0; i < G_N_ELEMENTS (gpu_backends); i++)
    {
      MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND,
                                                        gpu_backends[i].name);
      g_assert_nonnull (info);
      g_assert_nonnull (strstr (moe_plugin_info_get_description (info), "NVIDIA"));
      g_assert_true (g_strv_contains ((const char * const *) all, gpu_backends[i].name));
      g_assert_true (g_strv_contains ((const char * const *) cuda, gpu_backends[i].name));
      g_assert_false (g_strv_contains ((const char * const *) cpu, gpu_backends[i].name));
    }
}

/* Experts on the CPU, as a user would run them: refused by the forward, by
 * is_supported, and by the class's forward if it were ever reached. */
static void
test_cpu_refused (void)
{
  Case c = { 0, };

  case_load (&c, "silu_concat", MOE_DTYPE_BF16, NULL);
  for (guint i = 0; i < G_N_ELEMENTS (gpu_backends); i++)
    {
      const GpuBackend *b = &gpu_backends[i];
      MoeExpertsBackend *backend = get_backend (b->name);
      g_autoptr(GError) error = NULL;
      g_autoptr(MoeTensor) out = NULL;

      moe_experts_set_implementation (c.experts, b->name);
      out = moe_experts_forward (c.experts, c.hidden, c.index, c.weights, &error);
      g_assert_null (out);
      g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
      g_assert_cmpstr (error->message, ==, b->cpu_message);
      g_clear_error (&error);

      g_assert_false (moe_experts_backend_is_supported (backend, moe_device_get_cpu (), c.experts, &error));
      g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
      g_assert_cmpstr (error->message, ==, b->cpu_message);
      g_clear_error (&error);

      out = MOE_EXPERTS_BACKEND_GET_CLASS (backend)->forward (backend, c.experts, c.hidden, c.index,
                                                              c.weights, &error);
      g_assert_null (out);
      g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
      g_assert_cmpstr (error->message, ==, b->forward_message);
    }
  case_clear (&c);
}

/* Elsewhere each asks the device with its schedule first, and a device's
 * no is the answer. */
static void
test_device_asked (void)
{
  Case c = { 0, };

  case_load (&c, "silu_concat", MOE_DTYPE_BF16, NULL);
  for (guint i = 0; i < G_N_ELEMENTS (gpu_backends); i++)
    {
      g_autoptr(TestFakeGpu) gpu = g_object_new (TEST_TYPE_FAKE_GPU, "name", "fake-gpu", NULL);
      g_autoptr(GError) error = NULL;

      gpu->supports = FALSE;
      g_assert_false (moe_experts_backend_is_supported (get_backend (gpu_backends[i].name), MOE_DEVICE (gpu),
                                                        c.experts, &error));
      g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
      g_assert_cmpstr (error->message, ==, "fake-gpu says no");
      g_assert_cmpint (gpu->asked, ==, gpu_backends[i].schedule);
    }
  case_clear (&c);
}

/* What each backend checks on the experts once the device said yes: a
 * fixture in @dtype (quantized ones keep their FP8/FP4 weights), with
 * @activation if set, runs (@refusal NULL) or is refused with @refusal. */
typedef struct {
  const char *backend;
  const char *dir;
  const char *fixture;
  MoeDType    dtype;
  const char *activation;
  const char *refusal;
} GpuCase;

#define DEEPGEMM_DTYPES "deepgemm runs bf16 experts, FP8 (e4m3) experts with 128×128 or 1×128 block scales " \
  "in float32 or UE8M0, or FP4 experts with UE8M0 scales (SM100); these are "
#define SONICMOE_ACTIVATIONS "sonicmoe runs the activations silu (SwiGLU), gelu (GeGLU) and relu (ReGLU); " \
  "these experts use "
#define MEGAMOE_FP4 "deepgemm_megamoe runs FP4 experts with UE8M0 scales (expert_dtype=\"fp4\", " \
  "scale_fmt=\"ue8m0\"); these experts are "

static const GpuCase gpu_cases[] = {
  /* deepgemm: bf16, FP8 (float32 or UE8M0 scales) and FP4; not f32 or f16 */
  { "deepgemm", "experts", "silu_concat", MOE_DTYPE_BF16, NULL, NULL },
  { "deepgemm", "experts", "silu_concat", MOE_DTYPE_F32, NULL, DEEPGEMM_DTYPES "f32" },
  { "deepgemm", "experts", "silu_concat", MOE_DTYPE_F16, NULL, DEEPGEMM_DTYPES "f16" },
  { "deepgemm", "quant/experts", "fp8_aligned", MOE_DTYPE_F32, NULL, NULL },
  { "deepgemm", "quant/experts", "fp8_ue8m0_aligned", MOE_DTYPE_F32, NULL, NULL },
  { "deepgemm", "quant/experts", "fp4_aligned", MOE_DTYPE_F32, NULL, NULL },
  /* sonicmoe: gated, then silu/gelu/relu (not gelu_pytorch_tanh, as
   * transformers), then not GPT-OSS's clamped SwiGLU, then bf16 */
  { "sonicmoe", "experts", "silu_concat", MOE_DTYPE_BF16, NULL, NULL },
  { "sonicmoe", "experts", "silu_concat", MOE_DTYPE_BF16, "gelu", NULL },
  { "sonicmoe", "experts", "silu_concat", MOE_DTYPE_BF16, "relu", NULL },
  { "sonicmoe", "experts", "silu_concat", MOE_DTYPE_BF16, "gelu_pytorch_tanh",
    SONICMOE_ACTIVATIONS "“gelu_pytorch_tanh”" },
  { "sonicmoe", "experts", "silu_concat", MOE_DTYPE_F32, "gelu_pytorch_tanh",
    SONICMOE_ACTIVATIONS "“gelu_pytorch_tanh”" },
  { "sonicmoe", "experts", "relu_ungated", MOE_DTYPE_F32, NULL,
    "sonicmoe needs gated experts (gate_up); these experts are ungated" },
  { "sonicmoe", "experts", "gptoss_bias_transposed_interleaved", MOE_DTYPE_BF16, NULL,
    "sonicmoe runs SwiGLU, GeGLU or ReGLU; GPT-OSS's interleaved clamped SwiGLU "
    "(gate_layout=interleaved) is none of them" },
  { "sonicmoe", "experts", "silu_concat", MOE_DTYPE_F32, NULL, "sonicmoe runs bf16 experts; these are f32" },
  { "sonicmoe", "quant/experts", "fp8_aligned", MOE_DTYPE_F32, NULL, "sonicmoe runs bf16 experts; these are fp8" },
  /* deepgemm_megamoe: FP4 with UE8M0 scales (validate refuses FP4 with
   * others), and then never: there is no expert-parallel group */
  { "deepgemm_megamoe", "experts", "silu_concat", MOE_DTYPE_BF16, NULL, MEGAMOE_FP4 "bf16 with no scales" },
  { "deepgemm_megamoe", "quant/experts", "fp8_aligned", MOE_DTYPE_F32, NULL, MEGAMOE_FP4 "fp8 with F32 scales" },
  { "deepgemm_megamoe", "quant/experts", "fp8_ue8m0_aligned", MOE_DTYPE_F32, NULL,
    MEGAMOE_FP4 "fp8 with F8_E8M0 scales" },
  { "deepgemm_megamoe", "quant/experts", "fp4_aligned", MOE_DTYPE_F32, NULL, NO_EXPERT_PARALLEL },
};

static void
test_on_gpu (gconstpointer data)
{
  const GpuCase *gc = data;
  g_autoptr(TestFakeGpu) gpu = g_object_new (TEST_TYPE_FAKE_GPU, "name", "fake-gpu", NULL);
  g_autoptr(GError) error = NULL;
  Case c = { 0, };
  gboolean ok;

  case_load_from (&c, gc->dir, gc->fixture, gc->dtype, NULL);
  if (gc->activation != NULL)
    moe_experts_set_activation (c.experts, gc->activation);
  ok = moe_experts_backend_is_supported (get_backend (gc->backend), MOE_DEVICE (gpu), c.experts, &error);
  if (gc->refusal == NULL)
    {
      g_assert_no_error (error);
      g_assert_true (ok);
    }
  else
    {
      g_assert_false (ok);
      g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
      g_assert_cmpstr (error->message, ==, gc->refusal);
    }
  case_clear (&c);
}

int
main (int argc, char **argv)
{
  g_test_init (&argc, &argv, NULL);

  g_test_add_func ("/gpu-backends/listed", test_listed);
  g_test_add_func ("/gpu-backends/cpu-refused", test_cpu_refused);
  g_test_add_func ("/gpu-backends/device-asked", test_device_asked);
  for (guint i = 0; i < G_N_ELEMENTS (gpu_cases); i++)
    {
      const GpuCase *gc = &gpu_cases[i];
      g_autofree char *path = g_strdup_printf ("/gpu-backends/on-gpu/%s/%s-%s%s%s", gc->backend, gc->fixture,
                                               moe_dtype_get_name (gc->dtype), gc->activation ? "-" : "",
                                               gc->activation ? gc->activation : "");
      g_test_add_data_func (path, gc, test_on_gpu);
    }
  return g_test_run ();
}
