/* test-config.c: config.json parsing and sub-configs
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <libmoe.h>

#include "moe-test-util.h"

static MoeConfig *
load (const char *name)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *path = moe_test_data_path ("configs", name, NULL);
  MoeConfig *config = moe_config_new_from_file (path, &error);

  g_assert_no_error (error);
  return config;
}

static void
test_sub_configs (void)
{
  g_autoptr(MoeConfig) config = load ("qwen3_vl_moe.json");
  g_auto(GStrv) subs = moe_config_list_sub_configs (config);
  MoeConfig *text;

  g_assert_cmpstr (moe_config_get_model_type (config), ==, "qwen3_vl_moe");
  g_assert_cmpstr (moe_config_get_name (config), ==, "");
  g_assert_null (moe_config_get_parent (config));
  g_assert_cmpuint (g_strv_length (subs), ==, 2);
  g_assert_true (g_strv_contains ((const char * const *) subs, "text_config"));
  g_assert_true (g_strv_contains ((const char * const *) subs, "vision_config"));

  text = moe_config_get_sub_config (config, "text_config");
  g_assert_nonnull (text);
  g_assert_cmpstr (moe_config_get_name (text), ==, "text_config");
  g_assert_true (moe_config_get_parent (text) == config);
  g_assert_cmpstr (moe_config_get_model_type (text), ==, "qwen3_vl_moe_text");
  g_assert_null (moe_config_get_sub_config (config, "audio_config"));
}

static void
test_getters (void)
{
  g_autoptr(MoeConfig) config = load ("qwen3_vl_moe.json");
  MoeConfig *text = moe_config_get_sub_config (config, "text_config");
  g_autoptr(GError) error = NULL;
  g_autofree char *act = NULL;
  g_autoptr(GArray) layers = NULL;

  g_assert_cmpint (moe_config_get_int (text, "hidden_size", &error), ==, 64);
  g_assert_no_error (error);
  g_assert_cmpint (moe_config_get_int (text, "num_local_experts", &error), >, 0);
  g_assert_cmpfloat (moe_config_get_double (text, "rms_norm_eps", &error), >, 0);
  act = moe_config_dup_string (text, "hidden_act", &error);
  g_assert_cmpstr (act, ==, "silu");
  g_assert_false (moe_config_get_boolean (config, "tie_word_embeddings", &error));
  g_assert_no_error (error);
  layers = moe_config_get_int_array (text, "mlp_only_layers", &error);
  g_assert_no_error (error);
  g_assert_cmpuint (layers->len, ==, 0);

  /* missing keys */
  g_assert_cmpint (moe_config_get_int (text, "no_such_key", &error), ==, 0);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_MISSING_KEY);
  g_assert_nonnull (strstr (error->message, "no_such_key"));
  g_assert_nonnull (strstr (error->message, "text_config"));
  g_clear_error (&error);
  g_assert_cmpint (moe_config_get_int_or (text, "no_such_key", 7, &error), ==, 7);
  g_assert_no_error (error);

  /* null counts as missing */
  g_assert_true (moe_config_is_null (text, "bos_token_id"));
  g_assert_true (moe_config_has_key (text, "bos_token_id"));
  g_assert_cmpint (moe_config_get_int_or (text, "bos_token_id", -1, &error), ==, -1);
  g_assert_no_error (error);
  moe_config_get_int (text, "bos_token_id", &error);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_MISSING_KEY);
  g_clear_error (&error);

  /* ill-typed values are errors even with a fallback */
  g_assert_cmpint (moe_config_get_int_or (text, "hidden_act", 3, &error), ==, 3);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
  g_clear_error (&error);
  moe_config_get_boolean (text, "hidden_size", &error);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
  g_clear_error (&error);
  g_assert_null (moe_config_dup_string (text, "hidden_size", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
  g_clear_error (&error);
  g_assert_null (moe_config_get_int_array (text, "hidden_act", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
}

static void
test_bad_json (void)
{
  g_autoptr(GError) error = NULL;
  const char *bad[] = { "", "[1, 2]", "{\"a\": ", "null", "\"text\"" };

  for (guint i = 0; i < G_N_ELEMENTS (bad); i++)
    {
      g_assert_null (moe_config_new_from_data (bad[i], -1, &error));
      g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
      g_clear_error (&error);
    }
  g_assert_null (moe_config_new_from_file ("/nonexistent/config.json", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND);
}

static void
test_numbers (void)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeConfig) c = moe_config_new_from_data (
      "{\"a\": 2.0, \"b\": 2.5, \"c\": [1, 2.0, 3], \"d\": [1, \"x\"], \"quantization_config\": {\"quant_method\": \"fp8\"}}",
      -1, &error);
  g_auto(GStrv) subs = NULL;
  g_autoptr(GArray) arr = NULL;

  g_assert_no_error (error);
  g_assert_cmpint (moe_config_get_int (c, "a", &error), ==, 2);
  g_assert_no_error (error);
  moe_config_get_int (c, "b", &error);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
  g_clear_error (&error);
  g_assert_cmpfloat (moe_config_get_double (c, "b", &error), ==, 2.5);
  arr = moe_config_get_int_array (c, "c", &error);
  g_assert_no_error (error);
  g_assert_cmpuint (arr->len, ==, 3);
  g_assert_null (moe_config_get_int_array (c, "d", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
  /* quantization_config is a plain member, not a sub-model config */
  subs = moe_config_list_sub_configs (c);
  g_assert_cmpuint (g_strv_length (subs), ==, 0);
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);

  g_test_add_func ("/config/sub-configs", test_sub_configs);
  g_test_add_func ("/config/getters", test_getters);
  g_test_add_func ("/config/bad-json", test_bad_json);
  g_test_add_func ("/config/numbers", test_numbers);

  return g_test_run ();
}
