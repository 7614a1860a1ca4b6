/* moe-cuda-jit.c: the CUDA toolkit on the host, and a disk cache of the
 * cubins it compiles just in time
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <glib/gstdio.h>
#include <json-glib/json-glib.h>

#include "moe-private.h"

/* Backends whose kernels are specialised per shape (deepgemm, as in Hugging
 * Face transformers' DeepGEMM path) compile them with the user's CUDA
 * toolkit on the first forward. Nothing here links CUDA: the toolkit is
 * found on disk, its version read from its files, and nvcc run as a
 * program. The cubins are cached on disk under a hash of everything that
 * went into them. */

/* what an entry starts with, then the SHA-256 of the payload, then it */
#define ENTRY_MAGIC     "MOEJIT1\n"
#define ENTRY_MAGIC_LEN 8
#define DIGEST_LEN      32
#define ENTRY_HEADER    (ENTRY_MAGIC_LEN + DIGEST_LEN)

/* characters of an argument that MOE_JIT_DEBUG's command line leaves unquoted */
#define SHELL_SAFE \
  "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-=.,:/@%"

/* how much of a failing nvcc's output its error keeps */
#define OUTPUT_TAIL 2000

#define TOOLKIT_LOOKUP \
  "CUDA_HOME, then CUDA_PATH, then nvcc on PATH, then /usr/local/cuda"

/* Entries some thread of this process is compiling now (hex key), so that
 * the others wait for it instead of running nvcc again. */
static GMutex      jit_lock;
static GCond       jit_cond;
static GHashTable *jit_in_flight;

/**
 * moe_cuda_toolkit_clear: (skip)
 * @toolkit: a toolkit
 *
 * Frees @toolkit's strings and zeroes it; it can be found again.
 */
void
moe_cuda_toolkit_clear (MoeCudaToolkit *toolkit)
{
  g_return_if_fail (toolkit != NULL);

  g_clear_pointer (&toolkit->home, g_free);
  g_clear_pointer (&toolkit->nvcc, g_free);
  toolkit->major = 0;
  toolkit->minor = 0;
}

/* "12.4.131" or "12.4" */
static gboolean
parse_version (const char *text,
               guint      *major,
               guint      *minor)
{
  g_auto(GStrv) parts = g_strsplit (text, ".", 3);
  guint64 ma, mi;

  if (g_strv_length (parts) < 2
      || !g_ascii_string_to_unsigned (parts[0], 10, 1, G_MAXUINT, &ma, NULL)
      || !g_ascii_string_to_unsigned (parts[1], 10, 0, G_MAXUINT, &mi, NULL))
    return FALSE;
  *major = ma;
  *minor = mi;
  return TRUE;
}

/* The file's text, or NULL with *why saying what is wrong with it. */
static char *
read_version_file (const char  *path,
                   char       **why)
{
  g_autoptr(GError) local = NULL;
  char *text = NULL;

  if (g_file_get_contents (path, &text, NULL, &local))
    return text;
  if (g_error_matches (local, G_FILE_ERROR, G_FILE_ERROR_NOENT))
    *why = g_strdup_printf ("%s: missing", path);
  else
    *why = g_strdup (local->message);
  return NULL;
}

/* version.json: {"cuda_nvcc": {"version": "12.4.131"}, "cuda": {…}} */
static gboolean
version_from_json (const char  *path,
                   guint       *major,
                   guint       *minor,
                   char       **why)
{
  static const char * const keys[] = { "cuda_nvcc", "cuda" };
  g_autofree char *text = read_version_file (path, why);
  g_autoptr(JsonParser) parser = NULL;
  g_autoptr(GError) local = NULL;
  JsonNode *root;

  if (text == NULL)
    return FALSE;
  parser = json_parser_new ();
  if (!json_parser_load_from_data (parser, text, -1, &local))
    {
      *why = g_strdup_printf ("%s: not JSON (%s)", path, local->message);
      return FALSE;
    }
  root = json_parser_get_root (parser);
  for (guint i = 0; root != NULL && JSON_NODE_HOLDS_OBJECT (root) && i < G_N_ELEMENTS (keys); i++)
    {
      JsonNode *node = json_object_get_member (json_node_get_object (root), keys[i]);
      JsonNode *version;

      if (node == NULL || !JSON_NODE_HOLDS_OBJECT (node))
        continue;
      version = json_object_get_member (json_node_get_object (node), "version");
      if (version != NULL && JSON_NODE_HOLDS_VALUE (version)
          && json_node_get_value_type (version) == G_TYPE_STRING
          && parse_version (json_node_get_string (version), major, minor))
        return TRUE;
    }
  *why = g_strdup_printf ("%s: no “cuda_nvcc” or “cuda” object with a "
                          "“version” of the form “MAJOR.MINOR[.PATCH]”", path);
  return FALSE;
}

/* A version file read line by line: the first line @parse accepts. */
static gboolean
version_from_lines (const char   *path,
                    gboolean    (*parse) (char *line, guint *major, guint *minor),
                    const char   *expected,
                    guint        *major,
                    guint        *minor,
                    char        **why)
{
  g_autofree char *text = read_version_file (path, why);
  g_auto(GStrv) lines = NULL;

  if (text == NULL)
    return FALSE;
  lines = g_strsplit (text, "\n", -1);
  for (guint i = 0; lines[i] != NULL; i++)
    if (parse (lines[i], major, minor))
      return TRUE;
  *why = g_strdup_printf ("%s: no “%s” line", path, expected);
  return FALSE;
}

/* version.txt: "CUDA Version 12.2.140" */
static gboolean
parse_txt_line (char  *line,
                guint *major,
                guint *minor)
{
  line = g_strstrip (line);
  return g_str_has_prefix (line, "CUDA Version ")
         && parse_version (line + strlen ("CUDA Version "), major, minor);
}

/* cuda.h: "#define CUDA_VERSION 12030" is 12.3 */
static gboolean
parse_header_line (char  *line,
                   guint *major,
                   guint *minor)
{
  char *p = g_strchug (line);
  guint64 v;

  if (*p++ != '#')
    return FALSE;
  p = g_strchug (p);
  if (!g_str_has_prefix (p, "define") || !g_ascii_isspace (p[strlen ("define")]))
    return FALSE;
  p = g_strchug (p + strlen ("define"));
  if (!g_str_has_prefix (p, "CUDA_VERSION") || !g_ascii_isspace (p[strlen ("CUDA_VERSION")]))
    return FALSE;
  p = g_strstrip (p + strlen ("CUDA_VERSION"));
  if (!g_ascii_string_to_unsigned (p, 10, 1000, G_MAXUINT, &v, NULL))
    return FALSE;
  *major = v / 1000;
  *minor = (v % 1000) / 10;
  return TRUE;
}

/* The toolkit's version from its files, without running anything. */
static gboolean
read_toolkit_version (MoeCudaToolkit  *toolkit,
                      const char      *origin,
                      GError         **error)
{
  g_autofree char *json = g_build_filename (toolkit->home, "version.json", NULL);
  g_autofree char *txt = g_build_filename (toolkit->home, "version.txt", NULL);
  g_autofree char *header = g_build_filename (toolkit->home, "include", "cuda.h", NULL);
  g_autofree char *why_json = NULL, *why_txt = NULL, *why_header = NULL;

  if (version_from_json (json, &toolkit->major, &toolkit->minor, &why_json)
      || version_from_lines (txt, parse_txt_line, "CUDA Version MAJOR.MINOR",
                             &toolkit->major, &toolkit->minor, &why_txt)
      || version_from_lines (header, parse_header_line, "#define CUDA_VERSION NNNNN",
                             &toolkit->major, &toolkit->minor, &why_header))
    return TRUE;

  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
               "Cannot tell the version of the CUDA toolkit at %s (%s): "
               "deepgemm needs it from version.json (“cuda_nvcc” or “cuda” "
               "“version”), version.txt (“CUDA Version X.Y”) or "
               "include/cuda.h (“#define CUDA_VERSION”), and tried %s; %s; %s",
               toolkit->home, origin, why_json, why_txt, why_header);
  return FALSE;
}

/**
 * moe_cuda_toolkit_find: (skip)
 * @toolkit: (out caller-allocates): where to put the toolkit
 * @error: return location for a #GError
 *
 * Finds the CUDA toolkit that compiles just-in-time kernels, the way
 * DeepGEMM and transformers do: the first of `CUDA_HOME` (when set and not
 * empty), `CUDA_PATH`, the directory above the `bin/` of the `nvcc` found on
 * `PATH`, and `/usr/local/cuda` (when it exists) is the toolkit's home. A
 * home that is named but does not exist is an error, not a reason to look
 * further. The home must hold `bin/nvcc` (a runtime-only install cannot
 * compile), and the version is read from its `version.json`, `version.txt`
 * or `include/cuda.h`; nvcc is not run.
 *
 * @toolkit is zeroed first, so it can be cleared with
 * [func@cuda_toolkit_clear] whether this succeeds or not.
 *
 * Returns: %FALSE with @error set (%MOE_ERROR_NOT_SUPPORTED) if there is no
 *   usable toolkit
 */
gboolean
moe_cuda_toolkit_find (MoeCudaToolkit  *toolkit,
                       GError         **error)
{
  static const char * const env_vars[] = { "CUDA_HOME", "CUDA_PATH" };
  g_autofree char *home = NULL;
  g_autofree char *origin = NULL;
  g_autofree char *nvcc = NULL;

  g_return_val_if_fail (toolkit != NULL, FALSE);
  g_return_val_if_fail (error == NULL || *error == NULL, FALSE);

  memset (toolkit, 0, sizeof *toolkit);

  for (guint i = 0; home == NULL && i < G_N_ELEMENTS (env_vars); i++)
    {
      const char *value = g_getenv (env_vars[i]);

      if (value == NULL || *value == '\0')
        continue;
      if (!g_file_test (value, G_FILE_TEST_IS_DIR))
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                       "%s is set to “%s”, which is not a directory: deepgemm "
                       "needs %s to name the root directory of a CUDA toolkit "
                       "with nvcc (the directory holding bin/nvcc), or to be unset",
                       env_vars[i], value, env_vars[i]);
          return FALSE;
        }
      home = g_strdup (value);
      origin = g_strdup_printf ("from %s", env_vars[i]);
    }

  if (home == NULL)
    {
      g_autofree char *found = g_find_program_in_path ("nvcc");

      if (found != NULL)
        {
          g_autofree char *bin = g_path_get_dirname (found);

          home = g_path_get_dirname (bin);
          origin = g_strdup_printf ("from nvcc on PATH, %s", found);
        }
    }

  if (home == NULL && g_file_test ("/usr/local/cuda", G_FILE_TEST_IS_DIR))
    {
      home = g_strdup ("/usr/local/cuda");
      origin = g_strdup ("the default location");
    }

  if (home == NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "deepgemm needs a full CUDA toolkit with nvcc to compile "
                   "its kernels, and none was found (looked at " TOOLKIT_LOOKUP
                   "): install one and set CUDA_HOME to its root directory");
      return FALSE;
    }

  nvcc = g_build_filename (home, "bin", "nvcc", NULL);
  if (!g_file_test (nvcc, G_FILE_TEST_IS_REGULAR))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "The CUDA install at %s (%s) has no bin/nvcc: it is a "
                   "runtime-only install, which cannot compile deepgemm's "
                   "kernels; deepgemm needs a full CUDA toolkit with nvcc "
                   "(set CUDA_HOME to its root directory)", home, origin);
      return FALSE;
    }

  toolkit->home = g_steal_pointer (&home);
  toolkit->nvcc = g_steal_pointer (&nvcc);
  if (!read_toolkit_version (toolkit, origin, error))
    {
      moe_cuda_toolkit_clear (toolkit);
      return FALSE;
    }
  return TRUE;
}

/**
 * moe_cuda_toolkit_require: (skip)
 * @toolkit: a toolkit found by [func@cuda_toolkit_find]
 * @major: the oldest CUDA major version that will do
 * @minor: with @major, the oldest minor version
 * @what: what needs it, to start the message, such as "deepgemm on SM90"
 * @error: return location for a #GError
 *
 * Returns: %FALSE with @error set (%MOE_ERROR_NOT_SUPPORTED) if @toolkit is
 *   older than @major.@minor
 */
gboolean
moe_cuda_toolkit_require (const MoeCudaToolkit  *toolkit,
                          guint                  major,
                          guint                  minor,
                          const char            *what,
                          GError               **error)
{
  g_return_val_if_fail (toolkit != NULL && toolkit->home != NULL, FALSE);
  g_return_val_if_fail (what != NULL, FALSE);
  g_return_val_if_fail (error == NULL || *error == NULL, FALSE);

  if (toolkit->major > major || (toolkit->major == major && toolkit->minor >= minor))
    return TRUE;

  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
               "%s needs CUDA toolkit ≥ %u.%u; %s is %u.%u",
               what, major, minor, toolkit->home, toolkit->major, toolkit->minor);
  return FALSE;
}

static void
checksum_add_field (GChecksum  *checksum,
                    const char *text)
{
  guint64 len = GUINT64_TO_LE ((guint64) strlen (text));

  g_checksum_update (checksum, (const guchar *) &len, sizeof len);
  g_checksum_update (checksum, (const guchar *) text, strlen (text));
}

/* The entry's name: everything that goes into the cubin, each field
 * length-prefixed so that no two inputs hash alike. */
static char *
entry_key (const MoeCudaToolkit *toolkit,
           const char           *source,
           const char * const   *nvcc_args)
{
  g_autoptr(GChecksum) checksum = g_checksum_new (G_CHECKSUM_SHA256);
  g_autofree char *version = g_strdup_printf ("%u.%u", toolkit->major, toolkit->minor);
  g_autofree char *n_args = g_strdup_printf ("%u", nvcc_args ? g_strv_length ((char **) nvcc_args) : 0);

  checksum_add_field (checksum, ENTRY_MAGIC);
  checksum_add_field (checksum, toolkit->nvcc);
  checksum_add_field (checksum, version);
  checksum_add_field (checksum, n_args);
  for (guint i = 0; nvcc_args != NULL && nvcc_args[i] != NULL; i++)
    checksum_add_field (checksum, nvcc_args[i]);
  checksum_add_field (checksum, source);
  return g_strdup (g_checksum_get_string (checksum));
}

static void
payload_digest (const guint8 *data,
                gsize         len,
                guint8        digest[DIGEST_LEN])
{
  g_autoptr(GChecksum) checksum = g_checksum_new (G_CHECKSUM_SHA256);
  gsize digest_len = DIGEST_LEN;

  g_checksum_update (checksum, data, len);
  g_checksum_get_digest (checksum, digest, &digest_len);
  g_assert (digest_len == DIGEST_LEN);
}

/* A cached cubin, or NULL on a miss. An entry whose magic or checksum is
 * wrong is removed: it is compiled again, never trusted. */
static GBytes *
load_entry (const char *path)
{
  g_autoptr(GError) local = NULL;
  g_autoptr(GBytes) whole = NULL;
  guint8 digest[DIGEST_LEN];
  char *data;
  gsize len;

  if (!g_file_get_contents (path, &data, &len, &local))
    {
      if (!g_error_matches (local, G_FILE_ERROR, G_FILE_ERROR_NOENT))
        g_debug ("JIT cache: %s", local->message);
      return NULL;
    }
  whole = g_bytes_new_take (data, len);
  if (len >= ENTRY_HEADER && memcmp (data, ENTRY_MAGIC, ENTRY_MAGIC_LEN) == 0)
    {
      payload_digest ((const guint8 *) data + ENTRY_HEADER, len - ENTRY_HEADER, digest);
      if (memcmp (data + ENTRY_MAGIC_LEN, digest, DIGEST_LEN) == 0)
        return g_bytes_new_from_bytes (whole, ENTRY_HEADER, len - ENTRY_HEADER);
    }
  g_debug ("JIT cache: %s is corrupt or truncated (%" G_GSIZE_FORMAT " bytes); "
           "removing it and compiling again", path, len);
  if (g_unlink (path) != 0 && errno != ENOENT)
    g_debug ("JIT cache: cannot remove %s: %s", path, g_strerror (errno));
  return NULL;
}

/* Writes the entry beside the build, then renames it onto its name: a
 * reader sees the whole entry or none, and processes racing to write the
 * same entry write the same bytes. Failing only costs the cache. */
static void
store_entry (const char *work_dir,
             const char *path,
             GBytes     *cubin)
{
  g_autoptr(GByteArray) entry = g_byte_array_new ();
  g_autofree char *tmp = g_build_filename (work_dir, "entry", NULL);
  g_autoptr(GError) local = NULL;
  guint8 digest[DIGEST_LEN];
  gsize len;
  const guint8 *data = g_bytes_get_data (cubin, &len);

  payload_digest (data, len, digest);
  g_byte_array_append (entry, (const guint8 *) ENTRY_MAGIC, ENTRY_MAGIC_LEN);
  g_byte_array_append (entry, digest, DIGEST_LEN);
  g_byte_array_append (entry, data, len);
  if (!g_file_set_contents_full (tmp, (const char *) entry->data, entry->len,
                                 G_FILE_SET_CONTENTS_NONE, 0644, &local))
    g_debug ("JIT cache: %s", local->message);
  else if (g_rename (tmp, path) != 0)
    g_debug ("JIT cache: cannot rename %s to %s: %s", tmp, path, g_strerror (errno));
}

/* rm -r, not following links */
static void
remove_tree (const char *path)
{
  GStatBuf st;

  if (g_lstat (path, &st) == 0 && S_ISDIR (st.st_mode))
    {
      g_autoptr(GDir) dir = g_dir_open (path, 0, NULL);
      const char *name;

      while (dir != NULL && (name = g_dir_read_name (dir)) != NULL)
        {
          g_autofree char *child = g_build_filename (path, name, NULL);

          remove_tree (child);
        }
      if (g_rmdir (path) != 0)
        g_debug ("JIT: cannot remove %s: %s", path, g_strerror (errno));
    }
  else if (g_unlink (path) != 0 && errno != ENOENT)
    g_debug ("JIT: cannot remove %s: %s", path, g_strerror (errno));
}

/* A fresh private directory to compile in: inside the cache, so that the
 * entry is renamed onto its name on one file system, or else (a cache that
 * cannot be written) in the system's temporary directory, and then nothing
 * is cached. */
static char *
make_work_dir (const char  *cache_dir,
               gboolean    *in_cache,
               GError     **error)
{
  g_autoptr(GError) local = NULL;
  char *dir;

  *in_cache = FALSE;
  if (cache_dir != NULL)
    {
      g_autofree char *tmpl = g_build_filename (cache_dir, "tmp-XXXXXX", NULL);

      if (g_mkdtemp (tmpl) != NULL)
        {
          *in_cache = TRUE;
          return g_steal_pointer (&tmpl);
        }
      g_debug ("JIT cache: cannot create a directory in %s (%s); compiling "
               "without the cache", cache_dir, g_strerror (errno));
    }
  dir = g_dir_make_tmp ("libmoe-jit-XXXXXX", &local);
  if (dir == NULL)
    g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                 "Cannot create a directory to compile a JIT kernel in: %s",
                 local->message);
  return dir;
}

/* The last OUTPUT_TAIL bytes of nvcc's output, as valid UTF-8. */
static char *
output_tail (const char *out,
             const char *err)
{
  g_autofree char *all = g_strconcat (out ? out : "", err ? err : "", NULL);
  gsize len = strlen (all);
  const char *start = all;
  g_autofree char *valid = NULL;

  if (len > OUTPUT_TAIL)
    {
      start = all + len - OUTPUT_TAIL;
      while (((guchar) *start & 0xc0) == 0x80)
        start++;
    }
  valid = g_strchomp (g_utf8_make_valid (start, -1));
  if (*valid == '\0')
    return g_strdup ("(no output)");
  return g_strconcat (start == all ? "" : "…", valid, NULL);
}

/* Compiles @source in @work_dir into the cubin. */
static GBytes *
run_nvcc (const MoeCudaToolkit  *toolkit,
          const char            *work_dir,
          const char            *source,
          const char * const    *nvcc_args,
          GError               **error)
{
  g_autofree char *src = g_build_filename (work_dir, "kernel.cu", NULL);
  g_autofree char *out = g_build_filename (work_dir, "kernel.cubin", NULL);
  g_autoptr(GPtrArray) argv = g_ptr_array_new ();
  g_autofree char *std_out = NULL, *std_err = NULL;
  g_autoptr(GError) local = NULL;
  const char *debug = g_getenv ("MOE_JIT_DEBUG");
  char *cubin = NULL;
  gsize len;
  int wait_status;

  if (!g_file_set_contents (src, source, -1, &local))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                   "Cannot write a JIT kernel's source for nvcc: %s", local->message);
      return NULL;
    }

  g_ptr_array_add (argv, toolkit->nvcc);
  for (guint i = 0; nvcc_args != NULL && nvcc_args[i] != NULL; i++)
    g_ptr_array_add (argv, (gpointer) nvcc_args[i]);
  g_ptr_array_add (argv, (gpointer) "-cubin");
  g_ptr_array_add (argv, (gpointer) "-o");
  g_ptr_array_add (argv, out);
  g_ptr_array_add (argv, src);
  g_ptr_array_add (argv, NULL);

  if (debug != NULL && *debug != '\0' && g_strcmp0 (debug, "0") != 0)
    {
      g_autoptr(GString) line = g_string_new (NULL);

      for (guint i = 0; argv->pdata[i] != NULL; i++)
        {
          const char *arg = argv->pdata[i];
          g_autofree char *quoted = NULL;

          /* quoted only where a shell needs it, so that it reads as typed */
          if (*arg == '\0' || arg[strspn (arg, SHELL_SAFE)] != '\0')
            arg = quoted = g_shell_quote (arg);
          g_string_append_printf (line, "%s%s", i ? " " : "", arg);
        }
      g_message ("JIT: %s", line->str);
    }

  if (!g_spawn_sync (work_dir, (char **) argv->pdata, NULL, G_SPAWN_DEFAULT,
                     NULL, NULL, &std_out, &std_err, &wait_status, &local))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                   "Cannot run nvcc (%s) to compile a JIT kernel: %s",
                   toolkit->nvcc, local->message);
      return NULL;
    }
  if (!g_spawn_check_wait_status (wait_status, &local))
    {
      g_autofree char *tail = output_tail (std_out, std_err);

      if (local->domain == G_SPAWN_EXIT_ERROR)
        g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                     "nvcc (%s) failed with exit status %d compiling a JIT "
                     "kernel; its output ends with:\n%s",
                     toolkit->nvcc, local->code, tail);
      else
        g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                     "nvcc (%s) failed compiling a JIT kernel (%s); its output "
                     "ends with:\n%s", toolkit->nvcc, local->message, tail);
      return NULL;
    }
  if (!g_file_get_contents (out, &cubin, &len, NULL) || len == 0)
    {
      g_free (cubin);
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                   "nvcc (%s) exited successfully but wrote no cubin to %s; "
                   "a JIT kernel needs nvcc to honour “-cubin -o FILE”",
                   toolkit->nvcc, out);
      return NULL;
    }
  return g_bytes_new_take (cubin, len);
}

/* The miss path: compile, and cache the result when the cache is usable. */
static GBytes *
compile_entry (const MoeCudaToolkit  *toolkit,
               const char            *source,
               const char * const    *nvcc_args,
               const char            *cache_dir,
               const char            *entry,
               GError               **error)
{
  g_autofree char *work_dir = NULL;
  gboolean in_cache;
  GBytes *cubin;

  work_dir = make_work_dir (cache_dir, &in_cache, error);
  if (work_dir == NULL)
    return NULL;
  cubin = run_nvcc (toolkit, work_dir, source, nvcc_args, error);
  if (cubin != NULL && in_cache)
    store_entry (work_dir, entry, cubin);
  remove_tree (work_dir);
  return cubin;
}

/**
 * moe_cuda_jit_compile: (skip)
 * @toolkit: a toolkit found by [func@cuda_toolkit_find]
 * @source: the CUDA C++ source
 * @nvcc_args: (array zero-terminated=1) (nullable): nvcc's options, such as
 *   `-std=c++17`, `-O3`, `-gencode=arch=compute_90a,code=sm_90a` or
 *   `-DMOE_N=4096`; `-cubin -o FILE SOURCE` are added
 * @error: return location for a #GError
 *
 * Compiles @source to a cubin with @toolkit's nvcc, through a disk cache:
 * `$MOE_JIT_CACHE_DIR`, or `libmoe/jit` in the user's cache directory. An
 * entry is named by the SHA-256 of nvcc's path, the toolkit's version,
 * @nvcc_args and @source, and holds the magic `MOEJIT1\n`, the SHA-256 of
 * the cubin and the cubin; an entry that does not check out is compiled
 * again. nvcc runs in a private directory inside the cache, and the entry
 * is renamed into place, so processes may share the cache; threads of one
 * process asking for the same entry run nvcc once. A cache that cannot be
 * written only means compiling every time. `MOE_JIT_DEBUG=1` logs each nvcc
 * command line.
 *
 * Returns: (transfer full): the cubin, or %NULL with @error set
 *   (%MOE_ERROR_FAILED: nvcc could not run or failed, with the end of its
 *   output)
 */
GBytes *
moe_cuda_jit_compile (const MoeCudaToolkit  *toolkit,
                      const char            *source,
                      const char * const    *nvcc_args,
                      GError               **error)
{
  const char *env = g_getenv ("MOE_JIT_CACHE_DIR");
  g_autofree char *key = NULL;
  g_autofree char *cache_dir = NULL;
  g_autofree char *entry = NULL;
  GBytes *cubin;

  g_return_val_if_fail (toolkit != NULL && toolkit->nvcc != NULL, NULL);
  g_return_val_if_fail (source != NULL, NULL);
  g_return_val_if_fail (error == NULL || *error == NULL, NULL);

  key = entry_key (toolkit, source, nvcc_args);
  if (env != NULL && *env != '\0')
    cache_dir = g_strdup (env);
  else
    cache_dir = g_build_filename (g_get_user_cache_dir (), "libmoe", "jit", NULL);
  if (g_mkdir_with_parents (cache_dir, 0700) != 0)
    {
      g_debug ("JIT cache: cannot create %s (%s); compiling without the cache",
               cache_dir, g_strerror (errno));
      g_clear_pointer (&cache_dir, g_free);
    }
  else
    {
      entry = g_build_filename (cache_dir, key, NULL);
      cubin = load_entry (entry);
      if (cubin != NULL)
        return cubin;
    }

  /* A miss: unless another thread is compiling this entry (then wait for it
   * and look again), compile it here. */
  moe_mutex_lock (&jit_lock);
  if (jit_in_flight == NULL)
    jit_in_flight = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, NULL);
  while (g_hash_table_contains (jit_in_flight, key))
    {
      moe_handoff_release (&jit_lock);
      g_cond_wait (&jit_cond, &jit_lock);
      moe_handoff_acquire (&jit_lock);
    }
  cubin = entry != NULL ? load_entry (entry) : NULL;
  if (cubin != NULL)
    {
      moe_mutex_unlock (&jit_lock);
      return cubin;
    }
  g_hash_table_add (jit_in_flight, g_strdup (key));
  moe_mutex_unlock (&jit_lock);

  cubin = compile_entry (toolkit, source, nvcc_args, cache_dir, entry, error);

  moe_mutex_lock (&jit_lock);
  g_hash_table_remove (jit_in_flight, key);
  g_cond_broadcast (&jit_cond);
  moe_mutex_unlock (&jit_lock);
  return cubin;
}
