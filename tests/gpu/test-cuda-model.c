/* test-cuda-model.c: whole models on the cuda device against transformers'
 * fixtures (the same references and tolerances as tests/c/test-model.c on
 * the CPU), the automatic decode switch there, and load errors.
 *
 * Exits 77 (skipped) where there is no CUDA device or no CUDA build.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <libmoe.h>
#include <moe-plugin.h>

#include "moe-test-model-fixture.h"

static MoeModel *
load_model (const char *family, const char *dtype)
{
  return moe_test_load_model (family, dtype, NULL, "cuda");
}

static void
test_family_f32 (gconstpointer data)
{
  moe_test_family_f32 (data, "cuda");
}

static void
test_family_bf16 (gconstpointer data)
{
  moe_test_family_bf16 (data, "cuda");
}

/* The prefill attention paths, which the decoder takes from 16 tokens on,
 * on the fixtures' 9-token prompts and decode steps
 * (MOE_CUDA_PREFILL_ATTENTION_TOKENS=1 at load): float32 and GPT-OSS's eager
 * attention through batched GEMMs around the masked softmax, the other bf16
 * models through the flash kernel. */
static void
test_family_prefill_attention (gconstpointer data)
{
  g_setenv ("MOE_CUDA_PREFILL_ATTENTION_TOKENS", "1", TRUE);
  moe_test_family_f32 (data, "cuda");
  moe_test_family_bf16 (data, "cuda");
  g_unsetenv ("MOE_CUDA_PREFILL_ATTENTION_TOKENS");
}

/* The decode attention in blocks of 4 keys and their combination
 * (MOE_CUDA_ATTENTION_SPLIT=4 at load; a long context's path), on every
 * family's prompts and decode steps; eager attention (GPT-OSS) keeps one
 * block. */
static void
test_family_split_attention (gconstpointer data)
{
  g_setenv ("MOE_CUDA_ATTENTION_SPLIT", "4", TRUE);
  moe_test_family_f32 (data, "cuda");
  moe_test_family_bf16 (data, "cuda");
  g_unsetenv ("MOE_CUDA_ATTENTION_SPLIT");
}

/* The prefill's row paths on the fixtures' 9-token prompts (at load:
 * MOE_CUDA_GEMV_ROWS=0, MOE_CUDA_ROPE_STORE_ROWS=0): every projection
 * through cuBLAS (biases in cuBLASLt's epilogue, the shared expert's down
 * GEMM adding to the routed experts' output) and the activation kernel
 * (with the shared expert's gate), RoPE and the KV-cache write as a
 * prefill runs them, for the prompt and the decode steps alike; then bf16
 * with the biases by a kernel before cublasGemmEx (MOE_CUDA_CUBLASLT=0:
 * where cuBLASLt has no algorithm). */
static void
test_family_prefill_rows (gconstpointer data)
{
  g_setenv ("MOE_CUDA_GEMV_ROWS", "0", TRUE);
  g_setenv ("MOE_CUDA_ROPE_STORE_ROWS", "0", TRUE);
  moe_test_family_f32 (data, "cuda");
  moe_test_family_bf16 (data, "cuda");
  g_setenv ("MOE_CUDA_CUBLASLT", "0", TRUE);
  moe_test_family_bf16 (data, "cuda");
  g_unsetenv ("MOE_CUDA_CUBLASLT");
  g_unsetenv ("MOE_CUDA_GEMV_ROWS");
  g_unsetenv ("MOE_CUDA_ROPE_STORE_ROWS");
}

static void
on_changed (MoeModel *model, const char *key, const char *old_name, const char *new_name, gpointer data)
{
  g_ptr_array_add (data, g_strdup_printf ("%s:%s>%s", key, old_name, new_name));
}

static void
on_phase (MoeModel *model, MoePhase phase, gpointer data)
{
  char **seen = data;
  if (phase == MOE_PHASE_DECODE)
    {
      g_free (*seen);
      *seen = moe_model_dup_experts_implementation_name (model);
    }
}

/* On cuda the default policy switches grouped_mm to batched_mm for the
 * decode loop, visibly, and back; the tokens do not change. */
static void
test_decode_switch (void)
{
  g_autoptr(MoeModel) model = load_model ("qwen3_moe", "float32");
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  g_autoptr(GPtrArray) events = g_ptr_array_new_with_free_func (g_free);
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) out = NULL;
  g_autofree char *seen = NULL;

  g_object_set (cfg, "max-new-tokens", 12, NULL);
  g_assert_true (moe_model_set_experts_implementation (model, "grouped_mm", &error));
  g_signal_connect (model, "experts-implementation-changed", G_CALLBACK (on_changed), events);
  g_signal_connect (model, "phase-changed", G_CALLBACK (on_phase), &seen);
  out = moe_model_generate (model, prompt, cfg, NULL, &error);
  g_assert_no_error (error);
  g_assert_cmpmem (moe_tensor_get_data (out), moe_tensor_get_n_bytes (out),
                   moe_tensor_get_data (generated), moe_tensor_get_n_bytes (generated));
  g_assert_cmpstr (seen, ==, "batched_mm");
  g_assert_cmpuint (events->len, ==, 2);
  g_assert_cmpstr (events->pdata[0], ==, ":grouped_mm>batched_mm");
  g_assert_cmpstr (events->pdata[1], ==, ":batched_mm>grouped_mm");
}

/* do_sample picks its tokens on the device: with the host's draws they
 * are the CPU's (the float32 logits agree closely enough), seeded runs
 * repeat, and top-k 1 is the fixture's greedy generation; rows left to the
 * host (all of them with MOE_CUDA_SAMPLE=0) give the same tokens. */
static void
test_sampling (void)
{
  static const struct { double temperature; guint top_k; double top_p; } settings[] = {
    { 1.0, 0, 1.0 },    /* no filter */
    { 0.7, 50, 0.9 },   /* top-k and top-p */
    { 0.8, 0, 0.95 },   /* top-p alone */
    { 1.0, 1, 1.0 },    /* greedy */
  };
  g_autoptr(MoeModel) gpu = load_model ("qwen3_moe", "float32");
  g_autoptr(MoeModel) cpu = moe_test_load_model ("qwen3_moe", "float32", NULL, "cpu");
  g_autoptr(MoeModel) gpu_host = NULL;
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);

  g_setenv ("MOE_CUDA_SAMPLE", "0", TRUE);
  gpu_host = load_model ("qwen3_moe", "float32");
  g_unsetenv ("MOE_CUDA_SAMPLE");
  for (guint i = 0; i < G_N_ELEMENTS (settings); i++)
    {
      g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
      g_autoptr(GError) error = NULL;
      g_autoptr(MoeTensor) a = NULL, b = NULL, c = NULL, d = NULL;

      g_object_set (cfg, "max-new-tokens", 12, "do-sample", TRUE, "temperature", settings[i].temperature,
                    "top-k", settings[i].top_k, "top-p", settings[i].top_p, "seed", (guint64) (42 + i), NULL);
      a = moe_model_generate (gpu, prompt, cfg, NULL, &error);
      g_assert_no_error (error);
      b = moe_model_generate (gpu, prompt, cfg, NULL, &error);
      g_assert_no_error (error);
      c = moe_model_generate (cpu, prompt, cfg, NULL, &error);
      g_assert_no_error (error);
      d = moe_model_generate (gpu_host, prompt, cfg, NULL, &error);
      g_assert_no_error (error);
      moe_test_assert_same_ids (a, b);
      moe_test_assert_same_ids (a, c);
      moe_test_assert_same_ids (a, d);
      if (settings[i].top_k == 1)
        moe_test_assert_same_ids (a, generated);
    }
}

/* Batched generation with padding: two prompts of different lengths,
 * left-padded, give each prompt's own greedy tokens. */
static void
test_padded_batch (void)
{
  g_autoptr(MoeModel) model = load_model ("qwen2_moe", "float32");
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen2_moe", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("qwen2_moe", "reference.safetensors", "generated");
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) batch = NULL, mask = NULL, out = NULL;
  const gint64 *src = moe_tensor_get_data (ids);
  gint64 T = moe_tensor_get_dim (ids, 1), shape[2] = { 2, T };
  g_autofree gint64 *two = g_new (gint64, 2 * T);
  g_autofree guint8 *valid = g_new (guint8, 2 * T);
  const gint64 *got, *want = moe_tensor_get_data (generated);

  /* row 0: the fixture's prompt; row 1: its last T-3 tokens, left-padded */
  for (gint64 t = 0; t < T; t++)
    {
      two[t] = src[t];
      valid[t] = 1;
      two[T + t] = t < 3 ? 0 : src[t];
      valid[T + t] = t >= 3;
    }
  {
    g_autoptr(GBytes) tb = g_bytes_new (two, 2 * T * sizeof (gint64));
    g_autoptr(GBytes) vb = g_bytes_new (valid, 2 * T);
    batch = moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 2, tb, NULL);
    mask = moe_tensor_new_from_bytes (MOE_DTYPE_U8, shape, 2, vb, NULL);
  }
  g_object_set (cfg, "max-new-tokens", 12, NULL);
  out = moe_model_generate_with_mask (model, batch, mask, cfg, NULL, &error);
  g_assert_no_error (error);
  g_assert_cmpint (moe_tensor_get_dim (out, 0), ==, 2);
  got = moe_tensor_get_data (out);
  /* row 0 is the fixture's own greedy generation */
  for (gint64 i = 0; i < moe_tensor_get_dim (generated, 1); i++)
    g_assert_cmpint (got[i], ==, want[i]);
}

/* what the device refuses says so */
static void
test_errors (void)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
  g_autofree char *path = moe_test_data_path ("models", "qwen3_moe", NULL);
  g_autoptr(MoeModel) model = NULL;
  g_autoptr(MoeTensor) ids = NULL;
  gint64 shape[2] = { 1, 2 }, bad[2] = { 0, 1 << 30 };

  moe_load_options_set_device (opts, "cuda");
  model = moe_model_new_from_pretrained (path, opts, NULL, &error);
  g_assert_no_error (error);
  {
    g_autoptr(GBytes) bytes = g_bytes_new (bad, sizeof bad);
    ids = moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 2, bytes, NULL);
  }
  g_assert_null (moe_model_forward (model, ids, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT);
}

int
main (int argc, char *argv[])
{
  g_autoptr(GError) error = NULL;
  MoeDevice *cuda;

  g_test_init (&argc, &argv, NULL);

  cuda = moe_device_get_for_name ("cuda", &error);
  if (cuda == NULL)
    {
      g_printerr ("%s\n", error->message);
      return g_error_matches (error, MOE_ERROR, MOE_ERROR_NO_DEVICE) ? 77 : 1;
    }

  for (guint i = 0; i < G_N_ELEMENTS (moe_test_families); i++)
    {
      g_autofree char *p32 = g_strdup_printf ("/cuda/model/f32/%s", moe_test_families[i]);
      g_autofree char *p16 = g_strdup_printf ("/cuda/model/bf16/%s", moe_test_families[i]);
      g_test_add_data_func (p32, moe_test_families[i], test_family_f32);
      g_test_add_data_func (p16, moe_test_families[i], test_family_bf16);
    }
  for (guint i = 0; i < G_N_ELEMENTS (moe_test_families); i++)
    {
      g_autofree char *p = g_strdup_printf ("/cuda/model/prefill-attention/%s", moe_test_families[i]);
      g_test_add_data_func (p, moe_test_families[i], test_family_prefill_attention);
    }
  for (guint i = 0; i < G_N_ELEMENTS (moe_test_families); i++)
    {
      g_autofree char *p = g_strdup_printf ("/cuda/model/split-attention/%s", moe_test_families[i]);
      g_test_add_data_func (p, moe_test_families[i], test_family_split_attention);
    }
  for (guint i = 0; i < G_N_ELEMENTS (moe_test_families); i++)
    {
      g_autofree char *p = g_strdup_printf ("/cuda/model/prefill-rows/%s", moe_test_families[i]);
      g_test_add_data_func (p, moe_test_families[i], test_family_prefill_rows);
    }
  g_test_add_func ("/cuda/model/decode-switch", test_decode_switch);
  g_test_add_func ("/cuda/model/sampling", test_sampling);
  g_test_add_func ("/cuda/model/padded-batch", test_padded_batch);
  g_test_add_func ("/cuda/model/errors", test_errors);
  return g_test_run ();
}
