/* forward.c: runs experts fixtures through the backends an *installed*
 * libmoe finds, the out-of-tree "skeleton" backend among them
 *
 * Built by test-install.sh against the installed libmoe-1.pc only:
 *
 *   forward LIBMOE_DIR SKELETON_DIR FIXTURE.safetensors…
 *
 * checks that libmoe was loaded from LIBMOE_DIR, that the default registry
 * (MOE_PLUGIN_PATH) lists "skeleton" from SKELETON_DIR and the built-in
 * backends from LIBMOE_DIR/libmoe-1/plugins, that every CPU backend's output
 * for each fixture is within a relative error of 1e-5 of its output_f64, and
 * that the GPU-only backends refuse the CPU with MOE_ERROR_NOT_SUPPORTED.
 * Prints what it checked; exits 1 at the first failure.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#ifndef _GNU_SOURCE
# define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <libmoe.h>

#define TOLERANCE 1e-5

static const char * const required_backends[] = {
  "skeleton", "eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe", "deepgemm_megamoe", NULL,
};

G_GNUC_PRINTF (1, 2) G_GNUC_NORETURN static void
fail (const char *format, ...)
{
  va_list args;
  g_autofree char *message = NULL;

  va_start (args, format);
  message = g_strdup_vprintf (format, args);
  va_end (args);
  g_printerr ("forward: FAIL: %s\n", message);
  exit (1);
}

static void
check_no_error (GError *error, const char *what)
{
  if (error != NULL)
    fail ("%s: %s", what, error->message);
}

/* the canonical form of @path, so that symlinks and ".." compare equal */
static char *
canonical (const char *path)
{
  char *real = realpath (path, NULL);
  char *out;

  if (real == NULL)
    fail ("%s does not exist", path);
  out = g_strdup (real);
  free (real);
  return out;
}

static void
check_dirname (const char *file, const char *expected_dir, const char *what)
{
  g_autofree char *dir = g_path_get_dirname (file);
  g_autofree char *a = canonical (dir);
  g_autofree char *b = canonical (expected_dir);

  if (!g_str_equal (a, b))
    fail ("%s is %s, not in %s", what, file, expected_dir);
  g_print ("%s: %s\n", what, file);
}

static char *
metadata (MoeCheckpoint *ck, const char *key)
{
  const char *v = moe_checkpoint_get_metadata_value (ck, key);

  if (v == NULL)
    fail ("%s: no metadata key %s", moe_checkpoint_get_path (ck), key);
  /* transformers wrote some values JSON-quoted */
  return g_strstrip (g_strdelimit (g_strdup (v), "\"", ' '));
}

static gboolean
metadata_true (MoeCheckpoint *ck, const char *key)
{
  g_autofree char *v = metadata (ck, key);
  return g_str_equal (v, "true");
}

static MoeTensor *
tensor (MoeCheckpoint *ck, const char *name, MoeDType dtype)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) t = moe_checkpoint_get_tensor (ck, name, &error);
  MoeTensor *out;

  check_no_error (error, name);
  if (!moe_dtype_is_float (moe_tensor_get_dtype (t)))
    return g_steal_pointer (&t);
  out = moe_tensor_to_dtype (t, dtype, &error);
  check_no_error (error, name);
  return out;
}

/* ‖a − b‖ / ‖b‖ in double */
static double
rel_error (MoeTensor *a, MoeTensor *b)
{
  g_autoptr(MoeTensor) a64 = moe_tensor_to_dtype (a, MOE_DTYPE_F64, NULL);
  g_autoptr(MoeTensor) b64 = moe_tensor_to_dtype (b, MOE_DTYPE_F64, NULL);
  g_autoptr(GBytes) ab = moe_tensor_dup_bytes (a64, NULL);
  g_autoptr(GBytes) bb = moe_tensor_dup_bytes (b64, NULL);
  const double *x = g_bytes_get_data (ab, NULL), *y = g_bytes_get_data (bb, NULL);
  gint64 n = moe_tensor_get_n_elements (a);
  double num = 0, den = 0;

  if (n != moe_tensor_get_n_elements (b))
    fail ("%" G_GINT64_FORMAT " elements against %" G_GINT64_FORMAT,
          n, moe_tensor_get_n_elements (b));
  for (gint64 i = 0; i < n; i++)
    {
      if (isnan (x[i]))
        return INFINITY;
      num += (x[i] - y[i]) * (x[i] - y[i]);
      den += y[i] * y[i];
    }
  if (den == 0)
    fail ("the reference output is all zeros");
  return sqrt (num / den);
}

static void
run_fixture (const char *path, char **backends, char **cpu_backends)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeCheckpoint) ck = moe_checkpoint_open (path, &error);
  g_autoptr(MoeTensor) up = NULL, down = NULL;
  g_autoptr(MoeTensor) hidden = NULL, index = NULL, weights = NULL, reference = NULL;
  g_autoptr(MoeExperts) experts = NULL;
  g_autofree char *act = NULL;
  g_autofree char *base = g_path_get_basename (path);

  check_no_error (error, path);
  up = tensor (ck, "up_weight", MOE_DTYPE_F32);
  down = tensor (ck, "down_weight", MOE_DTYPE_F32);
  experts = moe_experts_new (up, down);
  act = metadata (ck, "act");
  moe_experts_set_activation (experts, act);
  moe_experts_set_has_gate (experts, metadata_true (ck, "has_gate"));
  moe_experts_set_is_transposed (experts, metadata_true (ck, "is_transposed"));
  if (metadata_true (ck, "interleaved_clamped_swiglu"))
    moe_experts_set_gate_layout (experts, MOE_GATE_LAYOUT_INTERLEAVED);
  if (moe_checkpoint_has_tensor (ck, "up_bias"))
    {
      g_autoptr(MoeTensor) ub = tensor (ck, "up_bias", MOE_DTYPE_F32);
      g_autoptr(MoeTensor) db = tensor (ck, "down_bias", MOE_DTYPE_F32);
      moe_experts_set_up_bias (experts, ub);
      moe_experts_set_down_bias (experts, db);
    }
  if (!moe_experts_validate (experts, &error))
    fail ("%s: %s", base, error->message);

  hidden = tensor (ck, "hidden_states", MOE_DTYPE_F32);
  index = tensor (ck, "top_k_index", MOE_DTYPE_F32);
  weights = tensor (ck, "top_k_weights", MOE_DTYPE_F32);
  reference = tensor (ck, "output_f64", MOE_DTYPE_F64);

  for (guint i = 0; backends[i] != NULL; i++)
    {
      g_autoptr(MoeTensor) out = NULL;
      double err;

      moe_experts_set_implementation (experts, backends[i]);
      out = moe_experts_forward (experts, hidden, index, weights, &error);
      if (!g_strv_contains ((const char * const *) cpu_backends, backends[i]))
        {
          /* a backend that needs a GPU says so */
          if (out != NULL || !g_error_matches (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED))
            fail ("%s through %s: not refused on the CPU", base, backends[i]);
          g_print ("%s through %s: refused: %s\n", base, backends[i], error->message);
          g_clear_error (&error);
          continue;
        }
      if (out == NULL)
        fail ("%s through %s: %s", base, backends[i], error->message);
      if (!moe_tensor_has_shape (out, moe_tensor_get_shape (hidden, NULL), 2) ||
          moe_tensor_get_dtype (out) != MOE_DTYPE_F32)
        fail ("%s through %s: wrong output shape or dtype", base, backends[i]);
      err = rel_error (out, reference);
      g_print ("%s through %s: relative error %.3g\n", base, backends[i], err);
      if (!(err <= TOLERANCE))
        fail ("%s through %s: relative error %.3g > %g", base, backends[i], err, TOLERANCE);
    }
}

int
main (int argc, char **argv)
{
  MoePluginRegistry *registry;
  g_auto(GStrv) backends = NULL;
  g_auto(GStrv) cpu_backends = NULL;
  g_autofree char *builtin_dir = NULL;
  Dl_info dl;

  if (argc < 4)
    {
      g_printerr ("usage: %s LIBMOE_DIR SKELETON_DIR FIXTURE.safetensors…\n", argv[0]);
      return 2;
    }

  /* the libmoe in use is the installed one, not the build tree's */
  if (dladdr ((void *) moe_experts_new, &dl) == 0 || dl.dli_fname == NULL)
    fail ("dladdr found no file for moe_experts_new");
  check_dirname (dl.dli_fname, argv[1], "libmoe");
  g_print ("libmoe %s, plugin ABI %d\n", MOE_VERSION_S, MOE_PLUGIN_ABI_VERSION);

  registry = moe_plugin_registry_get_default ();
  backends = moe_plugin_registry_list_backends (registry);
  cpu_backends = moe_plugin_registry_list_backends_for_device (registry, "cpu");
  {
    g_autofree char *list = g_strjoinv (", ", backends);
    g_print ("backends: %s\n", list);
  }

  /* where each backend comes from; none is opened yet */
  builtin_dir = g_build_filename (argv[1], "libmoe-1", "plugins", NULL);
  for (guint i = 0; required_backends[i] != NULL; i++)
    {
      const char *name = required_backends[i];
      MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, name);
      g_autofree char *what = g_strdup_printf ("backend %s", name);

      if (info == NULL)
        fail ("the default registry has no backend “%s” (MOE_PLUGIN_PATH=%s)",
              name, g_getenv ("MOE_PLUGIN_PATH"));
      if (moe_plugin_info_is_loaded (info))
        fail ("backend %s was opened before it was used", name);
      check_dirname (moe_plugin_info_get_module_path (info),
                     g_str_equal (name, "skeleton") ? argv[2] : builtin_dir, what);
    }
  {
    MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "skeleton");
    g_autofree char *dtypes = moe_plugin_info_dup_extra (info, "X-Moe-Dtypes");

    if (!g_str_equal (moe_plugin_info_get_type_name (info), "MoeSkeletonBackend") ||
        g_strcmp0 (dtypes, "f32;bf16;f16;") != 0)
      fail ("skeleton.plugin was not installed as written");
  }

  for (int i = 3; i < argc; i++)
    run_fixture (argv[i], backends, cpu_backends);

  for (guint i = 0; required_backends[i] != NULL; i++)
    if (!moe_plugin_info_is_loaded (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND,
                                                                required_backends[i])))
      fail ("backend %s ran but is not loaded", required_backends[i]);

  g_print ("forward: all CPU backends within %g on %d fixture(s)\n", TOLERANCE, argc - 3);
  return 0;
}
