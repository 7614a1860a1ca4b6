/* test-demo.c: the shipped demo model against the transformers reference
 * recorded in tests/data/demo (tools/fixtures/demo_reference.py), and the
 * moe command-line tool's main job on it
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <libmoe.h>
#include <moe-plugin.h>

#include "moe-test-util.h"

#define NEW_TOKENS 48

static MoeTensor *
reference (const char *name)
{
  g_autofree char *path = moe_test_data_path ("demo", "reference.safetensors", NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (path, NULL);
  g_assert_nonnull (ck);
  return moe_checkpoint_get_tensor (ck, name, NULL);
}

static void
check_dtype (const char *dtype, const char *generated_name, const char *logits_name, double tolerance)
{
  const char *path = g_getenv ("MOE_DEMO_MODEL");
  const char *backends[] = { "eager", "batched_mm", "grouped_mm" };
  g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
  g_autoptr(MoeModel) model = NULL;
  g_autoptr(MoeTensor) ids = reference ("input_ids");
  g_autoptr(MoeTensor) generated = reference (generated_name);
  g_autoptr(MoeTensor) last_ref = reference (logits_name);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  g_autoptr(GError) error = NULL;

  g_assert_nonnull (path);
  moe_load_options_set_dtype (opts, dtype);
  model = moe_model_new_from_pretrained (path, opts, NULL, &error);
  g_assert_no_error (error);
  g_object_set (cfg, "max-new-tokens", NEW_TOKENS, NULL);

  for (guint i = 0; i < G_N_ELEMENTS (backends); i++)
    {
      g_autoptr(MoeTensor) out = NULL, logits = NULL, last = NULL;
      gint64 T = moe_tensor_get_dim (ids, 1), V = moe_model_get_vocab_size (model);
      gint64 shape[1] = { V };
      g_autoptr(GBytes) last_bytes = NULL;

      g_assert_true (moe_model_set_experts_implementation (model, backends[i], &error));
      out = moe_model_generate (model, ids, cfg, NULL, &error);
      g_assert_no_error (error);
      g_assert_cmpint (moe_tensor_get_dim (out, 1), ==, moe_tensor_get_dim (generated, 1));
      g_assert_cmpmem (moe_tensor_get_data (out), moe_tensor_get_n_bytes (out),
                       moe_tensor_get_data (generated), moe_tensor_get_n_bytes (generated));

      logits = moe_model_forward (model, ids, &error);
      g_assert_no_error (error);
      last_bytes = g_bytes_new ((const float *) moe_tensor_get_data (logits) + (T - 1) * V, V * sizeof (float));
      last = moe_tensor_new_from_bytes (MOE_DTYPE_F32, shape, 1, last_bytes, NULL);
      g_test_message ("%s %s: last-position logits rel err %.3g", dtype, backends[i],
                      moe_test_rel_error (last, last_ref));
      g_assert_cmpfloat (moe_test_rel_error (last, last_ref), <=, tolerance);
    }
}

static void
test_f32 (void)
{
  check_dtype ("float32", "generated", "last_logits", 1e-4);
}

static void
test_bf16 (void)
{
  check_dtype ("bfloat16", "generated_bf16", "last_logits_bf16", 2e-2);
}

/* The README's main job: `moe` with no checkpoint writes the demo's
 * continuation; the first 48 bytes are transformers' greedy bf16 ones. */
static void
test_cli (void)
{
  const char *cli = g_getenv ("MOE_CLI");
  g_autoptr(MoeTensor) generated = reference ("generated_bf16");
  g_autofree char *out = NULL, *err = NULL, *expected = NULL;
  g_autoptr(GError) error = NULL;
  const char *argv[] = { cli, "-n", G_STRINGIFY (NEW_TOKENS), NULL };
  const gint64 *g = moe_tensor_get_data (generated);
  int status;

  g_assert_nonnull (cli);
  expected = g_new0 (char, moe_tensor_get_dim (generated, 1) + 1);
  for (gint64 i = 0; i < moe_tensor_get_dim (generated, 1); i++)
    expected[i] = (char) g[i];
  g_assert_true (g_spawn_sync (NULL, (char **) argv, NULL, G_SPAWN_DEFAULT, NULL, NULL, &out, &err, &status, &error));
  g_assert_no_error (error);
  g_test_message ("stderr: %s", err);
  g_assert_true (g_spawn_check_wait_status (status, &error));
  g_assert_true (g_str_has_prefix (out, expected));
  g_assert_nonnull (strstr (err, "tokens/s"));
  g_assert_nonnull (strstr (err, "experts implementation: \"\"=grouped_mm"));

  /* a bad option value is an error, not a crash */
  {
    const char *bad[] = { cli, "-e", "no_such_backend", NULL };
    g_clear_pointer (&out, g_free);
    g_clear_pointer (&err, g_free);
    g_assert_true (g_spawn_sync (NULL, (char **) bad, NULL, G_SPAWN_DEFAULT, NULL, NULL, &out, &err, &status, &error));
    g_assert_false (g_spawn_check_wait_status (status, NULL));
    g_assert_nonnull (strstr (err, "valid names"));
  }
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);
  g_test_add_func ("/demo/float32", test_f32);
  g_test_add_func ("/demo/bfloat16", test_bf16);
  g_test_add_func ("/demo/cli", test_cli);
  return g_test_run ();
}
