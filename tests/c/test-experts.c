/* test-experts.c: every backend against transformers' experts fixtures
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <gmodule.h>
#include <libmoe.h>
#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

#include "moe-test-util.h"
#include "moe-test-experts-fixture.h"

static const char *fixtures[] = {
  "silu_concat", "silu_decode_t1", "gelu_concat", "relu_ungated",
  "gptoss_bias_transposed_interleaved", "silu_sentinel", "silu_many_tokens",
};

static void
check_fixture (gconstpointer data, MoeDType dtype, double tolerance)
{
  const char *name = data;
  g_auto(GStrv) backends = moe_plugin_registry_list_backends_for_device (moe_plugin_registry_get_default (), "cpu");
  g_autoptr(GPtrArray) outs = NULL;
  Case c = { 0, };

  g_assert_cmpuint (g_strv_length (backends), >=, 3);
  g_assert_true (g_strv_contains ((const char * const *) backends, "eager"));
  g_assert_true (g_strv_contains ((const char * const *) backends, "batched_mm"));
  g_assert_true (g_strv_contains ((const char * const *) backends, "grouped_mm"));

  case_load (&c, name, dtype, NULL);
  outs = case_check_backends (&c, (const char * const *) backends, name, tolerance);
  /* the backends agree with one another */
  for (guint i = 1; i < outs->len; i++)
    g_assert_cmpfloat (moe_test_rel_error (outs->pdata[i], outs->pdata[0]), <=, tolerance);
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

/* The sentinel fixture: the slot holding id E contributes nothing, so the
 * output equals the output computed without it. */
static void
test_sentinel_contributes_nothing (void)
{
  Case c = { 0, };
  g_autoptr(MoeTensor) out = NULL;

  case_load (&c, "silu_sentinel", MOE_DTYPE_F32, NULL);
  {
    const gint64 *ids = moe_tensor_get_data (c.index);
    gint64 n = moe_tensor_get_n_elements (c.index);
    gboolean found = FALSE;
    for (gint64 i = 0; i < n; i++)
      found |= ids[i] == moe_experts_get_num_experts (c.experts);
    g_assert_true (found);
  }
  /* poison the sentinel's routing weight: a backend that computed the slot
   * would now be far off the reference */
  {
    g_autoptr(GBytes) wb = moe_tensor_dup_bytes (c.weights, NULL);
    float *w = g_memdup2 (g_bytes_get_data (wb, NULL), g_bytes_get_size (wb));
    const gint64 *ids = moe_tensor_get_data (c.index);
    g_autoptr(GBytes) poisoned = NULL;
    for (gint64 i = 0; i < moe_tensor_get_n_elements (c.index); i++)
      if (ids[i] == moe_experts_get_num_experts (c.experts))
        w[i] = 1000.0f;
    poisoned = g_bytes_new_take (w, g_bytes_get_size (wb));
    g_clear_object (&c.weights);
    c.weights = moe_tensor_new_from_bytes (MOE_DTYPE_F32, moe_tensor_get_shape (c.index, NULL), 2, poisoned, NULL);
  }
  for (const char *const *b = (const char *const[]) { "eager", "batched_mm", "grouped_mm", NULL }; *b; b++)
    {
      g_autoptr(MoeTensor) o = case_run (&c, *b);
      g_assert_cmpfloat (moe_test_rel_error (o, c.reference), <=, 1e-5);
    }
  case_clear (&c);
}

static void
test_int32_index (void)
{
  Case c = { 0, };
  g_autoptr(MoeTensor) i32 = NULL;
  g_autoptr(MoeTensor) out = NULL;
  gint64 n;
  gint32 *ids;

  case_load (&c, "silu_concat", MOE_DTYPE_F32, NULL);
  n = moe_tensor_get_n_elements (c.index);
  ids = g_new (gint32, n);
  for (gint64 i = 0; i < n; i++)
    ids[i] = (gint32) ((const gint64 *) moe_tensor_get_data (c.index))[i];
  {
    g_autoptr(GBytes) ib = g_bytes_new_take (ids, n * sizeof (gint32));
    i32 = moe_tensor_new_from_bytes (MOE_DTYPE_I32, moe_tensor_get_shape (c.index, NULL), 2, ib, NULL);
  }
  g_clear_object (&c.index);
  c.index = g_steal_pointer (&i32);
  out = case_run (&c, "grouped_mm");
  g_assert_cmpfloat (moe_test_rel_error (out, c.reference), <=, 1e-5);
  case_clear (&c);
}

static MoeTensor *
new_tensor (MoeDType dtype, gint64 rows, gint64 cols, gconstpointer data)
{
  gint64 shape[2] = { rows, cols };
  gsize size = rows * cols * moe_dtype_get_size (dtype);
  g_autoptr(GBytes) bytes = g_bytes_new (data, size);
  return moe_tensor_new_from_bytes (dtype, shape, 2, bytes, NULL);
}

static void
expect_forward_error (Case *c, MoeTensor *hidden, MoeTensor *index, MoeTensor *weights,
                      MoeError code, const char *substring)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) out = moe_experts_forward (c->experts, hidden, index, weights, &error);

  g_assert_null (out);
  g_assert_error (error, MOE_ERROR, (int) code);
  g_test_message ("%s", error->message);
  if (substring != NULL && strstr (error->message, substring) == NULL)
    g_error ("“%s” does not mention “%s”", error->message, substring);
}

static void
test_bad_inputs (void)
{
  Case c = { 0, };
  gint64 T, K, E;
  g_autofree gint64 *ids = NULL;
  g_autofree float *zeros = NULL;

  case_load (&c, "silu_concat", MOE_DTYPE_F32, NULL);
  T = moe_tensor_get_dim (c.index, 0);
  K = moe_tensor_get_dim (c.index, 1);
  E = moe_experts_get_num_experts (c.experts);
  ids = g_memdup2 (moe_tensor_get_data (c.index), T * K * sizeof (gint64));
  zeros = g_new0 (float, T * 128);

  for (const char *const *b = (const char *const[]) { "eager", "batched_mm", "grouped_mm", NULL }; *b; b++)
    {
      moe_experts_set_implementation (c.experts, *b);

      /* a negative expert id */
      ids[3] = -1;
      {
        g_autoptr(MoeTensor) bad = new_tensor (MOE_DTYPE_I64, T, K, ids);
        expect_forward_error (&c, c.hidden, bad, c.weights, MOE_ERROR_INVALID_ARGUMENT, "-1");
      }
      /* an id past the sentinel */
      ids[3] = E + 1;
      {
        g_autoptr(MoeTensor) bad = new_tensor (MOE_DTYPE_I64, T, K, ids);
        expect_forward_error (&c, c.hidden, bad, c.weights, MOE_ERROR_INVALID_ARGUMENT, "valid expert ids");
      }
      ids[3] = 0;
      /* hidden of the wrong width */
      {
        g_autoptr(MoeTensor) bad = new_tensor (MOE_DTYPE_F32, T, 128, zeros);
        expect_forward_error (&c, bad, c.index, c.weights, MOE_ERROR_SHAPE_MISMATCH, "hidden_states");
      }
      /* routing of another token count */
      {
        g_autoptr(MoeTensor) bad = new_tensor (MOE_DTYPE_I64, T - 1, K, ids);
        expect_forward_error (&c, c.hidden, bad, c.weights, MOE_ERROR_SHAPE_MISMATCH, "top_k_index");
      }
      /* index of a float dtype */
      {
        g_autoptr(MoeTensor) bad = new_tensor (MOE_DTYPE_F32, T, K, zeros);
        expect_forward_error (&c, c.hidden, bad, c.weights, MOE_ERROR_DTYPE_MISMATCH, "I64");
      }
      /* weights of another shape */
      {
        g_autoptr(MoeTensor) bad = new_tensor (MOE_DTYPE_F32, T, K + 1, zeros);
        expect_forward_error (&c, c.hidden, c.index, bad, MOE_ERROR_SHAPE_MISMATCH, "top_k_weights");
      }
      /* integer hidden states */
      {
        g_autoptr(MoeTensor) bad = new_tensor (MOE_DTYPE_I32, T, moe_experts_get_hidden_size (c.experts), zeros);
        expect_forward_error (&c, bad, c.index, c.weights, MOE_ERROR_DTYPE_MISMATCH, "hidden_states");
      }
    }

  /* an unknown backend lists the available ones */
  moe_experts_set_implementation (c.experts, "no_such_backend");
  expect_forward_error (&c, c.hidden, c.index, c.weights, MOE_ERROR_UNKNOWN_BACKEND, "grouped_mm");
  moe_experts_set_implementation (c.experts, "grouped_mm");

  /* an unknown activation */
  moe_experts_set_activation (c.experts, "swishy");
  expect_forward_error (&c, c.hidden, c.index, c.weights, MOE_ERROR_INVALID_ARGUMENT, "gelu_pytorch_tanh");
  moe_experts_set_activation (c.experts, "silu");

  /* the layout flags disagree with the weights */
  moe_experts_set_is_transposed (c.experts, TRUE);
  expect_forward_error (&c, c.hidden, c.index, c.weights, MOE_ERROR_SHAPE_MISMATCH, "transposed");
  moe_experts_set_is_transposed (c.experts, FALSE);
  moe_experts_set_has_gate (c.experts, FALSE);
  expect_forward_error (&c, c.hidden, c.index, c.weights, MOE_ERROR_SHAPE_MISMATCH, "ungated");
  moe_experts_set_has_gate (c.experts, TRUE);

  /* a bias of the wrong shape */
  {
    g_autoptr(MoeTensor) bias = new_tensor (MOE_DTYPE_F32, E, 3, zeros);
    moe_experts_set_down_bias (c.experts, bias);
    expect_forward_error (&c, c.hidden, c.index, c.weights, MOE_ERROR_SHAPE_MISMATCH, "down-bias");
    moe_experts_set_down_bias (c.experts, NULL);
  }

  /* a device that does not exist here */
  moe_experts_set_device (c.experts, "tpu");
  expect_forward_error (&c, c.hidden, c.index, c.weights, MOE_ERROR_NO_DEVICE, "cpu");
  moe_experts_set_device (c.experts, "cpu");

  /* and after all that the experts still work */
  {
    g_autoptr(MoeTensor) out = case_run (&c, "grouped_mm");
    g_assert_cmpfloat (moe_test_rel_error (out, c.reference), <=, 1e-5);
  }
  case_clear (&c);
}

static void
test_weights_not_3d (void)
{
  float data[8] = { 0, };
  g_autoptr(MoeTensor) up = new_tensor (MOE_DTYPE_F32, 2, 4, data);
  g_autoptr(MoeTensor) down = new_tensor (MOE_DTYPE_F32, 2, 4, data);
  g_autoptr(MoeExperts) experts = moe_experts_new (up, down);
  g_autoptr(GError) error = NULL;

  g_assert_false (moe_experts_validate (experts, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH);
  g_assert_cmpuint (moe_experts_get_num_experts (experts), ==, 0);
}

static void
count_notify (GObject *object, GParamSpec *pspec, gpointer data)
{
  (*(guint *) data)++;
}

static void
test_properties (void)
{
  Case c = { 0, };
  guint notified = 0;
  g_autofree char *impl = NULL;

  case_load (&c, "gelu_concat", MOE_DTYPE_F32, NULL);
  g_assert_cmpuint (moe_experts_get_num_experts (c.experts), ==, 16);
  g_assert_cmpuint (moe_experts_get_hidden_size (c.experts), ==, 128);
  g_assert_cmpuint (moe_experts_get_intermediate_size (c.experts), ==, 96);
  g_assert_cmpstr (moe_experts_get_device (c.experts), ==, "cpu");

  g_signal_connect (c.experts, "notify::implementation", G_CALLBACK (count_notify), &notified);
  moe_experts_set_implementation (c.experts, "eager");
  moe_experts_set_implementation (c.experts, "eager");   /* no change, no notify */
  g_object_set (c.experts, "implementation", "batched_mm", NULL);
  g_assert_cmpuint (notified, ==, 2);
  g_object_get (c.experts, "implementation", &impl, NULL);
  g_assert_cmpstr (impl, ==, "batched_mm");
  moe_experts_set_implementation (c.experts, NULL);
  g_assert_cmpstr (moe_experts_get_implementation (c.experts), ==, "grouped_mm");
  case_clear (&c);
}

/* moe_experts_to_device(): a copy with every property and the same
 * output; an unknown device is an error naming it */
static void
test_to_device (void)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeExperts) copy = NULL;
  g_autoptr(MoeTensor) a = NULL, b = NULL;
  Case c = { 0, };

  case_load (&c, "gptoss_bias_transposed_interleaved", MOE_DTYPE_F32, NULL);
  moe_experts_set_implementation (c.experts, "batched_mm");
  copy = moe_experts_to_device (c.experts, "cpu", &error);
  g_assert_no_error (error);
  g_assert_true (copy != c.experts);
  g_assert_cmpstr (moe_experts_get_device (copy), ==, "cpu");
  g_assert_cmpstr (moe_experts_get_implementation (copy), ==, "batched_mm");
  g_assert_cmpstr (moe_experts_get_activation (copy), ==, moe_experts_get_activation (c.experts));
  g_assert_cmpint (moe_experts_get_is_transposed (copy), ==, moe_experts_get_is_transposed (c.experts));
  g_assert_cmpint (moe_experts_get_gate_layout (copy), ==, MOE_GATE_LAYOUT_INTERLEAVED);
  g_assert_cmpfloat (moe_experts_get_swiglu_limit (copy), ==, moe_experts_get_swiglu_limit (c.experts));
  g_assert_cmpfloat (moe_experts_get_swiglu_alpha (copy), ==, moe_experts_get_swiglu_alpha (c.experts));
  g_assert_nonnull (moe_experts_get_up_bias (copy));
  g_assert_nonnull (moe_experts_get_down_bias (copy));

  a = case_run (&c, "batched_mm");
  b = experts_run (copy, "batched_mm", c.hidden, c.index, c.weights);
  g_assert_cmpfloat (moe_test_rel_error (b, c.reference), <=, 1e-5);
  g_assert_cmpfloat (moe_test_rel_error (b, a), ==, 0.0);

  g_assert_null (moe_experts_to_device (c.experts, "no-such-device", &error));
  g_assert_nonnull (error);
  g_assert_true (error->domain == MOE_ERROR);
  g_assert_nonnull (strstr (error->message, "no-such-device"));
  case_clear (&c);
}

/* OpenBLAS runs the kernels of this CPU, not its generic x86-64 ones,
 * where it runs AVX2 or better (libmoe chooses them where OpenBLAS does not
 * know the CPU's model: moe-cpu-kernels.c) */
static void
test_blas_core (void)
{
#if defined(__x86_64__) && defined(__GNUC__)
  GModule *self = g_module_open (NULL, G_MODULE_BIND_LAZY);
  char *(*corename) (void) = NULL;

  if (self != NULL)
    {
      g_module_symbol (self, "openblas_get_corename", (gpointer *) &corename);
      g_module_close (self);   /* the program's own handle: nothing is unloaded */
    }
  if (corename == NULL)
    {
      g_test_skip ("the BLAS is not OpenBLAS");
      return;
    }
  if (g_strcmp0 (g_getenv ("MOE_CPU_ISA"), "baseline") == 0)
    {
      g_test_skip ("MOE_CPU_ISA=baseline: libmoe picks no AVX2 kernels");
      return;
    }
  __builtin_cpu_init ();
  if (!__builtin_cpu_supports ("avx2") || !__builtin_cpu_supports ("fma"))
    {
      g_test_skip ("this CPU runs no AVX2 kernels");
      return;
    }
  g_test_message ("OpenBLAS core: %s (OPENBLAS_CORETYPE %s)", corename (), g_getenv ("OPENBLAS_CORETYPE"));
  g_assert_cmpstr (corename (), !=, "Prescott");
#else
  g_test_skip ("x86-64 only");
#endif
}

/* moe_cpu_matmul against the product computed in float64, element by
 * element, over the shapes its kernels treat apart: 1 to 70 rows (the
 * tiles' row remainders, blocks of 64 rows), output counts that leave
 * partial tiles, inputs that end in a short chunk (k not a multiple of
 * 32) and that take several blocks (f32 from 1025, bf16 from 2049), both
 * weight layouts and dtypes, and products big enough to be split over the
 * threads */
static void
test_cpu_matmul (void)
{
  static const struct { gsize n, k; } shapes[] = { { 7, 40 }, { 53, 96 }, { 600, 520 }, { 130, 2048 }, { 20, 2100 } };
  static const gsize rows[] = { 1, 2, 3, 4, 5, 7, 8, 9, 13, 34, 64, 70 };
  GRand *rand = g_rand_new_with_seed (1234);

  for (guint s = 0; s < G_N_ELEMENTS (shapes); s++)
    for (guint dt = 0; dt < 2; dt++)
      for (guint tr = 0; tr < 2; tr++)
        {
          gsize n = shapes[s].n, k = shapes[s].k, mmax = rows[G_N_ELEMENTS (rows) - 1];
          MoeDType dtype = dt == 0 ? MOE_DTYPE_F32 : MOE_DTYPE_BF16;
          double *wd = g_new (double, n * k);
          gpointer data = g_malloc (n * k * moe_dtype_get_size (dtype));
          float *x = g_new (float, mmax * k);
          float *y = g_new (float, mmax * n);
          MoeCpuMatrix w = { .dtype = dtype, .data = data, .n = n, .k = k, .transposed = tr };

          /* wd[j * k + i]: weight of output j, input i, in either layout */
          for (gsize j = 0; j < n; j++)
            for (gsize i = 0; i < k; i++)
              {
                float v = (float) g_rand_double_range (rand, -1, 1);
                gsize at = tr ? i * n + j : j * k + i;
                if (dtype == MOE_DTYPE_BF16)
                  {
                    ((guint16 *) data)[at] = moe_f32_to_bf16 (v);
                    v = moe_bf16_to_f32 (((guint16 *) data)[at]);
                  }
                else
                  ((float *) data)[at] = v;
                wd[j * k + i] = v;
              }
          for (gsize i = 0; i < mmax * k; i++)
            x[i] = (float) g_rand_double_range (rand, -1, 1);

          for (guint r = 0; r < G_N_ELEMENTS (rows); r++)
            {
              gsize m = rows[r];
              double err = 0, ref = 0;

              moe_cpu_matmul (x, m, &w, y);
              for (gsize a = 0; a < m; a++)
                for (gsize j = 0; j < n; j++)
                  {
                    double sum = 0;
                    for (gsize i = 0; i < k; i++)
                      sum += (double) x[a * k + i] * wd[j * k + i];
                    err += (y[a * n + j] - sum) * (y[a * n + j] - sum);
                    ref += sum * sum;
                  }
              g_test_message ("m %zu n %zu k %zu %s%s: rel error %.2g", m, n, k, moe_dtype_get_name (dtype),
                              tr ? " [k, n]" : "", sqrt (err / ref));
              g_assert_cmpfloat (sqrt (err / ref), <=, 1e-5);
            }
          g_free (wd);
          g_free (data);
          g_free (x);
          g_free (y);
        }
  g_rand_free (rand);
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);

  for (guint i = 0; i < G_N_ELEMENTS (fixtures); i++)
    {
      g_autofree char *p32 = g_strdup_printf ("/experts/fixture/f32/%s", fixtures[i]);
      g_autofree char *p16 = g_strdup_printf ("/experts/fixture/bf16/%s", fixtures[i]);
      g_autofree char *ph = g_strdup_printf ("/experts/fixture/f16/%s", fixtures[i]);
      g_test_add_data_func (p32, fixtures[i], test_fixture_f32);
      g_test_add_data_func (p16, fixtures[i], test_fixture_bf16);
      g_test_add_data_func (ph, fixtures[i], test_fixture_f16);
    }
  g_test_add_func ("/experts/sentinel", test_sentinel_contributes_nothing);
  g_test_add_func ("/experts/int32-index", test_int32_index);
  g_test_add_func ("/experts/bad-inputs", test_bad_inputs);
  g_test_add_func ("/experts/weights-not-3d", test_weights_not_3d);
  g_test_add_func ("/experts/properties", test_properties);
  g_test_add_func ("/experts/to-device", test_to_device);
  g_test_add_func ("/experts/blas-core", test_blas_core);
  g_test_add_func ("/experts/cpu-matmul", test_cpu_matmul);

  return g_test_run ();
}
