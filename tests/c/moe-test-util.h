/* moe-test-util.h: helpers shared by the C tests
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <math.h>
#include <libmoe.h>

/* ‖a − b‖ / ‖b‖ over two float tensors of equal size, in double. */
static inline double
moe_test_rel_error (MoeTensor *a,
                    MoeTensor *b)
{
  g_autoptr(MoeTensor) a64 = moe_tensor_to_dtype (a, MOE_DTYPE_F64, NULL);
  g_autoptr(MoeTensor) b64 = moe_tensor_to_dtype (b, MOE_DTYPE_F64, NULL);
  g_autoptr(GBytes) ab = moe_tensor_dup_bytes (a64, NULL);
  g_autoptr(GBytes) bb = moe_tensor_dup_bytes (b64, NULL);
  const double *x = g_bytes_get_data (ab, NULL), *y = g_bytes_get_data (bb, NULL);
  gint64 n = moe_tensor_get_n_elements (a);
  double num = 0, den = 0;

  g_assert_cmpint (n, ==, moe_tensor_get_n_elements (b));
  for (gint64 i = 0; i < n; i++)
    {
      if (isnan (x[i]))
        return INFINITY;
      num += (x[i] - y[i]) * (x[i] - y[i]);
      den += y[i] * y[i];
    }
  g_assert_cmpfloat (den, >, 0);
  return sqrt (num / den);
}

static inline char *
moe_test_data_path (const char *first, ...)
{
  const char *root = g_getenv ("MOE_TEST_DATA");
  GPtrArray *parts = g_ptr_array_new ();
  va_list args;
  char *path;

  g_ptr_array_add (parts, (gpointer) (root ? root : "tests/data"));
  g_ptr_array_add (parts, (gpointer) first);
  va_start (args, first);
  for (const char *p = va_arg (args, const char *); p != NULL; p = va_arg (args, const char *))
    g_ptr_array_add (parts, (gpointer) p);
  va_end (args);
  g_ptr_array_add (parts, NULL);
  path = g_build_filenamev ((char **) parts->pdata);
  g_ptr_array_free (parts, TRUE);
  return path;
}

/* A tensor of a model fixture: tests/data/DIR/MODEL/FILE. */
static inline MoeTensor *
moe_test_reference (const char *dir, const char *model, const char *file, const char *name)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *path = moe_test_data_path (dir, model, file, NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (path, &error);
  MoeTensor *t;

  g_assert_no_error (error);
  t = moe_checkpoint_get_tensor (ck, name, &error);
  g_assert_no_error (error);
  return t;
}

/* The first row of [B, T] ids, as [1, T]. */
static inline MoeTensor *
moe_test_first_row (MoeTensor *ids)
{
  gint64 shape[2] = { 1, moe_tensor_get_dim (ids, 1) };
  g_autoptr(GBytes) all = moe_tensor_dup_bytes (ids, NULL);
  g_autoptr(GBytes) row = g_bytes_new_from_bytes (all, 0, shape[1] * sizeof (gint64));
  return moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 2, row, NULL);
}

/* A tensor of a whole-model fixture: tests/data/models/FAMILY/FILE. */
static inline MoeTensor *
moe_test_model_reference (const char *family, const char *file, const char *name)
{
  return moe_test_reference ("models", family, file, name);
}
