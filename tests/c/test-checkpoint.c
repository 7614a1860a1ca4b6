/* test-checkpoint.c: safetensors reading, sharding, expert fusion, and
 * the broken files in tests/data/broken
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <unistd.h>
#include <glib/gstdio.h>
#include <libmoe.h>
#include <moe-plugin.h>

#include "moe-test-util.h"

static void
test_open_file (void)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *path = moe_test_data_path ("experts", "silu_concat.safetensors", NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (path, &error);
  g_auto(GStrv) names = NULL;
  g_autoptr(MoeTensor) t = NULL;
  g_autoptr(GArray) shape = NULL;
  MoeDType dtype;

  g_assert_no_error (error);
  names = moe_checkpoint_list_tensors (ck);
  g_assert_cmpuint (g_strv_length (names), ==, 8);
  g_assert_cmpstr (names[0], ==, "down_weight");   /* sorted */
  g_assert_true (moe_checkpoint_has_tensor (ck, "up_weight"));
  g_assert_cmpstr (moe_checkpoint_get_metadata_value (ck, "E"), ==, "8");

  g_assert_true (moe_checkpoint_get_tensor_info (ck, "up_weight", &dtype, &shape, &error));
  g_assert_cmpint (dtype, ==, MOE_DTYPE_F32);
  g_assert_cmpuint (shape->len, ==, 3);
  g_assert_cmpint (g_array_index (shape, gint64, 1), ==, 64);

  t = moe_checkpoint_get_tensor (ck, "top_k_index", &error);
  g_assert_no_error (error);
  g_assert_cmpint (moe_tensor_get_dtype (t), ==, MOE_DTYPE_I64);
  g_assert_cmpint (moe_tensor_get_dim (t, 0), ==, 7);
  g_assert_cmpint (moe_tensor_get_dim (t, -1), ==, 2);
  g_assert_cmpint (moe_tensor_get_dim (t, 2), ==, -1);

  g_assert_null (moe_checkpoint_get_tensor (ck, "nope", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND);
}

/* Tensors wrap the mapped file: no copy. */
static void
test_zero_copy (void)
{
  g_autofree char *path = moe_test_data_path ("experts", "silu_many_tokens.safetensors", NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (path, NULL);
  g_autoptr(MoeTensor) a = moe_checkpoint_get_tensor (ck, "up_weight", NULL);
  g_autoptr(MoeTensor) b = moe_checkpoint_get_tensor (ck, "up_weight", NULL);

  g_assert_true (moe_tensor_get_data (a) == moe_tensor_get_data (b));
}

static void
test_sharded (void)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *dir = moe_test_data_path ("sharded", NULL);
  g_autofree char *single = moe_test_data_path ("experts", "silu_concat.safetensors", NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (dir, &error);
  g_autoptr(MoeCheckpoint) ref = moe_checkpoint_open (single, &error);
  g_auto(GStrv) a = NULL, b = NULL;

  g_assert_no_error (error);
  a = moe_checkpoint_list_tensors (ck);
  b = moe_checkpoint_list_tensors (ref);
  g_assert_true (g_strv_equal ((const char * const *) a, (const char * const *) b));
  for (guint i = 0; a[i]; i++)
    {
      g_autoptr(MoeTensor) x = moe_checkpoint_get_tensor (ck, a[i], NULL);
      g_autoptr(MoeTensor) y = moe_checkpoint_get_tensor (ref, a[i], NULL);
      g_assert_cmpmem (moe_tensor_get_data (x), moe_tensor_get_n_bytes (x),
                       moe_tensor_get_data (y), moe_tensor_get_n_bytes (y));
    }
}

/* Per-expert keys are fused like transformers does: numeric expert order,
 * gate rows before up rows. The fused weights must equal the fixture's. */
static void
check_fused (const char *dir_name, const char *prefix)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *dir = moe_test_data_path (dir_name, NULL);
  g_autofree char *fused_path = moe_test_data_path ("experts", "gelu_concat.safetensors", NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (dir, &error);
  g_autoptr(MoeCheckpoint) fused = moe_checkpoint_open (fused_path, &error);
  g_autoptr(MoeExperts) experts = NULL;
  g_autoptr(MoeTensor) up = NULL, down = NULL, out = NULL, ref = NULL;
  g_autoptr(MoeTensor) h = NULL, idx = NULL, w = NULL;

  g_assert_no_error (error);
  experts = moe_checkpoint_load_experts (ck, prefix, &error);
  g_assert_no_error (error);
  up = moe_checkpoint_get_tensor (fused, "up_weight", NULL);
  down = moe_checkpoint_get_tensor (fused, "down_weight", NULL);
  g_assert_cmpmem (moe_tensor_get_data (moe_experts_get_up_weight (experts)),
                   moe_tensor_get_n_bytes (moe_experts_get_up_weight (experts)),
                   moe_tensor_get_data (up), moe_tensor_get_n_bytes (up));
  g_assert_cmpmem (moe_tensor_get_data (moe_experts_get_down_weight (experts)),
                   moe_tensor_get_n_bytes (moe_experts_get_down_weight (experts)),
                   moe_tensor_get_data (down), moe_tensor_get_n_bytes (down));

  moe_experts_set_activation (experts, "gelu");
  h = moe_checkpoint_get_tensor (ck, "hidden_states", NULL);
  idx = moe_checkpoint_get_tensor (ck, "top_k_index", NULL);
  w = moe_checkpoint_get_tensor (ck, "top_k_weights", NULL);
  ref = moe_checkpoint_get_tensor (ck, "output_f64", NULL);
  out = moe_experts_forward (experts, h, idx, w, &error);
  g_assert_no_error (error);
  g_assert_cmpfloat (moe_test_rel_error (out, ref), <=, 1e-5);
}

static void
test_fuse_qwen (void)
{
  check_fused ("per-expert", "model.layers.0.mlp.experts");
}

static void
test_fuse_mixtral (void)
{
  check_fused ("mixtral-per-expert", "model.layers.0.block_sparse_moe.experts");
}

/* Expert e's tensor k (0 gate, 1 up, 2 down), element i: exact in float */
static float
large_value (guint e, guint k, gsize i)
{
  return (float) (e * 1000000 + k * 200000 + i % 99991);
}

/* Per-expert keys fused into buffers large enough to be faulted in from
 * several threads first (moe_cpu_fault_in: 8 MiB and more): every value
 * in its place. Four experts, I = 512, H = 1024, float32: gate/up 16 MiB,
 * down 8 MiB, written as one safetensors file here. */
static void
test_fuse_large (void)
{
  const guint E = 4, I = 512, H = 1024;
  const char *names[3] = { "gate_proj", "up_proj", "down_proj" };
  const gsize n = (gsize) I * H, bytes = n * sizeof (float);
  g_autoptr(GError) error = NULL;
  g_autofree char *dir = g_dir_make_tmp ("moe-fuse-XXXXXX", &error);
  g_autofree char *path = g_build_filename (dir, "model.safetensors", NULL);
  g_autoptr(GString) header = g_string_new ("{");
  g_autofree float *data = g_new (float, n);
  g_autoptr(MoeCheckpoint) ck = NULL;
  g_autoptr(MoeExperts) experts = NULL;
  const float *up, *down;
  guint64 header_len;
  FILE *f;

  g_assert_no_error (error);
  for (guint e = 0; e < E; e++)
    for (guint k = 0; k < 3; k++)
      g_string_append_printf (header, "%s\"model.layers.0.mlp.experts.%u.%s.weight\": {\"dtype\": \"F32\", "
                              "\"shape\": [%u, %u], \"data_offsets\": [%" G_GSIZE_FORMAT ", %" G_GSIZE_FORMAT "]}",
                              e + k > 0 ? ", " : "", e, names[k], k < 2 ? I : H, k < 2 ? H : I,
                              (e * 3 + k) * bytes, (e * 3 + k + 1) * bytes);
  g_string_append_c (header, '}');
  header_len = GUINT64_TO_LE (header->len);
  f = fopen (path, "wb");
  g_assert_nonnull (f);
  g_assert_cmpuint (fwrite (&header_len, 8, 1, f), ==, 1);
  g_assert_cmpuint (fwrite (header->str, 1, header->len, f), ==, header->len);
  for (guint e = 0; e < E; e++)
    for (guint k = 0; k < 3; k++)
      {
        for (gsize i = 0; i < n; i++)
          data[i] = large_value (e, k, i);
        g_assert_cmpuint (fwrite (data, sizeof (float), n, f), ==, n);
      }
  g_assert_cmpint (fclose (f), ==, 0);

  ck = moe_checkpoint_open (dir, &error);
  g_assert_no_error (error);
  experts = moe_checkpoint_load_experts (ck, "model.layers.0.mlp.experts", &error);
  g_assert_no_error (error);
  up = moe_tensor_get_data (moe_experts_get_up_weight (experts));
  down = moe_tensor_get_data (moe_experts_get_down_weight (experts));
  g_assert_cmpuint (moe_tensor_get_n_bytes (moe_experts_get_up_weight (experts)), ==, E * 2 * bytes);
  g_assert_cmpuint (moe_tensor_get_n_bytes (moe_experts_get_down_weight (experts)), ==, E * bytes);
  for (guint e = 0; e < E; e++)
    for (gsize i = 0; i < n; i++)
      {
        /* gate rows, then up rows, then the next expert */
        if (up[(2 * e) * n + i] != large_value (e, 0, i) || up[(2 * e + 1) * n + i] != large_value (e, 1, i) ||
            down[e * n + i] != large_value (e, 2, i))
          g_error ("expert %u, element %" G_GSIZE_FORMAT ": fused %g %g %g, expected %g %g %g", e, i,
                   up[(2 * e) * n + i], up[(2 * e + 1) * n + i], down[e * n + i], large_value (e, 0, i),
                   large_value (e, 1, i), large_value (e, 2, i));
      }
  g_clear_object (&experts);
  g_clear_object (&ck);
  g_assert_cmpint (g_unlink (path), ==, 0);
  g_assert_cmpint (g_rmdir (dir), ==, 0);
}

static void
test_fuse_missing (void)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *dir = moe_test_data_path ("per-expert", NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (dir, &error);
  g_autoptr(MoeExperts) experts = moe_checkpoint_load_experts (ck, "model.layers.7.mlp.experts", &error);

  g_assert_null (experts);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND);
}

typedef struct {
  const char *file;
  MoeError    code;
  const char *substring;
} Broken;

static const Broken broken[] = {
  { "short.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "too short" },
  { "header-past-eof.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "runs past the end" },
  { "not-json.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "not valid JSON" },
  { "not-object.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "not a JSON object" },
  { "offsets-outside.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "outside" },
  { "offsets-reversed.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "outside" },
  { "overlap.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "overlap" },
  { "size-mismatch.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "need 24 bytes" },
  { "unknown-dtype.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "unknown dtype" },
  { "negative-shape.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "non-negative" },
  { "huge-shape.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "overflows" },
  { "missing-offsets.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "data_offsets" },
  { "bad-metadata.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "__metadata__" },
  { "too-many-dims.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "dimensions" },
  { "duplicate-name.safetensors", MOE_ERROR_INVALID_CHECKPOINT, "“a” twice" },
  { "index-duplicate", MOE_ERROR_INVALID_CHECKPOINT, "appears twice" },
  { "index-missing-shard", MOE_ERROR_INVALID_CHECKPOINT, "missing" },
  { "index-escapes", MOE_ERROR_INVALID_CHECKPOINT, "plain file name" },
  { "empty-dir", MOE_ERROR_NOT_FOUND, "model.safetensors" },
  { "no-such-file.safetensors", MOE_ERROR_NOT_FOUND, "no-such-file" },
};

static void
test_broken (gconstpointer data)
{
  const Broken *b = data;
  g_autoptr(GError) error = NULL;
  g_autofree char *path = moe_test_data_path ("broken", b->file, NULL);
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (path, &error);

  g_assert_null (ck);
  g_assert_error (error, MOE_ERROR, (int) b->code);
  g_test_message ("%s", error->message);
  if (strstr (error->message, b->substring) == NULL)
    g_error ("“%s” does not mention “%s”", error->message, b->substring);
}

/* Links inside the directory, or into a Hugging Face cache's blobs/, are
 * followed; links anywhere else are refused. */
static void
test_symlink_policy (void)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *fixture = moe_test_data_path ("experts", "silu_concat.safetensors", NULL);
  g_autofree char *root = g_dir_make_tmp ("moe-links-XXXXXX", &error);
  g_autofree char *outside = g_build_filename (root, "outside", NULL);
  g_autofree char *inside = g_build_filename (root, "inside", NULL);
  g_autofree char *repo = g_build_filename (root, "models--x--y", NULL);
  g_autofree char *blobs = g_build_filename (repo, "blobs", NULL);
  g_autofree char *snap = g_build_filename (repo, "snapshots", "abc123", NULL);
  g_autofree char *blob = g_build_filename (blobs, "0123abcd", NULL);
  g_autofree char *real = g_build_filename (inside, "weights.bin", NULL);
  g_autofree char *link = NULL;
  g_autofree char *data = NULL;
  gsize size;

  g_assert_no_error (error);
  g_assert_true (g_file_get_contents (fixture, &data, &size, NULL));
  g_assert_cmpint (g_mkdir_with_parents (outside, 0700), ==, 0);
  g_assert_cmpint (g_mkdir_with_parents (inside, 0700), ==, 0);
  g_assert_cmpint (g_mkdir_with_parents (blobs, 0700), ==, 0);
  g_assert_cmpint (g_mkdir_with_parents (snap, 0700), ==, 0);

  /* outside: refused */
  link = g_build_filename (outside, "model.safetensors", NULL);
  g_assert_cmpint (symlink (fixture, link), ==, 0);
  {
    g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (outside, &error);
    g_assert_null (ck);
    g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CHECKPOINT);
    g_assert_nonnull (strstr (error->message, "outside the checkpoint directory"));
    g_clear_error (&error);
  }
  /* …but a file named directly is the caller's choice */
  {
    g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (link, &error);
    g_assert_no_error (error);
  }
  g_unlink (link);
  g_clear_pointer (&link, g_free);

  /* inside the directory: followed */
  g_assert_true (g_file_set_contents (real, data, size, NULL));
  link = g_build_filename (inside, "model.safetensors", NULL);
  g_assert_cmpint (symlink ("weights.bin", link), ==, 0);
  {
    g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (inside, &error);
    g_assert_no_error (error);
    g_assert_true (moe_checkpoint_has_tensor (ck, "up_weight"));
  }
  g_unlink (link);
  g_unlink (real);
  g_clear_pointer (&link, g_free);

  /* the Hugging Face cache layout: followed */
  g_assert_true (g_file_set_contents (blob, data, size, NULL));
  link = g_build_filename (snap, "model.safetensors", NULL);
  g_assert_cmpint (symlink ("../../blobs/0123abcd", link), ==, 0);
  {
    g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (snap, &error);
    g_assert_no_error (error);
  }
  g_unlink (link);
  g_unlink (blob);
  g_rmdir (snap);
  g_autofree char *snaps = g_path_get_dirname (snap);
  g_rmdir (snaps);
  g_rmdir (blobs);
  g_rmdir (repo);
  g_rmdir (inside);
  g_rmdir (outside);
  g_rmdir (root);
}

static void
test_tensor_from_bytes (void)
{
  g_autoptr(GError) error = NULL;
  float values[6] = { 1, -2, 3.5f, 0, 65504, 1e-3f };
  gint64 shape[2] = { 2, 3 };
  g_autoptr(GBytes) bytes = g_bytes_new (values, sizeof values);
  g_autoptr(MoeTensor) t = moe_tensor_new_from_bytes (MOE_DTYPE_F32, shape, 2, bytes, &error);
  g_autoptr(MoeTensor) bf = NULL, back = NULL, view = NULL;
  g_autoptr(GBytes) f32 = NULL;
  g_autofree char *desc = NULL;
  gint64 flat[1] = { 6 };
  const float *v;

  g_assert_no_error (error);
  desc = moe_tensor_to_string (t);
  g_assert_cmpstr (desc, ==, "F32[2, 3]@cpu");
  g_assert_cmpuint (moe_tensor_get_n_bytes (t), ==, 24);

  bf = moe_tensor_to_dtype (t, MOE_DTYPE_BF16, &error);
  g_assert_no_error (error);
  f32 = moe_tensor_to_f32_bytes (bf, &error);
  v = g_bytes_get_data (f32, NULL);
  g_assert_cmpfloat (v[0], ==, 1.0f);
  g_assert_cmpfloat (v[2], ==, 3.5f);
  g_assert_cmpfloat (v[4], ==, 65536.0f);   /* rounds to nearest even in bf16 */
  g_assert_cmpfloat_with_epsilon (v[5], 1e-3f, 1e-5f);

  back = moe_tensor_to_dtype (t, MOE_DTYPE_F16, &error);
  g_clear_pointer (&f32, g_bytes_unref);
  f32 = moe_tensor_to_f32_bytes (back, &error);
  v = g_bytes_get_data (f32, NULL);
  g_assert_cmpfloat (v[4], ==, 65504.0f);
  g_assert_cmpfloat (v[1], ==, -2.0f);

  view = moe_tensor_reshape (t, flat, 1, &error);
  g_assert_no_error (error);
  g_assert_true (moe_tensor_get_data (view) == moe_tensor_get_data (t));

  /* wrong size, negative dims, ints to float */
  g_assert_null (moe_tensor_reshape (t, shape, 1, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH);
  g_clear_error (&error);
  {
    gint64 big[2] = { 4, 3 };
    g_assert_null (moe_tensor_new_from_bytes (MOE_DTYPE_F32, big, 2, bytes, &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH);
    g_clear_error (&error);
    big[0] = -1;
    g_assert_null (moe_tensor_new_from_bytes (MOE_DTYPE_F32, big, 2, bytes, &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH);
    g_clear_error (&error);
  }
  {
    g_autoptr(MoeTensor) ints = moe_tensor_new_zeros (MOE_DTYPE_I64, shape, 2, NULL);
    g_assert_null (moe_tensor_to_dtype (ints, MOE_DTYPE_F32, &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH);
  }
}

static void
test_dtype_names (void)
{
  MoeDType d;

  g_assert_true (moe_dtype_from_name ("BF16", &d));
  g_assert_cmpint (d, ==, MOE_DTYPE_BF16);
  g_assert_true (moe_dtype_from_name ("float32", &d));
  g_assert_cmpint (d, ==, MOE_DTYPE_F32);
  g_assert_true (moe_dtype_from_name ("F8_E4M3", &d));
  g_assert_cmpint (moe_dtype_get_size (d), ==, 1);
  g_assert_false (moe_dtype_from_name ("F128", &d));
  g_assert_cmpstr (moe_dtype_get_name (MOE_DTYPE_E8M0), ==, "F8_E8M0");
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);

  g_test_add_func ("/checkpoint/open-file", test_open_file);
  g_test_add_func ("/checkpoint/zero-copy", test_zero_copy);
  g_test_add_func ("/checkpoint/sharded", test_sharded);
  g_test_add_func ("/checkpoint/fuse/qwen", test_fuse_qwen);
  g_test_add_func ("/checkpoint/fuse/mixtral", test_fuse_mixtral);
  g_test_add_func ("/checkpoint/fuse/missing", test_fuse_missing);
  g_test_add_func ("/checkpoint/fuse/large", test_fuse_large);
  for (guint i = 0; i < G_N_ELEMENTS (broken); i++)
    {
      g_autofree char *p = g_strdup_printf ("/checkpoint/broken/%s", broken[i].file);
      g_test_add_data_func (p, &broken[i], test_broken);
    }
  g_test_add_func ("/checkpoint/symlink-policy", test_symlink_policy);
  g_test_add_func ("/tensor/from-bytes", test_tensor_from_bytes);
  g_test_add_func ("/tensor/dtype-names", test_dtype_names);

  return g_test_run ();
}
