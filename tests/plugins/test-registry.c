/* test-registry.c: plugin discovery and loading, against fixture plugins
 *
 * Every fixture case is a directory of the build tree (FIXTURE_BUILD_DIR/<case>,
 * see meson.build) that a registry made with moe_plugin_registry_new()
 * searches alone or with others. Types registered by plugins, the
 * environment and the default registry are process-wide, so the tests that
 * need a fresh process run their body in a subprocess.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <unistd.h>

#include <gmodule.h>
#include <libmoe.h>
#include <moe-plugin.h>

#ifndef FIXTURE_BUILD_DIR
# error "FIXTURE_BUILD_DIR must be the build directory of tests/plugins"
#endif

/* --- helpers ------------------------------------------------------------ */

#define assert_contains(haystack, needle) G_STMT_START {                        \
    const char *h_ = (haystack), *n_ = (needle);                                \
    if (h_ == NULL || strstr (h_, n_) == NULL)                                  \
      {                                                                         \
        g_autofree char *m_ = g_strdup_printf ("“%s” does not contain “%s”",    \
                                               h_ ? h_ : "(null)", n_);         \
        g_assertion_message (G_LOG_DOMAIN, __FILE__, __LINE__, G_STRFUNC, m_);  \
      }                                                                         \
  } G_STMT_END

static char *
fixture_dir (const char *fixture)
{
  return g_build_filename (FIXTURE_BUILD_DIR, fixture, NULL);
}

/* A registry searching the given fixture directories, in order. */
G_GNUC_NULL_TERMINATED static MoePluginRegistry *
registry_for (const char *first, ...)
{
  MoePluginRegistry *registry = moe_plugin_registry_new ();
  va_list args;

  va_start (args, first);
  for (const char *fixture = first; fixture != NULL; fixture = va_arg (args, const char *))
    {
      g_autofree char *dir = fixture_dir (fixture);
      g_assert_true (g_file_test (dir, G_FILE_TEST_IS_DIR));
      moe_plugin_registry_add_search_path (registry, dir);
    }
  va_end (args);
  return registry;
}

static void
assert_strv_equal (char * const *got, const char * const *expected)
{
  g_autofree char *a = g_strjoinv (", ", (char **) got);
  g_autofree char *b = g_strjoinv (", ", (char **) expected);

  g_assert_cmpstr (a, ==, b);
}

/* Whether the module recorded that it was opened (FIXTURE_RECORD_OPEN). */
static gboolean
module_was_opened (const char *module)
{
  g_autofree char *var = g_strconcat ("MOE_TEST_OPENED_", module, NULL);
  return g_getenv (var) != NULL;
}

/* get_backend(@name) is listed but fails with @code; the message names the
 * plugin and contains each of the NULL-terminated substrings. A second call
 * fails the same way: the failure is remembered. */
G_GNUC_NULL_TERMINATED static void
assert_backend_fails (MoePluginRegistry *registry,
                      const char        *name,
                      MoeError           code,
                      ...)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(GError) again = NULL;
  g_autofree char *quoted = g_strdup_printf ("“%s”", name);
  MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, name);
  va_list args;

  g_assert_nonnull (info);
  g_assert_null (moe_plugin_registry_get_backend (registry, name, &error));
  g_assert_error (error, MOE_ERROR, (int) code);
  g_test_message ("%s: %s", name, error->message);
  assert_contains (error->message, quoted);
  va_start (args, code);
  for (const char *s = va_arg (args, const char *); s != NULL; s = va_arg (args, const char *))
    assert_contains (error->message, s);
  va_end (args);
  g_assert_false (moe_plugin_info_is_loaded (info));

  g_assert_null (moe_plugin_registry_get_backend (registry, name, &again));
  g_assert_error (again, MOE_ERROR, (int) code);
  g_assert_cmpstr (again->message, ==, error->message);
}

/* Runs the calling test's body in a fresh process: returns TRUE in the
 * parent, after checking that the child passed; FALSE in the child, which
 * goes on with the body. */
static gboolean
ran_in_subprocess (void)
{
  if (g_test_subprocess ())
    return FALSE;
  g_test_trap_subprocess (NULL, 0, G_TEST_SUBPROCESS_INHERIT_STDERR);
  g_test_trap_assert_passed ();
  return TRUE;
}

#define IN_FRESH_PROCESS() G_STMT_START { if (ran_in_subprocess ()) return; } G_STMT_END

/* libmoe logs through the structured API (G_LOG_USE_STRUCTURED), which
 * g_test_expect_message() does not see: this writer does its job for
 * warnings in the "Moe" domain. Anything unexpected goes to the default
 * writer, where a warning is fatal under g_test_init(). */
static GPtrArray *expected_warnings;   /* char* glob patterns, in order */

static void
expect_warning (const char *pattern)
{
  g_ptr_array_add (expected_warnings, g_strdup (pattern));
}

static void
assert_expected_warnings (void)
{
  if (expected_warnings->len > 0)
    {
      g_autofree char *m = g_strdup_printf ("expected warning “%s” was not logged",
                                            (char *) g_ptr_array_index (expected_warnings, 0));
      g_assertion_message (G_LOG_DOMAIN, __FILE__, __LINE__, G_STRFUNC, m);
    }
}

static GLogWriterOutput
test_log_writer (GLogLevelFlags   log_level,
                 const GLogField *fields,
                 gsize            n_fields,
                 gpointer         user_data)
{
  if ((log_level & G_LOG_LEVEL_WARNING) && expected_warnings->len > 0)
    {
      const char *domain = NULL, *message = NULL;

      for (gsize i = 0; i < n_fields; i++)
        if (g_str_equal (fields[i].key, "GLIB_DOMAIN"))
          domain = fields[i].value;
        else if (g_str_equal (fields[i].key, "MESSAGE"))
          message = fields[i].value;
      if (g_strcmp0 (domain, "Moe") == 0 && message != NULL &&
          g_pattern_match_simple (g_ptr_array_index (expected_warnings, 0), message))
        {
          g_test_message ("expected warning: %s", message);
          g_ptr_array_remove_index (expected_warnings, 0);
          return G_LOG_WRITER_HANDLED;
        }
    }
  return g_log_writer_default (log_level, fields, n_fields, user_data);
}

/* --- discovery ---------------------------------------------------------- */

/* Listing reads keyfiles only; the module is opened by the first
 * get_backend(), once. */
static void
test_lazy_loading (void)
{
  g_autoptr(MoePluginRegistry) registry = NULL;
  g_auto(GStrv) backends = NULL;
  g_auto(GStrv) devices = NULL;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoePluginInfo) item = NULL;
  MoePluginInfo *info;
  MoeExpertsBackend *backend;

  IN_FRESH_PROCESS ();

  registry = registry_for ("good", NULL);
  backends = moe_plugin_registry_list_backends (registry);
  devices = moe_plugin_registry_list_devices (registry);
  assert_strv_equal (backends, (const char *[]) { "good", NULL });
  assert_strv_equal (devices, (const char *[]) { NULL });
  /* by device, from the keyfile's Devices=cpu;fake; ("fake:1" is a "fake") */
  {
    g_auto(GStrv) cpu = moe_plugin_registry_list_backends_for_device (registry, "cpu");
    g_auto(GStrv) fake1 = moe_plugin_registry_list_backends_for_device (registry, "fake:1");
    g_auto(GStrv) cuda = moe_plugin_registry_list_backends_for_device (registry, "cuda");
    assert_strv_equal (cpu, (const char *[]) { "good", NULL });
    assert_strv_equal (fake1, (const char *[]) { "good", NULL });
    assert_strv_equal (cuda, (const char *[]) { NULL });
  }

  /* the registry is a GListModel of what it accepted */
  g_assert_true (g_list_model_get_item_type (G_LIST_MODEL (registry)) == MOE_TYPE_PLUGIN_INFO);
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, 1);
  item = g_list_model_get_item (G_LIST_MODEL (registry), 0);
  g_assert_null (g_list_model_get_item (G_LIST_MODEL (registry), 1));

  info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "good");
  g_assert_true (info == item);
  g_assert_null (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_DEVICE, "good"));
  g_assert_null (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "nope"));

  /* nothing opened yet: no module, no type */
  g_assert_false (moe_plugin_info_is_loaded (info));
  g_assert_false (module_was_opened ("good"));
  g_assert_true (g_type_from_name ("MoeTestGoodBackend") == G_TYPE_INVALID);
  {
    g_autoptr(GPtrArray) rejected = moe_plugin_registry_dup_rejected (registry);
    g_assert_cmpuint (rejected->len, ==, 0);
  }
  g_assert_false (moe_plugin_info_is_loaded (info));
  g_assert_false (module_was_opened ("good"));

  backend = moe_plugin_registry_get_backend (registry, "good", &error);
  g_assert_no_error (error);
  g_assert_true (MOE_IS_EXPERTS_BACKEND (backend));
  g_assert_cmpstr (G_OBJECT_TYPE_NAME (backend), ==, "MoeTestGoodBackend");
  g_assert_cmpstr (moe_experts_backend_get_name (backend), ==, "good");
  g_assert_true (moe_plugin_info_is_loaded (info));
  g_assert_true (module_was_opened ("good"));
  g_assert_true (g_type_from_name ("MoeTestGoodBackend") == G_OBJECT_TYPE (backend));

  /* one instance per registry */
  g_assert_true (moe_plugin_registry_get_backend (registry, "good", NULL) == backend);
}

/* What MoePluginInfo reads from a keyfile. */
static void
test_info_getters (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("good", NULL);
  g_autofree char *dir = fixture_dir ("good");
  g_autofree char *module = g_build_filename (dir, "libmoe-good.so", NULL);
  g_autofree char *keyfile = g_build_filename (dir, "good.plugin", NULL);
  g_autofree char *dtypes = NULL;
  g_autofree char *license = NULL;
  g_autofree char *missing = NULL;
  g_autoptr(MoePluginInfo) direct = NULL;
  g_autoptr(GError) error = NULL;
  MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "good");

  g_assert_nonnull (info);
  g_assert_cmpstr (moe_plugin_info_get_name (info), ==, "good");
  g_assert_cmpstr (moe_plugin_info_get_module_name (info), ==, "good");
  g_assert_true (g_path_is_absolute (moe_plugin_info_get_module_path (info)));
  g_assert_cmpstr (moe_plugin_info_get_module_path (info), ==, module);
  g_assert_true (g_file_test (moe_plugin_info_get_module_path (info), G_FILE_TEST_IS_REGULAR));
  g_assert_cmpstr (moe_plugin_info_get_keyfile_path (info), ==, keyfile);
  g_assert_cmpstr (moe_plugin_info_get_type_name (info), ==, "MoeTestGoodBackend");
  g_assert_cmpstr (moe_plugin_info_get_description (info), ==, "A fixture backend that works");
  g_assert_cmpstr (moe_plugin_info_get_version (info), ==, "1.2.3");
  g_assert_cmpint (moe_plugin_info_get_kind (info), ==, MOE_PLUGIN_KIND_EXPERTS_BACKEND);
  g_assert_cmpint (moe_plugin_info_get_priority (info), ==, 7);
  g_assert_cmpuint (moe_plugin_info_get_abi (info), ==, 1);
  g_assert_cmpuint (moe_plugin_info_get_abi (info), ==, MOE_PLUGIN_ABI_VERSION);
  assert_strv_equal ((char **) moe_plugin_info_get_devices (info), (const char *[]) { "cpu", "fake", NULL });

  dtypes = moe_plugin_info_dup_extra (info, "X-Moe-Dtypes");
  license = moe_plugin_info_dup_extra (info, "License");
  missing = moe_plugin_info_dup_extra (info, "X-Not-There");
  g_assert_cmpstr (dtypes, ==, "f32;bf16;");
  g_assert_cmpstr (license, ==, "LGPL-2.1-or-later");
  g_assert_null (missing);

  /* the same, read directly; optional keys have their defaults */
  direct = moe_plugin_info_new_from_file (keyfile, &error);
  g_assert_no_error (error);
  g_assert_cmpstr (moe_plugin_info_get_module_path (direct), ==, module);
  g_assert_false (moe_plugin_info_is_loaded (direct));
  {
    g_autofree char *shadow = fixture_dir ("shadow");
    g_autofree char *path = g_build_filename (shadow, "shadow.plugin", NULL);
    g_autoptr(MoePluginInfo) bare = moe_plugin_info_new_from_file (path, &error);

    g_assert_no_error (error);
    g_assert_cmpint (moe_plugin_info_get_priority (bare), ==, 0);
    g_assert_null (moe_plugin_info_get_version (bare));
    assert_strv_equal ((char **) moe_plugin_info_get_devices (bare), (const char *[]) { NULL });
  }
}

/* The backend a registry loaded runs, through libmoe's validation; the
 * sentinel slot (id E) is accepted and adds nothing. */
static void
test_good_backend_forward (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("good", NULL);
  g_autoptr(GError) error = NULL;
  /* E = 2 experts, H = 2, I = 1, gated: up [E, 2I, H], down [E, H, I] */
  static const float up[8] = { 1, 0, 0, 1, 1, 1, 0, 1 };
  static const float down[4] = { 1, 2, 3, 4 };
  static const float x[4] = { 1, 2, 3, 4 };
  static const gint64 ids[4] = { 0, 2, 1, 0 };
  static const float w[4] = { 0.25f, 1000.f, 0.5f, 0.125f };
  const float expected[4] = { 0.25f, 0.5f, 3 * 0.625f, 4 * 0.625f };
  g_autoptr(GBytes) up_b = g_bytes_new_static (up, sizeof up);
  g_autoptr(GBytes) down_b = g_bytes_new_static (down, sizeof down);
  g_autoptr(GBytes) x_b = g_bytes_new_static (x, sizeof x);
  g_autoptr(GBytes) ids_b = g_bytes_new_static (ids, sizeof ids);
  g_autoptr(GBytes) w_b = g_bytes_new_static (w, sizeof w);
  g_autoptr(MoeTensor) up_t = moe_tensor_new_from_bytes (MOE_DTYPE_F32, (gint64[]) { 2, 2, 2 }, 3, up_b, &error);
  g_autoptr(MoeTensor) down_t = moe_tensor_new_from_bytes (MOE_DTYPE_F32, (gint64[]) { 2, 2, 1 }, 3, down_b, &error);
  g_autoptr(MoeTensor) hidden = moe_tensor_new_from_bytes (MOE_DTYPE_F32, (gint64[]) { 2, 2 }, 2, x_b, &error);
  g_autoptr(MoeTensor) index = moe_tensor_new_from_bytes (MOE_DTYPE_I64, (gint64[]) { 2, 2 }, 2, ids_b, &error);
  g_autoptr(MoeTensor) weights = moe_tensor_new_from_bytes (MOE_DTYPE_F32, (gint64[]) { 2, 2 }, 2, w_b, &error);
  g_autoptr(MoeExperts) experts = NULL;
  g_autoptr(MoeTensor) out = NULL;
  g_autoptr(GBytes) out_b = NULL;
  MoeExpertsBackend *backend;
  const float *y;

  g_assert_no_error (error);
  experts = moe_experts_new (up_t, down_t);
  g_assert_true (moe_experts_validate (experts, &error));
  g_assert_no_error (error);

  backend = moe_plugin_registry_get_backend (registry, "good", &error);
  g_assert_no_error (error);
  g_assert_true (moe_experts_backend_is_supported (backend, moe_device_get_cpu (), experts, &error));
  g_assert_no_error (error);

  out = moe_experts_backend_forward (backend, experts, hidden, index, weights, &error);
  g_assert_no_error (error);
  g_assert_true (moe_tensor_has_shape (out, (gint64[]) { 2, 2 }, 2));
  out_b = moe_tensor_dup_bytes (out, &error);
  g_assert_no_error (error);
  y = g_bytes_get_data (out_b, NULL);
  for (guint i = 0; i < 4; i++)
    g_assert_cmpfloat_with_epsilon (y[i], expected[i], 1e-6);
}

/* Unknown names list what is available. */
static void
test_unknown_backend (void)
{
  g_autoptr(MoePluginRegistry) empty = moe_plugin_registry_new ();
  g_autoptr(MoePluginRegistry) one = registry_for ("good", NULL);
  g_autoptr(MoePluginRegistry) two = registry_for ("good", "wrong-type", NULL);
  g_autoptr(GError) error = NULL;

  g_assert_null (moe_plugin_registry_get_backend (one, "nope", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
  g_test_message ("%s", error->message);
  assert_contains (error->message, "“nope”");
  assert_contains (error->message, "available: good");
  g_clear_error (&error);

  g_assert_null (moe_plugin_registry_get_backend (two, "nope", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
  assert_contains (error->message, "available: good, wrong_type");
  g_clear_error (&error);

  g_assert_null (moe_plugin_registry_get_backend (empty, "good", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
  g_test_message ("%s", error->message);
  assert_contains (error->message, "“good”");
  assert_contains (error->message, "none");
  g_clear_error (&error);

  /* the name is a backend name, not a module or file name */
  g_assert_null (moe_plugin_registry_get_backend (one, "libmoe-good.so", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
}

/* Backends and devices have separate names. */
static void
test_kinds (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("device", "good", NULL);
  g_auto(GStrv) backends = moe_plugin_registry_list_backends (registry);
  g_auto(GStrv) devices = moe_plugin_registry_list_devices (registry);
  g_autoptr(GError) error = NULL;
  MoePluginInfo *device, *backend;

  assert_strv_equal (backends, (const char *[]) { "good", NULL });
  assert_strv_equal (devices, (const char *[]) { "good", NULL });
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, 2);

  device = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_DEVICE, "good");
  backend = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "good");
  g_assert_cmpint (moe_plugin_info_get_kind (device), ==, MOE_PLUGIN_KIND_DEVICE);
  g_assert_cmpstr (moe_plugin_info_get_module_name (device), ==, "absent_device");
  g_assert_cmpstr (moe_plugin_info_get_module_name (backend), ==, "good");

  g_assert_null (moe_plugin_registry_get_device (registry, "good", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_LOAD);
  assert_contains (error->message, "“good”");
  assert_contains (error->message, "libmoe-absent_device.so");
  g_clear_error (&error);

  g_assert_null (moe_plugin_registry_get_device (registry, "nope", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NO_DEVICE);
  g_test_message ("%s", error->message);
  assert_contains (error->message, "“nope”");
  assert_contains (error->message, "available: cpu, good");
  g_clear_error (&error);

  /* the device's failure does not touch the backend of the same name */
  g_assert_nonnull (moe_plugin_registry_get_backend (registry, "good", &error));
  g_assert_no_error (error);
}

/* The first plugin with a name wins, in search-path order. */
static void
test_first_wins (void)
{
  g_autoptr(MoePluginRegistry) shadowed = registry_for ("good", "shadow", NULL);
  g_autoptr(MoePluginRegistry) shadowing = registry_for ("shadow", "good", NULL);
  g_autofree char *good_dir = fixture_dir ("good");
  g_autofree char *shadow_dir = fixture_dir ("shadow");
  g_autofree char *good_module = g_build_filename (good_dir, "libmoe-good.so", NULL);
  g_autofree char *shadow_module = g_build_filename (shadow_dir, "libmoe-shadow.so", NULL);
  g_auto(GStrv) names = moe_plugin_registry_list_backends (shadowed);
  g_autoptr(GError) error = NULL;
  MoePluginInfo *info;

  assert_strv_equal (names, (const char *[]) { "good", NULL });
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (shadowed)), ==, 1);
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (shadowing)), ==, 1);

  info = moe_plugin_registry_lookup (shadowed, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "good");
  g_assert_cmpstr (moe_plugin_info_get_module_path (info), ==, good_module);
  g_assert_nonnull (moe_plugin_registry_get_backend (shadowed, "good", &error));
  g_assert_no_error (error);

  info = moe_plugin_registry_lookup (shadowing, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "good");
  g_assert_cmpstr (moe_plugin_info_get_module_path (info), ==, shadow_module);
  g_assert_cmpstr (moe_plugin_info_get_description (info), ==, "The shadowing \"good\"");
  assert_backend_fails (shadowing, "good", MOE_ERROR_PLUGIN_LOAD, "libmoe-shadow.so", NULL);
}

/* Directories added after the first scan are scanned at once; a directory
 * added twice is searched once; rescan() keeps what was accepted. */
static void
test_add_after_scan (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("good", NULL);
  g_autofree char *good = fixture_dir ("good");
  g_autofree char *wrong_type = fixture_dir ("wrong-type");
  g_auto(GStrv) before = moe_plugin_registry_list_backends (registry);
  g_auto(GStrv) after = NULL;
  g_auto(GStrv) rescanned = NULL;

  assert_strv_equal (before, (const char *[]) { "good", NULL });
  moe_plugin_registry_add_search_path (registry, wrong_type);
  moe_plugin_registry_add_search_path (registry, good);
  after = moe_plugin_registry_list_backends (registry);
  assert_strv_equal (after, (const char *[]) { "good", "wrong_type", NULL });
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, 2);

  moe_plugin_registry_rescan (registry);
  rescanned = moe_plugin_registry_list_backends (registry);
  assert_strv_equal (rescanned, (const char *[]) { "good", "wrong_type", NULL });
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, 2);
}

/* Relative search paths are refused with a warning: plugins are never
 * loaded from the current directory. */
static void
test_relative_path (void)
{
  g_autoptr(MoePluginRegistry) registry = NULL;
  g_auto(GStrv) names = NULL;
  g_auto(GStrv) later = NULL;
  g_autofree char *good = fixture_dir ("good");

  IN_FRESH_PROCESS ();

  /* "good" and "./good" would name the good fixture from here */
  g_assert_cmpint (chdir (FIXTURE_BUILD_DIR), ==, 0);
  g_assert_true (g_file_test ("good/good.plugin", G_FILE_TEST_IS_REGULAR));

  registry = moe_plugin_registry_new ();
  expect_warning ("Ignoring relative plugin path “good”*");
  moe_plugin_registry_add_search_path (registry, "good");
  expect_warning ("Ignoring relative plugin path “./good”*");
  moe_plugin_registry_add_search_path (registry, "./good");
  assert_expected_warnings ();

  names = moe_plugin_registry_list_backends (registry);
  assert_strv_equal (names, (const char *[]) { NULL });
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, 0);

  /* the registry still works */
  moe_plugin_registry_add_search_path (registry, good);
  later = moe_plugin_registry_list_backends (registry);
  assert_strv_equal (later, (const char *[]) { "good", NULL });
}

/* --- broken plugins ----------------------------------------------------- */

static void
test_descriptor_abi (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("wrong-abi", NULL);
  g_autofree char *version = g_strdup_printf ("libmoe %d.%d", MOE_MAJOR_VERSION, MOE_MINOR_VERSION);
  g_autofree char *newer = g_strdup_printf ("libmoe %d.%d", MOE_MAJOR_VERSION, MOE_MINOR_VERSION + 1);
  g_autofree char *major = g_strdup_printf ("libmoe %d.0", MOE_MAJOR_VERSION + 1);
  g_auto(GStrv) names = moe_plugin_registry_list_backends (registry);

  /* listed: the keyfiles are fine */
  assert_strv_equal (names, (const char *[]) { "newer_minor", "null_desc", "other_major", "wrong_abi", NULL });

  /* each init function would abort if it ran */
  assert_backend_fails (registry, "wrong_abi", MOE_ERROR_PLUGIN_ABI,
                        "libmoe-wrong_abi.so", "built for plugin ABI 999", version, NULL);
  assert_backend_fails (registry, "newer_minor", MOE_ERROR_PLUGIN_ABI,
                        "libmoe-newer_minor.so", newer, NULL);
  assert_backend_fails (registry, "other_major", MOE_ERROR_PLUGIN_ABI,
                        "libmoe-other_major.so", major, NULL);
  assert_backend_fails (registry, "null_desc", MOE_ERROR_PLUGIN_ABI,
                        "libmoe-null_desc.so", "plugin ABI 0", NULL);
}

static void
test_keyfile_abi (void)
{
  g_autoptr(MoePluginRegistry) registry = NULL;

  IN_FRESH_PROCESS ();

  registry = registry_for ("keyfile-abi", NULL);
  g_assert_cmpuint (moe_plugin_info_get_abi (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND,
                                                                        "keyfile_abi")), ==, 2);
  assert_backend_fails (registry, "keyfile_abi", MOE_ERROR_PLUGIN_ABI,
                        "keyfile_abi.plugin", "declares plugin ABI 2", NULL);
  /* refused on the keyfile's word: the module was never opened */
  g_assert_false (module_was_opened ("keyfile_abi"));
  g_assert_true (g_type_from_name ("MoeTestKeyfileAbiBackend") == G_TYPE_INVALID);
}

static void
test_missing_symbol (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("missing-symbol", NULL);

  assert_backend_fails (registry, "missing_symbol", MOE_ERROR_PLUGIN_SYMBOL,
                        "libmoe-missing_symbol.so", "moe_plugin_missing_symbol_get_desc", NULL);
}

static void
test_unloadable (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("unloadable", NULL);

  assert_backend_fails (registry, "garbage", MOE_ERROR_PLUGIN_LOAD,
                        "could not open", "libmoe-garbage.so", NULL);
}

static void
test_missing_module (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("missing-module", NULL);
  MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, "missing_module");

  g_assert_nonnull (info);
  g_assert_false (g_file_test (moe_plugin_info_get_module_path (info), G_FILE_TEST_EXISTS));
  assert_backend_fails (registry, "missing_module", MOE_ERROR_PLUGIN_LOAD,
                        "could not open", "libmoe-missing_module.so", NULL);
}

static const struct {
  const char *file;
  const char *reason;
} malformed[] = {
  { "bad-abi.plugin", "Abi=one is not a number" },
  { "bad-priority.plugin", "Priority= is not an integer" },
  { "bad-type.plugin", "Type=9Lives is not a valid GType name" },
  { "bogus-kind.plugin", "Kind=bogus is not one of experts-backend, device" },
  { "no-group.plugin", "no [Moe Plugin] group" },
  { "no-module.plugin", "needs a non-empty Module= key" },
  { "not-a-keyfile.plugin", "not a valid keyfile" },
  { "slash-module.plugin", "Module=../good/good must be letters, digits and '_' only" },
  { "slash-name.plugin", "Name= must be UTF-8 without '/'" },
};

/* Malformed keyfiles are refused on reading, each with its reason; the rest
 * of the directory is still read. */
static void
test_malformed_keyfiles (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("malformed", NULL);
  g_autofree char *dir = fixture_dir ("malformed");
  g_auto(GStrv) names = moe_plugin_registry_list_backends (registry);
  g_autoptr(GPtrArray) rejected = moe_plugin_registry_dup_rejected (registry);
  g_autoptr(GError) error = NULL;

  assert_strv_equal (names, (const char *[]) { "survivor", NULL });
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, 1);

  for (guint i = 0; i < rejected->len; i++)
    g_test_message ("rejected: %s", (char *) g_ptr_array_index (rejected, i));
  g_assert_cmpuint (rejected->len, ==, G_N_ELEMENTS (malformed));
  for (guint i = 0; i < G_N_ELEMENTS (malformed); i++)
    {
      g_autofree char *path = g_build_filename (dir, malformed[i].file, NULL);
      g_autofree char *lead = g_strconcat (path, ": ", NULL);
      g_autoptr(MoePluginInfo) info = NULL;
      g_autoptr(GError) local = NULL;
      guint found = 0;

      for (guint j = 0; j < rejected->len; j++)
        if (g_str_has_prefix (g_ptr_array_index (rejected, j), lead))
          {
            assert_contains (g_ptr_array_index (rejected, j), malformed[i].reason);
            found++;
          }
      g_assert_cmpuint (found, ==, 1);

      /* the same reason when the file is read directly */
      info = moe_plugin_info_new_from_file (path, &local);
      g_assert_null (info);
      g_assert_error (local, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE);
      assert_contains (local->message, path);
      assert_contains (local->message, malformed[i].reason);
    }
  /* a file not called *.plugin is not read at all */
  for (guint j = 0; j < rejected->len; j++)
    g_assert_null (strstr (g_ptr_array_index (rejected, j), "README.txt"));

  /* the refused plugins are not there under any of their names */
  for (const char * const *n = (const char *[]) { "bogus_kind", "slash_module", "slash_name", "bad_type",
                                                  "bad_abi", "bad_priority", "no_group", NULL }; *n; n++)
    {
      g_assert_null (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, *n));
      g_assert_null (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_DEVICE, *n));
    }
  g_assert_null (moe_plugin_registry_get_backend (registry, "bogus_kind", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
  assert_contains (error->message, "available: survivor");

  /* a rescan reads them again, once each */
  moe_plugin_registry_rescan (registry);
  {
    g_autoptr(GPtrArray) again = moe_plugin_registry_dup_rejected (registry);
    g_assert_cmpuint (again->len, ==, G_N_ELEMENTS (malformed));
  }
}

static void
test_wrong_type (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("wrong-type", NULL);

  assert_backend_fails (registry, "wrong_type", MOE_ERROR_PLUGIN_INIT,
                        "Type=MoeTestNoSuchBackend", "registered no such type", NULL);
}

static void
test_not_a_backend (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("not-a-backend", NULL);

  assert_backend_fails (registry, "not_a_backend", MOE_ERROR_PLUGIN_INIT,
                        "MoeTestNotABackend", "not an instantiable MoeExpertsBackend", NULL);
  assert_backend_fails (registry, "abstract", MOE_ERROR_PLUGIN_INIT,
                        "MoeTestAbstractBackend", "not an instantiable MoeExpertsBackend", NULL);
}

static int
init_calls (MoePluginRegistry *registry,
            const char        *name)
{
  MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, name);
  GModule *module = g_module_open (moe_plugin_info_get_module_path (info), G_MODULE_BIND_LOCAL);
  int *calls = NULL;
  int n;

  g_assert_nonnull (module);
  g_assert_true (g_module_symbol (module, "fixture_init_calls", (gpointer *) &calls));
  n = *calls;
  g_module_close (module);
  return n;
}

static void
test_init_fails (void)
{
  g_autoptr(MoePluginRegistry) registry = NULL;

  IN_FRESH_PROCESS ();

  registry = registry_for ("init-fails", NULL);
  assert_backend_fails (registry, "init_fails", MOE_ERROR_PLUGIN_INIT,
                        "init failed", "the fixture has no accelerator to drive", NULL);
  assert_backend_fails (registry, "init_fails_silently", MOE_ERROR_PLUGIN_INIT,
                        "init failed", "no reason given", NULL);
  /* each was tried once, though asked for twice */
  g_assert_cmpint (init_calls (registry, "init_fails"), ==, 1);
  g_assert_cmpint (init_calls (registry, "init_fails_silently"), ==, 1);
}

/* The descriptor names another module than the keyfile's Module=. */
static void
test_module_name_mismatch (void)
{
  g_autoptr(MoePluginRegistry) registry = registry_for ("module-name-mismatch", NULL);

  assert_backend_fails (registry, "name_mismatch", MOE_ERROR_PLUGIN_INIT,
                        "“someone_else”", "Module=name_mismatch", NULL);
}

/* One registry holding every broken case: each fails with its own code,
 * and the good backend still loads afterwards. */
static void
test_failures_leave_registry_usable (void)
{
  static const struct {
    const char *name;
    MoeError    code;
  } broken[] = {
    { "wrong_abi", MOE_ERROR_PLUGIN_ABI },
    { "null_desc", MOE_ERROR_PLUGIN_ABI },
    { "keyfile_abi", MOE_ERROR_PLUGIN_ABI },
    { "missing_symbol", MOE_ERROR_PLUGIN_SYMBOL },
    { "garbage", MOE_ERROR_PLUGIN_LOAD },
    { "missing_module", MOE_ERROR_PLUGIN_LOAD },
    { "survivor", MOE_ERROR_PLUGIN_LOAD },
    { "wrong_type", MOE_ERROR_PLUGIN_INIT },
    { "not_a_backend", MOE_ERROR_PLUGIN_INIT },
    { "abstract", MOE_ERROR_PLUGIN_INIT },
    { "init_fails", MOE_ERROR_PLUGIN_INIT },
    { "name_mismatch", MOE_ERROR_PLUGIN_INIT },
  };
  g_autoptr(MoePluginRegistry) registry =
    registry_for ("malformed", "wrong-abi", "keyfile-abi", "missing-symbol", "unloadable",
                  "missing-module", "wrong-type", "not-a-backend", "init-fails",
                  "module-name-mismatch", "good", NULL);
  g_auto(GStrv) names = moe_plugin_registry_list_backends (registry);
  g_autoptr(GPtrArray) rejected = moe_plugin_registry_dup_rejected (registry);
  g_autoptr(GError) error = NULL;
  MoeExpertsBackend *backend;

  assert_strv_equal (names, (const char *[]) {
    "abstract", "garbage", "good", "init_fails", "init_fails_silently", "keyfile_abi",
    "missing_module", "missing_symbol", "name_mismatch", "newer_minor", "not_a_backend",
    "null_desc", "other_major", "survivor", "wrong_abi", "wrong_type", NULL });
  g_assert_cmpuint (rejected->len, ==, G_N_ELEMENTS (malformed));

  for (guint i = 0; i < G_N_ELEMENTS (broken); i++)
    {
      g_autoptr(GError) local = NULL;
      g_assert_null (moe_plugin_registry_get_backend (registry, broken[i].name, &local));
      g_assert_error (local, MOE_ERROR, (int) broken[i].code);
    }

  backend = moe_plugin_registry_get_backend (registry, "good", &error);
  g_assert_no_error (error);
  g_assert_cmpstr (G_OBJECT_TYPE_NAME (backend), ==, "MoeTestGoodBackend");
  g_assert_true (moe_plugin_info_is_loaded (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND,
                                                                        "good")));
}

/* --- the default registry ----------------------------------------------- */

/* Under meson test (tests/meson.build's test_env): MOE_PLUGIN_PATH lists the
 * build tree's plugin directories and MOE_PLUGIN_SYSTEM_PATH is empty, so
 * exactly the in-tree backends are found. */
static void
test_default_registry (void)
{
  const char *path = g_getenv ("MOE_PLUGIN_PATH");
  const char *system = g_getenv ("MOE_PLUGIN_SYSTEM_PATH");
  g_auto(GStrv) dirs = NULL;
  g_auto(GStrv) names = NULL;
  g_autoptr(GPtrArray) rejected = NULL;
  g_autoptr(GError) error = NULL;
  MoePluginRegistry *registry;

  if (path == NULL || g_strcmp0 (system, "") != 0)
    {
      g_test_skip ("needs meson test's MOE_PLUGIN_PATH and MOE_PLUGIN_SYSTEM_PATH=''");
      return;
    }

  IN_FRESH_PROCESS ();

  registry = moe_plugin_registry_get_default ();
  g_assert_true (moe_plugin_registry_get_default () == registry);
  names = moe_plugin_registry_list_backends (registry);
  assert_strv_equal (names, (const char *[]) { "batched_mm", "deepgemm", "deepgemm_megamoe", "eager",
                                               "grouped_mm", "sonicmoe", NULL });
  /* deepgemm, sonicmoe and deepgemm_megamoe run on the cuda device only */
  {
    g_auto(GStrv) cpu = moe_plugin_registry_list_backends_for_device (registry, "cpu");
    g_auto(GStrv) cuda = moe_plugin_registry_list_backends_for_device (registry, "cuda:0");
    assert_strv_equal (cpu, (const char *[]) { "batched_mm", "eager", "grouped_mm", NULL });
    g_assert_true (g_strv_equal ((const char * const *) cuda, (const char * const *) names));
  }
  rejected = moe_plugin_registry_dup_rejected (registry);
  g_assert_cmpuint (rejected->len, ==, 0);
  /* the build's devices: "cuda" where it was built with CUDA */
  {
    g_auto(GStrv) devices = moe_plugin_registry_list_devices (registry);
    if (HAVE_CUDA_PLUGIN)
      assert_strv_equal (devices, (const char *[]) { "cuda", NULL });
    else
      assert_strv_equal (devices, (const char *[]) { NULL });
  }
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, 6 + HAVE_CUDA_PLUGIN);

  /* every one from a MOE_PLUGIN_PATH directory, none opened yet */
  dirs = g_strsplit (path, G_SEARCHPATH_SEPARATOR_S, -1);
  for (guint i = 0; names[i] != NULL; i++)
    {
      MoePluginInfo *info = moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, names[i]);
      g_autofree char *dir = g_path_get_dirname (moe_plugin_info_get_module_path (info));

      g_assert_true (g_strv_contains ((const char * const *) dirs, dir));
      g_assert_true (g_file_test (moe_plugin_info_get_module_path (info), G_FILE_TEST_IS_REGULAR));
      g_assert_cmpstr (moe_plugin_info_get_module_name (info), ==, names[i]);
      g_assert_false (moe_plugin_info_is_loaded (info));
    }

  g_assert_nonnull (moe_plugin_registry_get_backend (registry, "eager", &error));
  g_assert_no_error (error);
  g_assert_true (moe_plugin_info_is_loaded (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND,
                                                                        "eager")));
}

/* MOE_PLUGIN_PATH is searched first, in order, skipping empty and relative
 * entries (with a warning); a non-empty MOE_PLUGIN_SYSTEM_PATH replaces the
 * installed directory and comes after it. */
static void
test_default_registry_environment (void)
{
  g_autofree char *good = fixture_dir ("good");
  g_autofree char *shadow = fixture_dir ("shadow");
  g_autofree char *wrong_type = fixture_dir ("wrong-type");
  g_autofree char *path = NULL;
  g_autofree char *good_module = NULL;
  g_auto(GStrv) names = NULL;
  MoePluginRegistry *registry;

  IN_FRESH_PROCESS ();

  path = g_strjoin (G_SEARCHPATH_SEPARATOR_S, "", good, "relative/plugins", "", shadow, NULL);
  g_setenv ("MOE_PLUGIN_PATH", path, TRUE);
  g_setenv ("MOE_PLUGIN_SYSTEM_PATH", wrong_type, TRUE);

  expect_warning ("Ignoring relative plugin path “relative/plugins”*");
  registry = moe_plugin_registry_get_default ();
  assert_expected_warnings ();

  names = moe_plugin_registry_list_backends (registry);
  assert_strv_equal (names, (const char *[]) { "good", "wrong_type", NULL });
  good_module = g_build_filename (good, "libmoe-good.so", NULL);
  g_assert_cmpstr (moe_plugin_info_get_module_path (moe_plugin_registry_lookup (registry,
                                                                               MOE_PLUGIN_KIND_EXPERTS_BACKEND,
                                                                               "good")),
                   ==, good_module);
}

int
main (int argc, char **argv)
{
  g_test_init (&argc, &argv, NULL);

  expected_warnings = g_ptr_array_new_with_free_func (g_free);
  g_log_set_writer_func (test_log_writer, NULL, NULL);

  g_test_add_func ("/registry/lazy-loading", test_lazy_loading);
  g_test_add_func ("/registry/info", test_info_getters);
  g_test_add_func ("/registry/forward", test_good_backend_forward);
  g_test_add_func ("/registry/unknown-backend", test_unknown_backend);
  g_test_add_func ("/registry/kinds", test_kinds);
  g_test_add_func ("/registry/first-wins", test_first_wins);
  g_test_add_func ("/registry/add-after-scan", test_add_after_scan);
  g_test_add_func ("/registry/relative-path", test_relative_path);
  g_test_add_func ("/registry/broken/descriptor-abi", test_descriptor_abi);
  g_test_add_func ("/registry/broken/keyfile-abi", test_keyfile_abi);
  g_test_add_func ("/registry/broken/missing-symbol", test_missing_symbol);
  g_test_add_func ("/registry/broken/unloadable", test_unloadable);
  g_test_add_func ("/registry/broken/missing-module", test_missing_module);
  g_test_add_func ("/registry/broken/malformed-keyfiles", test_malformed_keyfiles);
  g_test_add_func ("/registry/broken/wrong-type", test_wrong_type);
  g_test_add_func ("/registry/broken/not-a-backend", test_not_a_backend);
  g_test_add_func ("/registry/broken/init-fails", test_init_fails);
  g_test_add_func ("/registry/broken/module-name-mismatch", test_module_name_mismatch);
  g_test_add_func ("/registry/broken/registry-still-usable", test_failures_leave_registry_usable);
  g_test_add_func ("/registry/default/listing", test_default_registry);
  g_test_add_func ("/registry/default/environment", test_default_registry_environment);

  return g_test_run ();
}
