/* test-cuda-experts.c: the experts backends on the "cuda" device against
 * transformers' fixtures
 *
 * Exits 77 (skipped) where there is no CUDA device, or where libmoe was
 * built without CUDA; any other failure to open the device fails.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <libmoe.h>
#include <moe-plugin.h>

#include "moe-test-util.h"
#include "moe-test-experts-fixture.h"

static MoeDevice *cuda;

static const char *fixtures[] = {
  "silu_concat", "silu_decode_t1", "gelu_concat", "relu_ungated",
  "gptoss_bias_transposed_interleaved", "silu_sentinel", "silu_many_tokens",
};

static const char *backends[] = { "eager", "batched_mm", "grouped_mm", NULL };
static const char *all_backends[] = { "eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe", NULL };

static void
check_fixture (const char *name, MoeDType dtype, double tolerance)
{
  Case c = { 0, };

  g_autoptr(GPtrArray) outs = NULL;

  case_load (&c, name, dtype, cuda);
  outs = case_check_backends (&c, backends, name, tolerance);
  case_clear (&c);
}

static void
test_fixture_f32 (gconstpointer data)
{
  check_fixture (data, MOE_DTYPE_F32, 1e-5);
}

static void
test_fixture_bf16 (gconstpointer data)
{
  check_fixture (data, MOE_DTYPE_BF16, 2e-2);
}

static void
test_fixture_f16 (gconstpointer data)
{
  check_fixture (data, MOE_DTYPE_F16, 2e-2);
}

/* FP8/FP4 experts: batched_mm and grouped_mm with the dynamic activation
 * scheme, against transformers' output_ref_dyn; eager says it does not. */
static const char *quant_fixtures[] = {
  "fp8_aligned", "fp8_partial_blocks", "fp8_ue8m0_aligned", "fp8_ue8m0_partial_blocks",
  "fp4_aligned", "fp4_wide",
};

static void
check_quant (const char *name, MoeDType dtype, double tolerance)
{
  static const char *quant_backends[] = { "batched_mm", "grouped_mm", NULL };
  g_autoptr(GPtrArray) outs = NULL;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) none = NULL;
  Case c = { 0, };

  case_load_from (&c, "quant/experts", name, dtype, cuda);
  outs = case_check_backends (&c, quant_backends, name, tolerance);
  moe_experts_set_implementation (c.experts, "eager");
  none = moe_experts_forward (c.experts, c.hidden, c.index, c.weights, &error);
  g_assert_null (none);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  case_clear (&c);
}

static void
test_quant_f32 (gconstpointer data)
{
  check_quant (data, MOE_DTYPE_F32, 1e-2);
}

/* as on the CPU: bf16 inputs move values across e4m3 rounding boundaries */
static void
test_quant_bf16 (gconstpointer data)
{
  check_quant (data, MOE_DTYPE_BF16, 5e-2);
}

/* deepgemm and sonicmoe (Hopper wgmma schedules) on the bf16 fixtures:
 * within the bf16 tolerance where they run, and a NOT_SUPPORTED error
 * naming the reason for the layouts they refuse. */
static const char *wgmma_backends[] = { "deepgemm", "sonicmoe", NULL };

static void
expect_error (MoeExperts *experts, MoeTensor *hidden, MoeTensor *index, MoeTensor *weights,
              MoeError code, const char *substring)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) out = moe_experts_forward (experts, hidden, index, weights, &error);

  g_assert_null (out);
  g_assert_error (error, MOE_ERROR, (int) code);
  g_test_message ("%s: %s", moe_experts_get_implementation (experts), error->message);
  g_assert_nonnull (strstr (error->message, substring));
}

static void
test_fixture_wgmma (gconstpointer data)
{
  const char *name = data;
  Case c = { 0, };

  case_load (&c, name, MOE_DTYPE_BF16, cuda);
  for (guint i = 0; wgmma_backends[i] != NULL; i++)
    {
      gboolean sonic = g_str_equal (wgmma_backends[i], "sonicmoe");

      moe_experts_set_implementation (c.experts, wgmma_backends[i]);
      if (moe_experts_get_is_transposed (c.experts))
        expect_error (c.experts, c.hidden, c.index, c.weights, MOE_ERROR_NOT_SUPPORTED, "transposed");
      else if (sonic && !moe_experts_get_has_gate (c.experts))
        expect_error (c.experts, c.hidden, c.index, c.weights, MOE_ERROR_NOT_SUPPORTED, "gated");
      else
        {
          g_autoptr(MoeTensor) out = case_run (&c, wgmma_backends[i]);
          double err = moe_test_rel_error (out, c.reference);
          g_test_message ("%s %s bf16: rel err %.3g", name, wgmma_backends[i], err);
          g_assert_cmpfloat (err, <=, 2e-2);
        }
    }
  /* deepgemm runs bf16 hidden states only */
  {
    g_autoptr(MoeTensor) host = moe_tensor_to_dtype (c.hidden, MOE_DTYPE_F32, NULL);
    g_autoptr(MoeTensor) f32 = moe_tensor_to_device (host, cuda, NULL);
    if (!moe_experts_get_is_transposed (c.experts))
      {
        moe_experts_set_implementation (c.experts, "deepgemm");
        expect_error (c.experts, f32, c.index, c.weights, MOE_ERROR_DTYPE_MISMATCH, "F32");
      }
  }
  case_clear (&c);
}

/* FP8 experts through deepgemm (bf16 hidden states, the FP8 tensor cores):
 * as batched_mm/grouped_mm against output_ref_dyn; FP4 needs SM100, and
 * sonicmoe runs bf16 experts only. */
static void
test_quant_deepgemm (gconstpointer data)
{
  const char *name = data;
  Case c = { 0, };

  case_load_from (&c, "quant/experts", name, MOE_DTYPE_BF16, cuda);
  moe_experts_set_implementation (c.experts, "sonicmoe");
  expect_error (c.experts, c.hidden, c.index, c.weights, MOE_ERROR_NOT_SUPPORTED, "bf16");
  moe_experts_set_implementation (c.experts, "deepgemm");
  if (g_str_has_prefix (name, "fp4"))
    expect_error (c.experts, c.hidden, c.index, c.weights, MOE_ERROR_NOT_SUPPORTED, "SM100");
  else
    {
      g_autoptr(MoeTensor) out = case_run (&c, "deepgemm");
      double err = moe_test_rel_error (out, c.reference);
      g_test_message ("%s deepgemm bf16: rel err %.3g", name, err);
      /* as grouped_mm's bf16: bf16 inputs cross e4m3 rounding boundaries */
      g_assert_cmpfloat (err, <=, 5e-2);
    }
  case_clear (&c);
}

/* The sentinel slot's routing weight poisoned: computing it would show. */
static void
test_sentinel (void)
{
  Case c = { 0, };
  g_autoptr(GBytes) ib = NULL, wb = NULL;
  g_autoptr(MoeTensor) host_w = NULL;
  const gint64 *ids;
  float *w;
  gint64 n, E;
  gboolean found = FALSE;

  case_load (&c, "silu_sentinel", MOE_DTYPE_F32, cuda);
  E = moe_experts_get_num_experts (c.experts);
  n = moe_tensor_get_n_elements (c.index);
  ib = moe_tensor_dup_bytes (c.index, NULL);
  wb = moe_tensor_dup_bytes (c.weights, NULL);
  ids = g_bytes_get_data (ib, NULL);
  w = g_memdup2 (g_bytes_get_data (wb, NULL), g_bytes_get_size (wb));
  for (gint64 i = 0; i < n; i++)
    if (ids[i] == E)
      w[i] = 1000.0f, found = TRUE;
  g_assert_true (found);
  {
    g_autoptr(GBytes) poisoned = g_bytes_new_take (w, n * sizeof (float));
    host_w = moe_tensor_new_from_bytes (MOE_DTYPE_F32, moe_tensor_get_shape (c.index, NULL), 2, poisoned, NULL);
  }
  g_clear_object (&c.weights);
  c.weights = moe_tensor_to_device (host_w, cuda, NULL);
  for (guint i = 0; i < G_N_ELEMENTS (backends) - 1; i++)
    {
      g_autoptr(MoeTensor) out = experts_run (c.experts, backends[i], c.hidden, c.index, c.weights);
      g_assert_cmpfloat (moe_test_rel_error (out, c.reference), <=, 1e-5);
    }
  case_clear (&c);
}

/* I32 ids arrive on the host after the core's check; the device copies them. */
static void
test_int32_index (void)
{
  Case c = { 0, };
  g_autoptr(GBytes) ib = NULL;
  g_autoptr(MoeTensor) i32 = NULL;
  const gint64 *ids;
  gint32 *small;
  gint64 n;

  case_load (&c, "silu_concat", MOE_DTYPE_F32, cuda);
  n = moe_tensor_get_n_elements (c.index);
  ib = moe_tensor_dup_bytes (c.index, NULL);
  ids = g_bytes_get_data (ib, NULL);
  small = g_new (gint32, n);
  for (gint64 i = 0; i < n; i++)
    small[i] = (gint32) ids[i];
  {
    g_autoptr(GBytes) b = g_bytes_new_take (small, n * sizeof (gint32));
    g_autoptr(MoeTensor) host = moe_tensor_new_from_bytes (MOE_DTYPE_I32, moe_tensor_get_shape (c.index, NULL), 2, b, NULL);
    i32 = moe_tensor_to_device (host, cuda, NULL);
  }
  for (guint i = 0; i < G_N_ELEMENTS (backends) - 1; i++)
    {
      g_autoptr(MoeTensor) out = experts_run (c.experts, backends[i], c.hidden, i32, c.weights);
      g_assert_cmpfloat (moe_test_rel_error (out, c.reference), <=, 1e-5);
    }
  case_clear (&c);
}

static void
test_errors (void)
{
  Case c = { 0, };
  g_autoptr(MoeTensor) host_hidden = NULL, bf16_hidden = NULL, bad_ids = NULL;

  case_load (&c, "silu_concat", MOE_DTYPE_F32, cuda);
  moe_experts_set_implementation (c.experts, "grouped_mm");

  /* hidden states left on the host */
  host_hidden = moe_tensor_to_device (c.hidden, moe_device_get_cpu (), NULL);
  expect_error (c.experts, host_hidden, c.index, c.weights, MOE_ERROR_INVALID_ARGUMENT, "cuda");

  /* hidden states in another dtype than the weights */
  {
    g_autoptr(MoeTensor) b = moe_tensor_to_dtype (c.hidden, MOE_DTYPE_BF16, NULL);
    bf16_hidden = moe_tensor_to_device (b, cuda, NULL);
  }
  expect_error (c.experts, bf16_hidden, c.index, c.weights, MOE_ERROR_DTYPE_MISMATCH, "F32");

  /* an id past the sentinel, and a negative one */
  {
    g_autoptr(GBytes) ib = moe_tensor_dup_bytes (c.index, NULL);
    gint64 *ids = g_memdup2 (g_bytes_get_data (ib, NULL), g_bytes_get_size (ib));
    g_autoptr(GBytes) b = NULL;
    g_autoptr(MoeTensor) host = NULL;
    ids[3] = moe_experts_get_num_experts (c.experts) + 1;
    ids[6] = -2;
    b = g_bytes_new_take (ids, g_bytes_get_size (ib));
    host = moe_tensor_new_from_bytes (MOE_DTYPE_I64, moe_tensor_get_shape (c.index, NULL), 2, b, NULL);
    bad_ids = moe_tensor_to_device (host, cuda, NULL);
  }
  /* eager reads the routing on the host: it refuses at once */
  moe_experts_set_implementation (c.experts, "eager");
  expect_error (c.experts, c.hidden, bad_ids, c.weights, MOE_ERROR_INVALID_ARGUMENT, "valid expert ids");
  /* the others never wait for the device: the next synchronization says it */
  for (guint i = 1; i < G_N_ELEMENTS (backends) - 1; i++)
    {
      g_autoptr(GError) error = NULL;
      g_autoptr(MoeTensor) out = experts_run (c.experts, backends[i], c.hidden, bad_ids, c.weights);
      g_autoptr(GBytes) bytes = moe_tensor_dup_bytes (out, &error);
      g_assert_null (bytes);
      g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT);
      g_test_message ("%s: %s", backends[i], error->message);
      g_assert_nonnull (strstr (error->message, "valid expert ids"));
      g_clear_error (&error);
      /* reported once */
      g_assert_true (moe_device_synchronize (cuda, &error));
      g_assert_no_error (error);
    }

  /* and the experts still work */
  {
    g_autoptr(MoeTensor) out = experts_run (c.experts, "grouped_mm", c.hidden, c.index, c.weights);
    g_assert_cmpfloat (moe_test_rel_error (out, c.reference), <=, 1e-5);
  }
  case_clear (&c);
}

/* Random experts of shapes the fixtures lack: a bf16 one whose sizes are not
 * multiples of 8 (the plain-float GEMM path) and a larger one on the tensor
 * cores, each backend against the CPU's grouped_mm (itself checked against
 * the fixtures above). */
static MoeTensor *
random_tensor (GRand *rand, MoeDType dtype, const gint64 *shape, guint n_dims, float scale)
{
  gint64 n = 1;
  float *data;
  g_autoptr(GBytes) bytes = NULL;
  g_autoptr(MoeTensor) f32 = NULL;

  for (guint i = 0; i < n_dims; i++)
    n *= shape[i];
  data = g_new (float, n);
  for (gint64 i = 0; i < n; i++)
    data[i] = (float) g_rand_double_range (rand, -scale, scale);
  bytes = g_bytes_new_take (data, n * sizeof (float));
  f32 = moe_tensor_new_from_bytes (MOE_DTYPE_F32, shape, n_dims, bytes, NULL);
  return moe_tensor_to_dtype (f32, dtype, NULL);
}

/* How the experts finish their products, where not SwiGLU without biases:
 * the GEMMs' general epilogue (the common one has a path of its own). */
typedef struct {
  const char *activation;
  gboolean has_gate, biased;
  MoeGateLayout layout;
  double alpha, limit;   /* GPT-OSS's clamped SwiGLU, with the interleaved layout */
} Finish;

/* the finish of both experts objects, the biases moved to the device for
 * the second */
static void
set_finish (MoeExperts *cpu_experts, MoeExperts *gpu_experts, const Finish *finish, GRand *rand, gint64 E,
            gint64 H, gint64 up_rows)
{
  gint64 up_bias_shape[2] = { E, up_rows }, down_bias_shape[2] = { E, H };

  if (finish == NULL)
    return;
  for (guint i = 0; i < 2; i++)
    {
      MoeExperts *experts = i == 0 ? cpu_experts : gpu_experts;
      moe_experts_set_activation (experts, finish->activation);
      moe_experts_set_has_gate (experts, finish->has_gate);
      moe_experts_set_gate_layout (experts, finish->layout);
      if (finish->limit > 0)
        {
          moe_experts_set_swiglu_alpha (experts, finish->alpha);
          moe_experts_set_swiglu_limit (experts, finish->limit);
        }
    }
  if (finish->biased)
    {
      g_autoptr(MoeTensor) up_bias = random_tensor (rand, MOE_DTYPE_BF16, up_bias_shape, 2, 0.5f);
      g_autoptr(MoeTensor) down_bias = random_tensor (rand, MOE_DTYPE_BF16, down_bias_shape, 2, 0.5f);
      g_autoptr(MoeTensor) dup_bias = moe_tensor_to_device (up_bias, cuda, NULL);
      g_autoptr(MoeTensor) ddown_bias = moe_tensor_to_device (down_bias, cuda, NULL);
      moe_experts_set_up_bias (cpu_experts, up_bias);
      moe_experts_set_down_bias (cpu_experts, down_bias);
      moe_experts_set_up_bias (gpu_experts, dup_bias);
      moe_experts_set_down_bias (gpu_experts, ddown_bias);
    }
}

static void
check_random_finish (gint64 E, gint64 H, gint64 I, gint64 T, gint64 K, gboolean transposed, const Finish *finish)
{
  g_autoptr(GRand) rand = g_rand_new_with_seed ((guint32) (E * 1000003 + H * 101 + I + T + transposed +
                                                           (finish != NULL ? 7 : 0)));
  const gint64 up_rows = finish == NULL || finish->has_gate ? 2 * I : I;
  gint64 up_shape[3] = { E, transposed ? H : up_rows, transposed ? up_rows : H };
  gint64 down_shape[3] = { E, transposed ? I : H, transposed ? H : I };
  gint64 x_shape[2] = { T, H }, k_shape[2] = { T, K };
  g_autoptr(MoeTensor) up = random_tensor (rand, MOE_DTYPE_BF16, up_shape, 3, 0.1f);
  g_autoptr(MoeTensor) down = random_tensor (rand, MOE_DTYPE_BF16, down_shape, 3, 0.1f);
  g_autoptr(MoeTensor) x = random_tensor (rand, MOE_DTYPE_BF16, x_shape, 2, 1.0f);
  g_autoptr(MoeTensor) w = random_tensor (rand, MOE_DTYPE_F32, k_shape, 2, 1.0f);
  g_autoptr(MoeTensor) ids = NULL, cpu_out = NULL;
  g_autoptr(MoeExperts) cpu_experts = moe_experts_new (up, down);
  g_autoptr(MoeExperts) gpu_experts = NULL;
  g_autoptr(MoeTensor) dup = moe_tensor_to_device (up, cuda, NULL);
  g_autoptr(MoeTensor) ddown = moe_tensor_to_device (down, cuda, NULL);
  g_autoptr(MoeTensor) dx = moe_tensor_to_device (x, cuda, NULL);
  g_autoptr(MoeTensor) dw = moe_tensor_to_device (w, cuda, NULL);
  g_autoptr(MoeTensor) dids = NULL;
  g_autoptr(GError) error = NULL;

  {
    gint64 *v = g_new (gint64, T * K);
    g_autoptr(GBytes) b = NULL;
    for (gint64 i = 0; i < T * K; i++)
      v[i] = g_rand_int_range (rand, 0, (gint32) E + 1);   /* sentinels too */
    b = g_bytes_new_take (v, T * K * sizeof (gint64));
    ids = moe_tensor_new_from_bytes (MOE_DTYPE_I64, k_shape, 2, b, NULL);
    dids = moe_tensor_to_device (ids, cuda, NULL);
  }
  gpu_experts = moe_experts_new (dup, ddown);
  set_finish (cpu_experts, gpu_experts, finish, rand, E, H, up_rows);
  moe_experts_set_is_transposed (cpu_experts, transposed);
  moe_experts_set_implementation (cpu_experts, "grouped_mm");
  cpu_out = moe_experts_forward (cpu_experts, x, ids, w, &error);
  g_assert_no_error (error);

  moe_experts_set_is_transposed (gpu_experts, transposed);
  moe_experts_set_device (gpu_experts, "cuda");
  /* deepgemm and sonicmoe run SwiGLU without biases only: the other finishes
   * are grouped_mm's */
  for (guint i = 0; i < G_N_ELEMENTS (all_backends) - 1 && (finish == NULL || i < G_N_ELEMENTS (backends) - 1); i++)
    {
      g_autoptr(MoeTensor) out = NULL;
      double err;

      /* the wgmma schedules take 16-byte rows of non-transposed weights */
      if (i >= G_N_ELEMENTS (backends) - 1 && (transposed || H % 8 != 0 || I % 8 != 0))
        continue;
      out = experts_run (gpu_experts, all_backends[i], dx, dids, dw);
      err = moe_test_rel_error (out, cpu_out);
      g_test_message ("random E=%" G_GINT64_FORMAT " H=%" G_GINT64_FORMAT " I=%" G_GINT64_FORMAT
                      " T=%" G_GINT64_FORMAT "%s%s %s: rel err vs CPU %.3g", E, H, I, T,
                      finish != NULL ? " " : "", finish != NULL ? finish->activation : "", all_backends[i], err);
      g_assert_cmpfloat (err, <=, 2e-2);
    }
}

static void
check_random (gint64 E, gint64 H, gint64 I, gint64 T, gint64 K, gboolean transposed)
{
  check_random_finish (E, H, I, T, K, transposed, NULL);
}

/* Random FP8 experts (quantized here, float or UE8M0 scales) on the FP8
 * tensor cores — grouped_mm and deepgemm — against the CPU's grouped_mm on
 * the same quantized experts and bf16 inputs. */
static void
check_random_fp8 (gint64 E, gint64 H, gint64 I, gint64 T, gint64 K, MoeQuantFormat format)
{
  g_autoptr(GRand) rand = g_rand_new_with_seed ((guint32) (E * 7919 + H * 13 + I + T + format));
  gint64 up_shape[3] = { E, 2 * I, H }, down_shape[3] = { E, H, I };
  gint64 x_shape[2] = { T, H }, k_shape[2] = { T, K };
  g_autoptr(MoeTensor) up = random_tensor (rand, MOE_DTYPE_F32, up_shape, 3, 0.1f);
  g_autoptr(MoeTensor) down = random_tensor (rand, MOE_DTYPE_F32, down_shape, 3, 0.1f);
  g_autoptr(MoeTensor) x = random_tensor (rand, MOE_DTYPE_BF16, x_shape, 2, 1.0f);
  g_autoptr(MoeTensor) w = random_tensor (rand, MOE_DTYPE_F32, k_shape, 2, 1.0f);
  g_autoptr(MoeTensor) uq = NULL, us = NULL, dq = NULL, ds = NULL, ids = NULL, cpu_out = NULL;
  g_autoptr(MoeExperts) cpu_experts = NULL, gpu_experts = NULL;
  g_autoptr(GError) error = NULL;
  const char *fp8_backends[] = { "grouped_mm", "deepgemm", "batched_mm" };

  uq = moe_tensor_quantize (up, format, &us, &error);
  g_assert_no_error (error);
  dq = moe_tensor_quantize (down, format, &ds, &error);
  g_assert_no_error (error);
  {
    gint64 *v = g_new (gint64, T * K);
    g_autoptr(GBytes) b = NULL;
    for (gint64 i = 0; i < T * K; i++)
      v[i] = g_rand_int_range (rand, 0, (gint32) E + 1);   /* sentinels too */
    b = g_bytes_new_take (v, T * K * sizeof (gint64));
    ids = moe_tensor_new_from_bytes (MOE_DTYPE_I64, k_shape, 2, b, NULL);
  }
  cpu_experts = moe_experts_new (uq, dq);
  moe_experts_set_up_weight_scale (cpu_experts, us);
  moe_experts_set_down_weight_scale (cpu_experts, ds);
  moe_experts_set_implementation (cpu_experts, "grouped_mm");
  cpu_out = moe_experts_forward (cpu_experts, x, ids, w, &error);
  g_assert_no_error (error);

  {
    g_autoptr(MoeTensor) duq = moe_tensor_to_device (uq, cuda, NULL), dus = moe_tensor_to_device (us, cuda, NULL);
    g_autoptr(MoeTensor) ddq = moe_tensor_to_device (dq, cuda, NULL), dds = moe_tensor_to_device (ds, cuda, NULL);
    g_autoptr(MoeTensor) dx = moe_tensor_to_device (x, cuda, NULL), dw = moe_tensor_to_device (w, cuda, NULL);
    g_autoptr(MoeTensor) dids = moe_tensor_to_device (ids, cuda, NULL);

    gpu_experts = moe_experts_new (duq, ddq);
    moe_experts_set_up_weight_scale (gpu_experts, dus);
    moe_experts_set_down_weight_scale (gpu_experts, dds);
    moe_experts_set_device (gpu_experts, "cuda");
    for (guint i = 0; i < G_N_ELEMENTS (fp8_backends); i++)
      {
        g_autoptr(MoeTensor) out = experts_run (gpu_experts, fp8_backends[i], dx, dids, dw);
        double err = moe_test_rel_error (out, cpu_out);
        g_test_message ("random FP8%s E=%" G_GINT64_FORMAT " H=%" G_GINT64_FORMAT " I=%" G_GINT64_FORMAT
                        " T=%" G_GINT64_FORMAT " %s: rel err vs CPU %.3g",
                        format == MOE_QUANT_FORMAT_FP8_UE8M0 ? " (UE8M0)" : "", E, H, I, T, fp8_backends[i], err);
        g_assert_cmpfloat (err, <=, 3e-2);
      }
  }
}

static void
test_random_fp8 (void)
{
  check_random_fp8 (16, 512, 384, 1000, 4, MOE_QUANT_FORMAT_FP8);
  check_random_fp8 (8, 264, 200, 700, 2, MOE_QUANT_FORMAT_FP8_UE8M0);
  /* ~140 rows an expert, I a multiple of 48 but not 64: the bulk-copy
   * GEMM's tall FP8 tile (192 × 96), which route takes over two wide ones
   * there */
  check_random_fp8 (16, 256, 144, 600, 4, MOE_QUANT_FORMAT_FP8);
  /* ~400 rows an expert, UE8M0: the wide tile (128 × 128) on the scales
   * made floats */
  check_random_fp8 (8, 256, 192, 1800, 2, MOE_QUANT_FORMAT_FP8_UE8M0);
  /* ~1,200 rows an expert: the 128 × 192 tile (route's choice over the
   * tall one: at ~560 rows it took the tall), its 96-output halves across
   * 128-row scale blocks, I not a multiple of 96 */
  check_random_fp8 (4, 384, 320, 3000, 2, MOE_QUANT_FORMAT_FP8);
}

static void
test_random_odd_sizes (void)
{
  check_random (6, 100, 36, 77, 3, FALSE);
  check_random (5, 60, 20, 40, 2, TRUE);
}

static void
test_random_large (void)
{
  check_random (16, 512, 384, 1000, 4, FALSE);
  check_random (8, 256, 128, 300, 2, TRUE);
  /* many rows per expert, K not a multiple of the 64-wide k-tile (the
   * bulk-copy GEMM's tall tiles, as next, partial n-tiles) */
  check_random (4, 200, 136, 600, 2, FALSE);
  /* ~150 rows an expert: one tall m-tile each, where the wide tile (the
   * first case's) takes two */
  check_random (16, 256, 192, 600, 4, FALSE);
  /* ~960 rows an expert: the large wide tile, CTAs in pairs sharing the
   * weight tile (odd m-tile counts padded), I not a multiple of 128 */
  check_random (4, 256, 320, 2400, 2, FALSE);
  /* ~50 rows an expert, H not a multiple of the 64-wide k-tile: sonicmoe's
   * gate/up gathers x's rows itself (zeros past K) */
  check_random (16, 200, 136, 200, 4, FALSE);
}

/* The finishes other than SwiGLU without biases, with ~150 rows an expert
 * (the bulk-copy GEMM's general epilogue, through its staging buffer):
 * GPT-OSS's (biases, interleaved gate/up, clamped SwiGLU), a gated GELU
 * with biases, an ungated ReLU. */
static void
test_random_finishes (void)
{
  static const Finish finishes[] = {
    { "silu", TRUE, TRUE, MOE_GATE_LAYOUT_INTERLEAVED, 1.702, 7.0 },
    { "gelu_pytorch_tanh", TRUE, TRUE, MOE_GATE_LAYOUT_CONCATENATED, 0, 0 },
    { "relu", FALSE, FALSE, MOE_GATE_LAYOUT_CONCATENATED, 0, 0 },
  };

  for (guint i = 0; i < G_N_ELEMENTS (finishes); i++)
    check_random_finish (8, 256, 192, 600, 2, FALSE, &finishes[i]);
}

/* Freed blocks come back from the device's cache. */
static void
test_allocator_reuses (void)
{
  gint64 n = 3 << 20;
  gconstpointer first;
  {
    g_autoptr(MoeTensor) a = moe_tensor_new_empty (cuda, MOE_DTYPE_U8, &n, 1, NULL);
    first = moe_tensor_get_data (a);
  }
  {
    g_autoptr(MoeTensor) b = moe_tensor_new_empty (cuda, MOE_DTYPE_U8, &n, 1, NULL);
    g_assert_true (moe_tensor_get_data (b) == first);
  }
}

/* A copy to the host large enough to fault its destination in from
 * several threads first (MOE_CPU_FAULT_IN_MIN: 8 MiB), of a size that
 * is no multiple of a page, arrives whole: every value as uploaded. */
static void
test_large_copy_to_host (void)
{
  gint64 n = (9 << 20) / 4 + 3;
  float *values = g_new (float, n);
  g_autoptr(GBytes) bytes = NULL;
  g_autoptr(GError) error = NULL;

  for (gint64 i = 0; i < n; i++)
    values[i] = (float) (i % 65521) - 0.5f * (float) (i % 7);
  bytes = g_bytes_new_take (values, (gsize) n * sizeof (float));
  {
    g_autoptr(MoeTensor) host = moe_tensor_new_from_bytes (MOE_DTYPE_F32, &n, 1, bytes, &error);
    g_assert_no_error (error);
    g_autoptr(MoeTensor) dev = moe_tensor_to_device (host, cuda, &error);
    g_assert_no_error (error);
    g_autoptr(MoeTensor) back = moe_tensor_to_device (dev, moe_device_get_cpu (), &error);
    g_assert_no_error (error);
    g_assert_cmpuint (moe_tensor_get_n_bytes (back), ==, (gsize) n * sizeof (float));
    g_assert_true (memcmp (moe_tensor_get_data (back), values, (gsize) n * sizeof (float)) == 0);
  }
}

int
main (int argc, char *argv[])
{
  g_autoptr(GError) error = NULL;

  g_test_init (&argc, &argv, NULL);

  cuda = moe_device_get_for_name ("cuda", &error);
  if (cuda == NULL)
    {
      /* no GPU (or no CUDA build) is a skip; a plugin that fails otherwise is not */
      g_printerr ("%s\n", error->message);
      return g_error_matches (error, MOE_ERROR, MOE_ERROR_NO_DEVICE) ? 77 : 1;
    }

  for (guint i = 0; i < G_N_ELEMENTS (fixtures); i++)
    {
      g_autofree char *p32 = g_strdup_printf ("/cuda/experts/f32/%s", fixtures[i]);
      g_autofree char *p16 = g_strdup_printf ("/cuda/experts/bf16/%s", fixtures[i]);
      g_autofree char *ph = g_strdup_printf ("/cuda/experts/f16/%s", fixtures[i]);
      g_test_add_data_func (p32, fixtures[i], test_fixture_f32);
      g_test_add_data_func (p16, fixtures[i], test_fixture_bf16);
      g_test_add_data_func (ph, fixtures[i], test_fixture_f16);
    }
  for (guint i = 0; i < G_N_ELEMENTS (quant_fixtures); i++)
    {
      g_autofree char *p32 = g_strdup_printf ("/cuda/quant/f32/%s", quant_fixtures[i]);
      g_autofree char *p16 = g_strdup_printf ("/cuda/quant/bf16/%s", quant_fixtures[i]);
      g_test_add_data_func (p32, quant_fixtures[i], test_quant_f32);
      g_test_add_data_func (p16, quant_fixtures[i], test_quant_bf16);
    }
  for (guint i = 0; i < G_N_ELEMENTS (fixtures); i++)
    {
      g_autofree char *path = g_strdup_printf ("/cuda/experts/wgmma-bf16/%s", fixtures[i]);
      g_test_add_data_func (path, fixtures[i], test_fixture_wgmma);
    }
  for (guint i = 0; i < G_N_ELEMENTS (quant_fixtures); i++)
    {
      g_autofree char *path = g_strdup_printf ("/cuda/quant/deepgemm-bf16/%s", quant_fixtures[i]);
      g_test_add_data_func (path, quant_fixtures[i], test_quant_deepgemm);
    }
  g_test_add_func ("/cuda/experts/random-fp8", test_random_fp8);
  g_test_add_func ("/cuda/experts/sentinel", test_sentinel);
  g_test_add_func ("/cuda/experts/int32-index", test_int32_index);
  g_test_add_func ("/cuda/experts/errors", test_errors);
  g_test_add_func ("/cuda/experts/random-odd-sizes", test_random_odd_sizes);
  g_test_add_func ("/cuda/experts/random-large", test_random_large);
  g_test_add_func ("/cuda/experts/random-finishes", test_random_finishes);
  g_test_add_func ("/cuda/allocator-reuses", test_allocator_reuses);
  g_test_add_func ("/cuda/large-copy-to-host", test_large_copy_to_host);

  return g_test_run ();
}
