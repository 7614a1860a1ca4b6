/* test-jit.c: finding the CUDA toolkit, and the JIT compile cache, against
 * fake toolkits whose nvcc is a shell script (no GPU or CUDA needed)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <unistd.h>
#include <glib/gstdio.h>
#include <libmoe.h>
#include <moe-plugin.h>

/* The fake nvcc writes "fake cubin:<args but -o FILE and the .cu>\n" and
 * then the source to the -o file, and appends its args to the counter file.
 * MOE_TEST_NVCC_SLEEP keeps it running a while. */
static const char fake_nvcc[] =
  "#!/bin/sh\n"
  "out=\n"
  "src=\n"
  "args=\n"
  "while [ $# -gt 0 ]; do\n"
  "  case $1 in\n"
  "    -o) out=$2; shift ;;\n"
  "    *.cu) src=$1 ;;\n"
  "    *) args=\"$args $1\" ;;\n"
  "  esac\n"
  "  shift\n"
  "done\n"
  "if [ -n \"$MOE_TEST_NVCC_COUNTER\" ]; then echo \"$args\" >> \"$MOE_TEST_NVCC_COUNTER\"; fi\n"
  "if [ -n \"$MOE_TEST_NVCC_SLEEP\" ]; then sleep \"$MOE_TEST_NVCC_SLEEP\"; fi\n"
  "{ printf 'fake cubin:%s\\n' \"$args\"; cat \"$src\"; } > \"$out\"\n";

/* ~5 KB on stdout, then the error on stderr */
static const char failing_nvcc[] =
  "#!/bin/sh\n"
  "i=0\n"
  "while [ $i -lt 100 ]; do\n"
  "  echo 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'\n"
  "  i=$((i+1))\n"
  "done\n"
  "echo 'error: boom' >&2\n"
  "exit 3\n";

typedef enum {
  NVCC_NONE,
  NVCC_FAKE,
  NVCC_FAILING,
} NvccKind;

typedef enum {
  VERSION_NONE,
  VERSION_JSON_NVCC,   /* cuda_nvcc is @version, cuda is 99.9.0 */
  VERSION_JSON_CUDA,   /* only cuda */
  VERSION_JSON_BAD,    /* not JSON */
  VERSION_TXT,
  VERSION_HEADER,
} VersionKind;

static const char * const saved_vars[] = {
  "CUDA_HOME", "CUDA_PATH", "PATH", "MOE_JIT_CACHE_DIR", "MOE_JIT_DEBUG",
  "MOE_TEST_NVCC_COUNTER", "MOE_TEST_NVCC_SLEEP",
};

typedef struct
{
  char *root;
  char *cache;
  char *counter;
  char *saved[G_N_ELEMENTS (saved_vars)];
} Fixture;

static const char source[] =
  "extern \"C\" __global__ void k (float *x) { x[threadIdx.x] *= 2.0f; }\n";
static const char * const args_a[] = { "-std=c++17", "-O3", "-DMOE_N=4096", NULL };
static const char * const args_b[] = { "-std=c++17", "-O3", "-DMOE_N=8192", NULL };

static void
restore_env (Fixture *f)
{
  for (guint i = 0; i < G_N_ELEMENTS (saved_vars); i++)
    if (f->saved[i] != NULL)
      g_setenv (saved_vars[i], f->saved[i], TRUE);
    else
      g_unsetenv (saved_vars[i]);
}

static void
fixture_setup (Fixture       *f,
               gconstpointer  data)
{
  g_autoptr(GError) error = NULL;

  for (guint i = 0; i < G_N_ELEMENTS (saved_vars); i++)
    f->saved[i] = g_strdup (g_getenv (saved_vars[i]));
  f->root = g_dir_make_tmp ("test-jit-XXXXXX", &error);
  g_assert_no_error (error);
  f->cache = g_build_filename (f->root, "cache", NULL);
  f->counter = g_build_filename (f->root, "counter", NULL);
  g_unsetenv ("CUDA_HOME");
  g_unsetenv ("CUDA_PATH");
  g_unsetenv ("MOE_JIT_DEBUG");
  g_unsetenv ("MOE_TEST_NVCC_SLEEP");
  g_setenv ("MOE_JIT_CACHE_DIR", f->cache, TRUE);
  g_setenv ("MOE_TEST_NVCC_COUNTER", f->counter, TRUE);
}

static void
remove_dir (const char *path)
{
  const char *argv[] = { "rm", "-rf", path, NULL };
  g_autoptr(GError) error = NULL;
  int status;

  g_spawn_sync (NULL, (char **) argv, NULL, G_SPAWN_SEARCH_PATH, NULL, NULL,
                NULL, NULL, &status, &error);
  g_assert_no_error (error);
  g_assert_false (g_file_test (path, G_FILE_TEST_EXISTS));
}

static void
fixture_teardown (Fixture       *f,
                  gconstpointer  data)
{
  restore_env (f);
  remove_dir (f->root);
  for (guint i = 0; i < G_N_ELEMENTS (saved_vars); i++)
    g_free (f->saved[i]);
  g_free (f->root);
  g_free (f->cache);
  g_free (f->counter);
}

static void
write_file (const char *path,
            const char *contents,
            int         mode)
{
  g_autofree char *dir = g_path_get_dirname (path);
  g_autoptr(GError) error = NULL;

  g_assert_cmpint (g_mkdir_with_parents (dir, 0755), ==, 0);
  g_file_set_contents_full (path, contents, -1, G_FILE_SET_CONTENTS_NONE, mode, &error);
  g_assert_no_error (error);
}

/* A fake toolkit at root/name; @version is "MAJOR.MINOR[.PATCH]". */
static char *
make_toolkit (Fixture     *f,
              const char  *name,
              NvccKind     nvcc,
              VersionKind  kind,
              const char  *version)
{
  char *home = g_build_filename (f->root, name, NULL);
  g_autofree char *nvcc_path = g_build_filename (home, "bin", "nvcc", NULL);
  g_autofree char *json = g_build_filename (home, "version.json", NULL);
  g_autofree char *txt = g_build_filename (home, "version.txt", NULL);
  g_autofree char *header = g_build_filename (home, "include", "cuda.h", NULL);
  g_autofree char *text = NULL;
  guint major = 0, minor = 0;

  g_assert_cmpint (g_mkdir_with_parents (home, 0755), ==, 0);
  if (nvcc != NVCC_NONE)
    write_file (nvcc_path, nvcc == NVCC_FAKE ? fake_nvcc : failing_nvcc, 0755);
  switch (kind)
    {
    case VERSION_NONE:
      break;
    case VERSION_JSON_NVCC:
      text = g_strdup_printf ("{\n  \"cuda\": {\"name\": \"CUDA SDK\", \"version\": \"99.9.0\"},\n"
                              "  \"cuda_nvcc\": {\"name\": \"CUDA NVCC\", \"version\": \"%s\"}\n}\n",
                              version);
      write_file (json, text, 0644);
      break;
    case VERSION_JSON_CUDA:
      text = g_strdup_printf ("{\"cuda\": {\"name\": \"CUDA SDK\", \"version\": \"%s\"}}", version);
      write_file (json, text, 0644);
      break;
    case VERSION_JSON_BAD:
      write_file (json, "{\"cuda_nvcc\": ", 0644);
      break;
    case VERSION_TXT:
      text = g_strdup_printf ("CUDA Version %s\n", version);
      write_file (txt, text, 0644);
      break;
    case VERSION_HEADER:
      g_assert_cmpint (sscanf (version, "%u.%u", &major, &minor), ==, 2);
      text = g_strdup_printf ("#ifndef __cuda_cuda_h__\n"
                              "#define CUDA_VERSION_DECOY 99000\n"
                              "#  define   CUDA_VERSION   %u\n#endif\n",
                              major * 1000 + minor * 10);
      write_file (header, text, 0644);
      break;
    }
  return home;
}

static guint
nvcc_runs (Fixture *f)
{
  g_autofree char *text = NULL;
  guint n = 0;

  if (!g_file_get_contents (f->counter, &text, NULL, NULL))
    return 0;
  for (const char *p = text; *p; p++)
    n += *p == '\n';
  return n;
}

/* The cache directory's names; each must be an entry (no leftovers). */
static guint
cache_entries (const char  *dir,
               char       **first)
{
  g_autoptr(GDir) d = g_dir_open (dir, 0, NULL);
  const char *name;
  guint n = 0;

  while (d != NULL && (name = g_dir_read_name (d)) != NULL)
    {
      g_assert_cmpuint (strlen (name), ==, 64);
      for (const char *p = name; *p; p++)
        g_assert_true (g_ascii_isxdigit (*p) && !g_ascii_isupper (*p));
      if (first != NULL && n == 0)
        *first = g_build_filename (dir, name, NULL);
      n++;
    }
  return n;
}

static void
find_with_home (const char     *home,
                MoeCudaToolkit *tk)
{
  g_autoptr(GError) error = NULL;

  g_setenv ("CUDA_HOME", home, TRUE);
  g_assert_true (moe_cuda_toolkit_find (tk, &error));
  g_assert_no_error (error);
}

/* a fake toolkit at root/@name (CUDA 12.4), found through CUDA_HOME */
static void
find_fake (Fixture        *f,
           const char     *name,
           NvccKind        nvcc,
           MoeCudaToolkit *tk)
{
  g_autofree char *home = make_toolkit (f, name, nvcc, VERSION_TXT, "12.4.131");

  find_with_home (home, tk);
}

static void
assert_bytes (GBytes     *bytes,
              const char *args,
              const char *src)
{
  g_autofree char *expected = g_strdup_printf ("fake cubin:%s -cubin\n%s", args, src);
  gsize len;
  const char *data = g_bytes_get_data (bytes, &len);

  g_assert_cmpmem (data, len, expected, strlen (expected));
}

static GBytes *
compile_ok (const MoeCudaToolkit *tk,
            const char           *src,
            const char * const   *args)
{
  g_autoptr(GError) error = NULL;
  GBytes *bytes = moe_cuda_jit_compile (tk, src, args, &error);

  g_assert_no_error (error);
  g_assert_nonnull (bytes);
  return bytes;
}

/* --- lookup -------------------------------------------------------------- */

static void
test_find_precedence (Fixture       *f,
                      gconstpointer  data)
{
  g_autofree char *a = make_toolkit (f, "a", NVCC_FAKE, VERSION_JSON_NVCC, "12.4.131");
  g_autofree char *b = make_toolkit (f, "b", NVCC_FAKE, VERSION_TXT, "12.2.140");
  g_autofree char *c = make_toolkit (f, "c", NVCC_FAKE, VERSION_HEADER, "12.3");
  g_autofree char *a_nvcc = g_build_filename (a, "bin", "nvcc", NULL);
  g_autofree char *c_bin = g_build_filename (c, "bin", NULL);
  g_autofree char *path = g_strconcat (c_bin, G_SEARCHPATH_SEPARATOR_S, f->saved[2], NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GError) error = NULL;

  g_setenv ("PATH", path, TRUE);
  g_setenv ("CUDA_PATH", b, TRUE);
  g_setenv ("CUDA_HOME", a, TRUE);

  g_assert_true (moe_cuda_toolkit_find (&tk, &error));
  g_assert_no_error (error);
  g_assert_cmpstr (tk.home, ==, a);
  g_assert_cmpstr (tk.nvcc, ==, a_nvcc);
  g_assert_cmpuint (tk.major, ==, 12);
  g_assert_cmpuint (tk.minor, ==, 4);
  moe_cuda_toolkit_clear (&tk);
  g_assert_null (tk.home);

  /* an empty CUDA_HOME counts as unset, as in transformers */
  g_setenv ("CUDA_HOME", "", TRUE);
  g_assert_true (moe_cuda_toolkit_find (&tk, &error));
  g_assert_cmpstr (tk.home, ==, b);
  g_assert_cmpuint (tk.minor, ==, 2);
  moe_cuda_toolkit_clear (&tk);

  g_unsetenv ("CUDA_HOME");
  g_assert_true (moe_cuda_toolkit_find (&tk, &error));
  g_assert_cmpstr (tk.home, ==, b);
  moe_cuda_toolkit_clear (&tk);

  g_unsetenv ("CUDA_PATH");
  g_assert_true (moe_cuda_toolkit_find (&tk, &error));
  g_assert_no_error (error);
  g_assert_cmpstr (tk.home, ==, c);
  g_assert_cmpuint (tk.major, ==, 12);
  g_assert_cmpuint (tk.minor, ==, 3);
}

/* nvcc on PATH gives dirname(dirname(its path)), without resolving links:
 * a link's directory has no version files, so the error names it. */
static void
test_find_path_symlink (Fixture       *f,
                        gconstpointer  data)
{
  g_autofree char *c = make_toolkit (f, "c", NVCC_FAKE, VERSION_TXT, "12.8.1");
  g_autofree char *c_nvcc = g_build_filename (c, "bin", "nvcc", NULL);
  g_autofree char *links = g_build_filename (f->root, "links", NULL);
  g_autofree char *link_bin = g_build_filename (links, "bin", NULL);
  g_autofree char *link = g_build_filename (link_bin, "nvcc", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GError) error = NULL;

  g_assert_cmpint (g_mkdir_with_parents (link_bin, 0755), ==, 0);
  g_assert_cmpint (symlink (c_nvcc, link), ==, 0);
  g_setenv ("PATH", link_bin, TRUE);

  g_assert_false (moe_cuda_toolkit_find (&tk, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_test_message ("%s", error->message);
  g_assert_nonnull (strstr (error->message, links));
  g_assert_nonnull (strstr (error->message, "version.txt"));
  g_assert_null (tk.home);
  g_assert_null (tk.nvcc);
}

static void
test_find_home_missing (Fixture       *f,
                        gconstpointer  data)
{
  g_autofree char *b = make_toolkit (f, "b", NVCC_FAKE, VERSION_TXT, "12.2.140");
  g_autofree char *nope = g_build_filename (f->root, "nope", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GError) error = NULL;

  /* a named home that does not exist is an error, not a fall-through */
  g_setenv ("CUDA_HOME", nope, TRUE);
  g_setenv ("CUDA_PATH", b, TRUE);
  g_assert_false (moe_cuda_toolkit_find (&tk, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_test_message ("%s", error->message);
  g_assert_nonnull (strstr (error->message, "CUDA_HOME"));
  g_assert_nonnull (strstr (error->message, nope));
  g_assert_nonnull (strstr (error->message, "bin/nvcc"));
  g_clear_error (&error);

  g_unsetenv ("CUDA_HOME");
  g_setenv ("CUDA_PATH", nope, TRUE);
  g_assert_false (moe_cuda_toolkit_find (&tk, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_assert_nonnull (strstr (error->message, "CUDA_PATH"));
}

static void
test_find_default (Fixture       *f,
                   gconstpointer  data)
{
  g_autofree char *empty = g_build_filename (f->root, "empty", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GError) error = NULL;

  g_assert_cmpint (g_mkdir_with_parents (empty, 0755), ==, 0);
  g_setenv ("PATH", empty, TRUE);
  if (g_file_test ("/usr/local/cuda", G_FILE_TEST_IS_DIR))
    {
      /* this machine has one: it is the home, usable or not */
      if (moe_cuda_toolkit_find (&tk, &error))
        g_assert_cmpstr (tk.home, ==, "/usr/local/cuda");
      else
        {
          g_test_message ("%s", error->message);
          g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
          g_assert_nonnull (strstr (error->message, "/usr/local/cuda "));
        }
      return;
    }
  g_assert_false (moe_cuda_toolkit_find (&tk, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_test_message ("%s", error->message);
  g_assert_nonnull (strstr (error->message, "full CUDA toolkit with nvcc"));
  g_assert_nonnull (strstr (error->message, "CUDA_HOME"));
  g_assert_nonnull (strstr (error->message, "CUDA_PATH"));
  g_assert_nonnull (strstr (error->message, "nvcc on PATH"));
  g_assert_nonnull (strstr (error->message, "/usr/local/cuda"));
}

static void
test_find_runtime_only (Fixture       *f,
                        gconstpointer  data)
{
  g_autofree char *rt = make_toolkit (f, "rt", NVCC_NONE, VERSION_JSON_NVCC, "12.4.131");
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GError) error = NULL;

  g_setenv ("CUDA_HOME", rt, TRUE);
  g_assert_false (moe_cuda_toolkit_find (&tk, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_test_message ("%s", error->message);
  g_assert_nonnull (strstr (error->message, "runtime-only"));
  g_assert_nonnull (strstr (error->message, rt));
  g_assert_nonnull (strstr (error->message, "bin/nvcc"));
  g_assert_null (tk.home);
}

/* --- version ------------------------------------------------------------- */

typedef struct
{
  VersionKind  kind;
  const char  *version;
  guint        major, minor;
} VersionCase;

static const VersionCase version_cases[] = {
  { VERSION_JSON_NVCC, "12.4.131", 12, 4 },
  { VERSION_JSON_CUDA, "12.6.2", 12, 6 },
  { VERSION_TXT, "12.2.140", 12, 2 },
  { VERSION_HEADER, "12.3", 12, 3 },
  { VERSION_HEADER, "13.0", 13, 0 },
};

static void
test_version (Fixture       *f,
              gconstpointer  data)
{
  const VersionCase *c = data;
  g_autofree char *home = make_toolkit (f, "tk", NVCC_FAKE, c->kind, c->version);
  g_auto(MoeCudaToolkit) tk = { 0, };

  find_with_home (home, &tk);
  g_assert_cmpuint (tk.major, ==, c->major);
  g_assert_cmpuint (tk.minor, ==, c->minor);
}

/* an unreadable version.json is passed over for the next file */
static void
test_version_fallthrough (Fixture       *f,
                          gconstpointer  data)
{
  g_autofree char *home = make_toolkit (f, "tk", NVCC_FAKE, VERSION_JSON_BAD, NULL);
  g_autofree char *txt = g_build_filename (home, "version.txt", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };

  write_file (txt, "CUDA Version 11.8.89\n", 0644);
  find_with_home (home, &tk);
  g_assert_cmpuint (tk.major, ==, 11);
  g_assert_cmpuint (tk.minor, ==, 8);
}

static void
test_version_none (Fixture       *f,
                   gconstpointer  data)
{
  g_autofree char *home = make_toolkit (f, "tk", NVCC_FAKE, VERSION_JSON_BAD, NULL);
  g_autofree char *txt = g_build_filename (home, "version.txt", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GError) error = NULL;

  write_file (txt, "Cuda compilation tools\n", 0644);
  g_setenv ("CUDA_HOME", home, TRUE);
  g_assert_false (moe_cuda_toolkit_find (&tk, &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_test_message ("%s", error->message);
  g_assert_nonnull (strstr (error->message, "version.json: not JSON"));
  g_assert_nonnull (strstr (error->message, "version.txt: no “CUDA Version"));
  g_assert_nonnull (strstr (error->message, "cuda.h: missing"));
  g_assert_nonnull (strstr (error->message, "from CUDA_HOME"));
  g_assert_null (tk.home);
  g_assert_null (tk.nvcc);
  g_assert_cmpuint (tk.major, ==, 0);
}

static void
test_require (void)
{
  MoeCudaToolkit tk = { (char *) "/opt/cuda-12.1", (char *) "/opt/cuda-12.1/bin/nvcc", 12, 1 };
  g_autoptr(GError) error = NULL;

  g_assert_false (moe_cuda_toolkit_require (&tk, 12, 3, "deepgemm on SM90", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_assert_cmpstr (error->message, ==, "deepgemm on SM90 needs CUDA toolkit ≥ 12.3; /opt/cuda-12.1 is 12.1");
  g_clear_error (&error);
  g_assert_false (moe_cuda_toolkit_require (&tk, 13, 0, "x", &error));
  g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED);
  g_clear_error (&error);

  g_assert_true (moe_cuda_toolkit_require (&tk, 12, 1, "x", &error));
  g_assert_true (moe_cuda_toolkit_require (&tk, 12, 0, "x", &error));
  g_assert_true (moe_cuda_toolkit_require (&tk, 11, 8, "x", &error));
  tk.minor = 10;
  g_assert_true (moe_cuda_toolkit_require (&tk, 12, 3, "x", &error));
  tk.major = 13;
  tk.minor = 0;
  g_assert_true (moe_cuda_toolkit_require (&tk, 12, 9, "x", &error));
  g_assert_no_error (error);
}

/* --- compile ------------------------------------------------------------- */

static void
test_compile_cache (Fixture       *f,
                    gconstpointer  data)
{
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GBytes) first = NULL, second = NULL;
  g_autofree char *entry = NULL, *contents = NULL;
  gsize len;

  find_fake (f, "tk", NVCC_FAKE, &tk);
  first = compile_ok (&tk, source, args_a);
  assert_bytes (first, " -std=c++17 -O3 -DMOE_N=4096", source);
  g_assert_cmpuint (nvcc_runs (f), ==, 1);

  second = compile_ok (&tk, source, args_a);
  g_assert_cmpuint (nvcc_runs (f), ==, 1);
  g_assert_true (g_bytes_equal (first, second));

  /* one entry, no temporary directory left: magic, SHA-256, payload */
  g_assert_cmpuint (cache_entries (f->cache, &entry), ==, 1);
  g_assert_true (g_file_get_contents (entry, &contents, &len, NULL));
  g_assert_cmpuint (len, ==, 40 + g_bytes_get_size (first));
  g_assert_cmpmem (contents, 8, "MOEJIT1\n", 8);
  g_assert_cmpmem (contents + 40, len - 40, g_bytes_get_data (first, NULL), g_bytes_get_size (first));
}

static void
test_compile_keys (Fixture       *f,
                   gconstpointer  data)
{
  g_autofree char *other = g_strconcat (source, "// other\n", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_auto(MoeCudaToolkit) tk2 = { 0, };
  g_autoptr(GBytes) a = NULL, b = NULL, c = NULL, d = NULL, e = NULL, g = NULL;

  find_fake (f, "tk", NVCC_FAKE, &tk);
  find_fake (f, "tk2", NVCC_FAKE, &tk2);
  a = compile_ok (&tk, source, args_a);
  b = compile_ok (&tk, source, args_b);
  g_assert_cmpuint (nvcc_runs (f), ==, 2);
  assert_bytes (b, " -std=c++17 -O3 -DMOE_N=8192", source);
  g_assert_false (g_bytes_equal (a, b));

  c = compile_ok (&tk, other, args_a);
  assert_bytes (c, " -std=c++17 -O3 -DMOE_N=4096", other);
  d = compile_ok (&tk, source, NULL);
  assert_bytes (d, "", source);
  /* another nvcc, then another version of the same one */
  e = compile_ok (&tk2, source, args_a);
  tk2.minor = 5;
  g = compile_ok (&tk2, source, args_a);
  g_assert_cmpuint (nvcc_runs (f), ==, 6);
  g_assert_cmpuint (cache_entries (f->cache, NULL), ==, 6);
}

static void
corrupt_and_recompile (Fixture              *f,
                       const MoeCudaToolkit *tk,
                       guint                 runs,
                       gsize                 truncate_to,
                       gssize                flip)
{
  g_autofree char *entry = NULL, *contents = NULL;
  g_autoptr(GBytes) bytes = NULL;
  g_autoptr(GError) error = NULL;
  gsize len;

  g_assert_cmpuint (cache_entries (f->cache, &entry), ==, 1);
  g_assert_true (g_file_get_contents (entry, &contents, &len, NULL));
  if (flip >= 0)
    contents[flip] ^= 0x01;
  g_file_set_contents (entry, contents, MIN (len, truncate_to), &error);
  g_assert_no_error (error);

  bytes = compile_ok (tk, source, args_a);
  assert_bytes (bytes, " -std=c++17 -O3 -DMOE_N=4096", source);
  g_assert_cmpuint (nvcc_runs (f), ==, runs);
  g_assert_cmpuint (cache_entries (f->cache, NULL), ==, 1);
}

static void
test_compile_corrupt (Fixture       *f,
                      gconstpointer  data)
{
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GBytes) first = NULL, hit = NULL;
  gsize payload;

  find_fake (f, "tk", NVCC_FAKE, &tk);
  first = compile_ok (&tk, source, args_a);
  payload = g_bytes_get_size (first);
  g_assert_cmpuint (nvcc_runs (f), ==, 1);

  corrupt_and_recompile (f, &tk, 2, G_MAXSIZE, 40 + payload - 1);  /* a payload byte */
  corrupt_and_recompile (f, &tk, 3, G_MAXSIZE, 45);                /* another */
  corrupt_and_recompile (f, &tk, 4, G_MAXSIZE, 8);                 /* the checksum */
  corrupt_and_recompile (f, &tk, 5, G_MAXSIZE, 0);                 /* the magic */
  corrupt_and_recompile (f, &tk, 6, 20, -1);                       /* in the header */
  corrupt_and_recompile (f, &tk, 7, 40 + payload / 2, -1);         /* in the payload */
  corrupt_and_recompile (f, &tk, 8, 0, -1);                        /* empty */

  hit = compile_ok (&tk, source, args_a);
  g_assert_true (g_bytes_equal (first, hit));
  g_assert_cmpuint (nvcc_runs (f), ==, 8);
}

static void
test_compile_fails (Fixture       *f,
                    gconstpointer  data)
{
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GBytes) bytes = NULL;
  g_autoptr(GError) error = NULL;

  find_fake (f, "bad", NVCC_FAILING, &tk);
  bytes = moe_cuda_jit_compile (&tk, source, args_a, &error);
  g_assert_null (bytes);
  g_assert_error (error, MOE_ERROR, MOE_ERROR_FAILED);
  g_test_message ("%s", error->message);
  g_assert_nonnull (strstr (error->message, "exit status 3"));
  g_assert_nonnull (strstr (error->message, tk.nvcc));
  g_assert_true (g_str_has_suffix (error->message, "error: boom"));
  /* the end of the output only */
  g_assert_cmpuint (strlen (error->message), <, 2400);
  g_assert_nonnull (strstr (error->message, "…xxx"));
  g_assert_cmpuint (cache_entries (f->cache, NULL), ==, 0);
}

/* a cache directory that cannot be created only costs the cache */
static void
test_compile_no_cache (Fixture       *f,
                       gconstpointer  data)
{
  g_autofree char *file = g_build_filename (f->root, "file", NULL);
  g_autofree char *cache = g_build_filename (file, "cache", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GBytes) a = NULL, b = NULL;

  write_file (file, "not a directory", 0644);
  g_setenv ("MOE_JIT_CACHE_DIR", cache, TRUE);
  find_fake (f, "tk", NVCC_FAKE, &tk);
  a = compile_ok (&tk, source, args_a);
  b = compile_ok (&tk, source, args_a);
  assert_bytes (a, " -std=c++17 -O3 -DMOE_N=4096", source);
  g_assert_true (g_bytes_equal (a, b));
  g_assert_cmpuint (nvcc_runs (f), ==, 2);
}

/* without MOE_JIT_CACHE_DIR: libmoe/jit in the user's cache directory
 * (main() points XDG_CACHE_HOME at a temporary directory) */
static void
test_compile_default_dir (Fixture       *f,
                          gconstpointer  data)
{
  g_autofree char *dir = g_build_filename (g_get_user_cache_dir (), "libmoe", "jit", NULL);
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GBytes) a = NULL, b = NULL;

  g_assert_cmpstr (g_get_user_cache_dir (), ==, g_getenv ("XDG_CACHE_HOME"));
  g_unsetenv ("MOE_JIT_CACHE_DIR");
  find_fake (f, "tk", NVCC_FAKE, &tk);
  a = compile_ok (&tk, source, args_a);
  b = compile_ok (&tk, source, args_a);
  g_assert_cmpuint (nvcc_runs (f), ==, 1);
  g_assert_cmpuint (cache_entries (dir, NULL), ==, 1);
}

static void
test_compile_debug (Fixture       *f,
                    gconstpointer  data)
{
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GBytes) a = NULL;

  /* structured logging: g_test_expect_message() does not see it */
  if (g_test_subprocess ())
    {
      find_fake (f, "tk", NVCC_FAKE, &tk);
      g_setenv ("MOE_JIT_DEBUG", "1", TRUE);
      a = compile_ok (&tk, source, args_a);
      g_unsetenv ("MOE_JIT_DEBUG");
      g_bytes_unref (a);
      a = compile_ok (&tk, source, args_b);
      return;
    }
  g_test_trap_subprocess (NULL, 0, G_TEST_SUBPROCESS_DEFAULT);
  g_test_trap_assert_passed ();
  g_test_trap_assert_stderr ("*JIT: /*/bin/nvcc -std=c++17 -O3 -DMOE_N=4096 -cubin -o /*/kernel.cubin /*/kernel.cu\n*");
  g_test_trap_assert_stderr_unmatched ("*MOE_N=8192*");
}

typedef struct
{
  const MoeCudaToolkit *tk;
  GMutex               *lock;
  GCond                *cond;
  gboolean             *go;
  GBytes               *bytes;
  GError               *error;
} Job;

static gpointer
compile_thread (gpointer data)
{
  Job *job = data;

  g_mutex_lock (job->lock);
  while (!*job->go)
    g_cond_wait (job->cond, job->lock);
  g_mutex_unlock (job->lock);
  job->bytes = moe_cuda_jit_compile (job->tk, source, args_a, &job->error);
  return NULL;
}

static void
test_compile_threads (Fixture       *f,
                      gconstpointer  data)
{
  g_auto(MoeCudaToolkit) tk = { 0, };
  GMutex lock;
  GCond cond;
  gboolean go = FALSE;
  Job jobs[4];
  GThread *threads[4];

  /* in a child, so that the tests' setenv() never follows threads */
  if (!g_test_subprocess ())
    {
      g_test_trap_subprocess (NULL, 0, G_TEST_SUBPROCESS_INHERIT_STDERR);
      g_test_trap_assert_passed ();
      return;
    }
  find_fake (f, "tk", NVCC_FAKE, &tk);
  /* nvcc runs long enough for every thread to miss the cache */
  g_setenv ("MOE_TEST_NVCC_SLEEP", "0.5", TRUE);
  g_mutex_init (&lock);
  g_cond_init (&cond);
  for (guint i = 0; i < G_N_ELEMENTS (jobs); i++)
    {
      jobs[i] = (Job) { &tk, &lock, &cond, &go, NULL, NULL };
      threads[i] = g_thread_new ("jit", compile_thread, &jobs[i]);
    }
  g_mutex_lock (&lock);
  go = TRUE;
  g_cond_broadcast (&cond);
  g_mutex_unlock (&lock);
  for (guint i = 0; i < G_N_ELEMENTS (jobs); i++)
    g_thread_join (threads[i]);

  for (guint i = 0; i < G_N_ELEMENTS (jobs); i++)
    {
      g_assert_no_error (jobs[i].error);
      assert_bytes (jobs[i].bytes, " -std=c++17 -O3 -DMOE_N=4096", source);
      g_assert_true (g_bytes_equal (jobs[i].bytes, jobs[0].bytes));
    }
  for (guint i = 0; i < G_N_ELEMENTS (jobs); i++)
    g_bytes_unref (jobs[i].bytes);
  g_assert_cmpuint (nvcc_runs (f), ==, 1);
  g_assert_cmpuint (cache_entries (f->cache, NULL), ==, 1);
  g_mutex_clear (&lock);
  g_cond_clear (&cond);
}

/* The machine's own toolkit, when it has one: the argv nvcc really takes. */
static void
test_compile_real (Fixture       *f,
                   gconstpointer  data)
{
  static const char * const args[] = {
    "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DMOE_N=4096", NULL,
  };
  const char *preload = g_getenv ("LD_PRELOAD");
  g_auto(MoeCudaToolkit) tk = { 0, };
  g_autoptr(GBytes) a = NULL, b = NULL;
  g_autoptr(GError) error = NULL;
  const guint8 *elf;
  gsize len;

  if (preload != NULL && strstr (preload, "vgpreload") != NULL)
    {
      g_test_skip ("nvcc is too slow under valgrind");
      return;
    }
  restore_env (f);
  g_setenv ("MOE_JIT_CACHE_DIR", f->cache, TRUE);
  if (!moe_cuda_toolkit_find (&tk, &error)
      || !moe_cuda_toolkit_require (&tk, 12, 0, "sm_90a", &error))
    {
      g_test_skip (error->message);
      return;
    }
  a = compile_ok (&tk, source, args);
  elf = g_bytes_get_data (a, &len);
  g_assert_cmpuint (len, >, 4);
  g_assert_cmpmem (elf, 4, "\177ELF", 4);
  b = compile_ok (&tk, source, args);
  g_assert_true (g_bytes_equal (a, b));
  g_assert_cmpuint (cache_entries (f->cache, NULL), ==, 1);
}

int
main (int   argc,
      char *argv[])
{
  g_autoptr(GError) error = NULL;
  g_autofree char *cache_home = g_dir_make_tmp ("test-jit-cache-XXXXXX", &error);
  int status;

  g_assert_no_error (error);
  g_setenv ("XDG_CACHE_HOME", cache_home, TRUE);
  g_test_init (&argc, &argv, NULL);

#define ADD(path, func) \
  g_test_add (path, Fixture, NULL, fixture_setup, func, fixture_teardown)
  ADD ("/jit/find/precedence", test_find_precedence);
  ADD ("/jit/find/path-symlink", test_find_path_symlink);
  ADD ("/jit/find/home-missing", test_find_home_missing);
  ADD ("/jit/find/default", test_find_default);
  ADD ("/jit/find/runtime-only", test_find_runtime_only);
  for (guint i = 0; i < G_N_ELEMENTS (version_cases); i++)
    {
      static const char * const names[] = { "none", "json-nvcc", "json-cuda", "json-bad", "txt", "header" };
      g_autofree char *path = g_strdup_printf ("/jit/version/%s-%s", names[version_cases[i].kind],
                                               version_cases[i].version);

      g_test_add (path, Fixture, &version_cases[i], fixture_setup, test_version, fixture_teardown);
    }
  ADD ("/jit/version/fallthrough", test_version_fallthrough);
  ADD ("/jit/version/none", test_version_none);
  g_test_add_func ("/jit/require", test_require);
  ADD ("/jit/compile/cache", test_compile_cache);
  ADD ("/jit/compile/keys", test_compile_keys);
  ADD ("/jit/compile/corrupt", test_compile_corrupt);
  ADD ("/jit/compile/fails", test_compile_fails);
  ADD ("/jit/compile/no-cache", test_compile_no_cache);
  ADD ("/jit/compile/default-dir", test_compile_default_dir);
  ADD ("/jit/compile/debug", test_compile_debug);
  ADD ("/jit/compile/threads", test_compile_threads);
  ADD ("/jit/compile/real-nvcc", test_compile_real);
#undef ADD

  status = g_test_run ();
  remove_dir (cache_home);
  return status;
}
