/* moe-test-model-fixture.h: whole models against transformers' fixtures,
 * on any device: shared by tests/c/test-model.c (cpu) and
 * tests/gpu/test-cuda-model.c (cuda)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include "moe-test-util.h"

static const char *moe_test_families[] = {
  "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe",
};
static const char *moe_test_backends[] = { "eager", "batched_mm", "grouped_mm" };

static inline MoeModel *
moe_test_load_model (const char *family, const char *dtype, const char *impl, const char *device)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *path = moe_test_data_path ("models", family, NULL);
  g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
  MoeModel *model;

  moe_load_options_set_dtype (opts, dtype);
  moe_load_options_set_experts_implementation (opts, impl);
  moe_load_options_set_device (opts, device);
  model = moe_model_new_from_pretrained (path, opts, NULL, &error);
  g_assert_no_error (error);
  g_assert_cmpstr (moe_model_get_device (model), ==, device);
  return model;
}

static inline void
moe_test_assert_same_ids (MoeTensor *a, MoeTensor *b)
{
  g_assert_true (moe_tensor_has_shape (a, moe_tensor_get_shape (b, NULL), moe_tensor_get_n_dims (b)));
  g_assert_cmpmem (moe_tensor_get_data (a), moe_tensor_get_n_bytes (a),
                   moe_tensor_get_data (b), moe_tensor_get_n_bytes (b));
}

/* fp32 logits within 1e-4 and greedy generation token for token, with
 * every backend */
static inline void
moe_test_family_f32 (const char *family, const char *device)
{
  g_autoptr(MoeModel) model = moe_test_load_model (family, "float32", NULL, device);
  g_autoptr(MoeTensor) ids = moe_test_model_reference (family, "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) ref = moe_test_model_reference (family, "reference.safetensors", "logits");
  g_autoptr(MoeTensor) generated = moe_test_model_reference (family, "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();

  g_object_set (cfg, "max-new-tokens", 12, NULL);
  for (guint i = 0; i < G_N_ELEMENTS (moe_test_backends); i++)
    {
      g_autoptr(GError) error = NULL;
      g_autoptr(MoeTensor) logits = NULL, out = NULL;
      double err;

      g_assert_true (moe_model_set_experts_implementation (model, moe_test_backends[i], &error));
      logits = moe_model_forward (model, ids, &error);
      g_assert_no_error (error);
      err = moe_test_rel_error (logits, ref);
      g_test_message ("%s %s f32 %s: logits rel err %.3g", device, family, moe_test_backends[i], err);
      g_assert_cmpfloat (err, <=, 1e-4);

      out = moe_model_generate (model, prompt, cfg, NULL, &error);
      g_assert_no_error (error);
      moe_test_assert_same_ids (out, generated);
    }
}

/* bf16 logits within 2e-2 of transformers' bf16 logits with the same
 * backend (its batched/grouped sum the slots in fp32 while eager rounds each
 * one: on mixtral that alone moves the logits by 3e-2) */
static inline void
moe_test_family_bf16 (const char *family, const char *device)
{
  g_autoptr(MoeModel) model = moe_test_load_model (family, "bfloat16", NULL, device);
  g_autoptr(MoeTensor) ids = moe_test_model_reference (family, "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) shipped = moe_test_model_reference (family, "reference.safetensors", "logits_bf16");

  g_assert_cmpstr (moe_model_get_dtype (model), ==, "bfloat16");
  for (guint i = 0; i < G_N_ELEMENTS (moe_test_backends); i++)
    {
      g_autoptr(GError) error = NULL;
      g_autofree char *name = g_strdup_printf ("logits_bf16_%s", moe_test_backends[i]);
      g_autoptr(MoeTensor) ref = moe_test_model_reference (family, "reference_bf16_backends.safetensors", name);
      g_autoptr(MoeTensor) logits = NULL;
      double err, err_shipped;

      g_assert_true (moe_model_set_experts_implementation (model, moe_test_backends[i], &error));
      logits = moe_model_forward (model, ids, &error);
      g_assert_no_error (error);
      err = moe_test_rel_error (logits, ref);
      err_shipped = moe_test_rel_error (logits, shipped);
      g_test_message ("%s %s bf16 %s: rel err %.3g vs transformers' %s, %.3g vs the shipped eager logits",
                      device, family, moe_test_backends[i], err, moe_test_backends[i], err_shipped);
      g_assert_cmpfloat (err, <=, 2e-2);
      if (g_str_equal (moe_test_backends[i], "eager"))
        g_assert_cmpfloat (err_shipped, <=, 2e-2);
    }
}
