/* fuzz-targets.c: what each fuzz target does with one input
 *
 * Written once, used twice: the libFuzzer harnesses (fuzz/fuzz-main.c, one
 * executable per target) and the replay test of the normal test suite
 * (tests/fuzz-regressions/test-fuzz-replay.c), which runs every saved
 * reproducer and every seed through these same functions.
 *
 * Only libmoe's public API is used. Inputs reach the library the way real
 * files do: written to a scratch directory (made once per process, reused by
 * every input, removed at exit) and opened by path.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#define _GNU_SOURCE   /* nftw */
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libmoe.h>

#include "fuzz-targets.h"

#ifndef MOE_FUZZ_SOURCE_ROOT
# error "MOE_FUZZ_SOURCE_ROOT must name the source tree (for tests/data)"
#endif

const MoeFuzzTarget moe_fuzz_targets[] = {
  { "safetensors", moe_fuzz_safetensors },
  { "index", moe_fuzz_index },
  { "config", moe_fuzz_config },
  { "plugin", moe_fuzz_plugin },
  { "generation_config", moe_fuzz_generation_config },
  { NULL, NULL },
};

const MoeFuzzTarget *
moe_fuzz_target_lookup (const char *name)
{
  for (guint i = 0; moe_fuzz_targets[i].name != NULL; i++)
    if (g_str_equal (moe_fuzz_targets[i].name, name))
      return &moe_fuzz_targets[i];
  return NULL;
}

/* ------------------------------------------------------------------ */
/* Scratch directories                                                 */

static char *scratch_root;      /* $TMPDIR/libmoe-fuzz-XXXXXX */
static const char *source_root;

static int
remove_entry (const char        *path,
              const struct stat *st,
              int                flag,
              struct FTW        *ftw)
{
  remove (path);
  return 0;
}

static void
remove_scratch (void)
{
  if (scratch_root != NULL)
    nftw (scratch_root, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Bugs of GLib itself that inputs reach through libmoe, tolerated so that
 * fuzzing can go on past them (fuzz/README.md lists them):
 *
 * - GLib 2.74's g_key_file_parse_value_as_string() sets its GError twice
 *   for a value with an invalid escape and then a backslash at its end
 *   (a line "Name=a\;b\"): g_key_file_get_string() warns "GError set over
 *   the top of a previous GError", whoever calls it. */
static gboolean
is_known_glib_bug (const GLogField *fields,
                   gsize            n_fields)
{
  const char *domain = NULL, *message = NULL;

  for (gsize i = 0; i < n_fields; i++)
    if (g_str_equal (fields[i].key, "GLIB_DOMAIN") && fields[i].length < 0)
      domain = fields[i].value;
    else if (g_str_equal (fields[i].key, "MESSAGE") && fields[i].length < 0)
      message = fields[i].value;
  return g_strcmp0 (domain, "GLib") == 0 && message != NULL &&
         strstr (message, "GError set over the top of a previous GError") != NULL &&
         strstr (message, "The overwriting error message was: Key file contains escape character at end of line") != NULL;
}

/* Every message, the old API's included, reaches this writer. An error,
 * critical or warning aborts: with SIGABRT, which libFuzzer catches and
 * saves the input for (GLib's own abort for fatal messages is a SIGTRAP,
 * which libFuzzer does not handle), after a line with "ERROR:" (what
 * libFuzzer's fork mode echoes from a crashed job). */
static GLogWriterOutput
fatal_log_writer (GLogLevelFlags   level,
                  const GLogField *fields,
                  gsize            n_fields,
                  gpointer         user_data)
{
  if ((level & (G_LOG_FLAG_FATAL | G_LOG_LEVEL_ERROR | G_LOG_LEVEL_CRITICAL | G_LOG_LEVEL_WARNING)) &&
      !((level & G_LOG_LEVEL_WARNING) && is_known_glib_bug (fields, n_fields)))
    {
      g_autofree char *text = g_log_writer_format_fields (level, fields, n_fields, FALSE);
      fprintf (stderr, "ERROR: fuzz: a fatal GLib message: %s\n", g_strchug (text));
      fflush (stderr);
      abort ();
    }
  if (g_getenv ("MOE_FUZZ_VERBOSE") == NULL)
    return G_LOG_WRITER_HANDLED;      /* quiet: the known bugs, debug messages */
  return g_log_writer_default (level & ~G_LOG_FLAG_FATAL, fields, n_fields, user_data);
}

void
moe_fuzz_setup (void)
{
  static gsize done;

  if (!g_once_init_enter (&done))
    return;

  /* A warning or critical from the library is a bug the input exposed:
   * the writer aborts, so libFuzzer (and the replay test) count it. Only
   * the writer decides (not GLib's always-fatal mask, which g_test_init()
   * sets), so that it can let the known GLib bug above pass. */
  g_log_set_always_fatal (G_LOG_FATAL_MASK);
  g_log_set_writer_func (fatal_log_writer, NULL, NULL);

  /* Hermetic: never look at installed plugins. */
  g_setenv ("MOE_PLUGIN_SYSTEM_PATH", "", TRUE);
  g_unsetenv ("MOE_PLUGIN_PATH");

  source_root = g_getenv ("MOE_FUZZ_SOURCE_ROOT");
  if (source_root == NULL || *source_root == '\0')
    source_root = MOE_FUZZ_SOURCE_ROOT;
  source_root = g_strdup (source_root);

  {
    g_autoptr(GError) error = NULL;
    scratch_root = g_dir_make_tmp ("libmoe-fuzz-XXXXXX", &error);
    if (scratch_root == NULL)
      g_error ("fuzz: cannot make a scratch directory: %s", error->message);
    atexit (remove_scratch);
  }

  g_once_init_leave (&done, 1);
}

static char *
scratch_dir (const char *first,
             ...) G_GNUC_NULL_TERMINATED;

/* $scratch/first/…, created */
static char *
scratch_dir (const char *first,
             ...)
{
  GPtrArray *parts = g_ptr_array_new ();
  va_list args;
  char *path;

  g_ptr_array_add (parts, scratch_root);
  va_start (args, first);
  for (const char *p = first; p != NULL; p = va_arg (args, const char *))
    g_ptr_array_add (parts, (gpointer) p);
  va_end (args);
  g_ptr_array_add (parts, NULL);
  path = g_build_filenamev ((char **) parts->pdata);
  g_ptr_array_free (parts, TRUE);
  if (g_mkdir_with_parents (path, 0700) != 0)
    g_error ("fuzz: cannot create %s", path);
  return path;
}

static void
write_file (const char   *path,
            const guint8 *data,
            gsize         size)
{
  FILE *f = fopen (path, "wb");

  if (f == NULL || (size > 0 && fwrite (data, 1, size, f) != size) || fclose (f) != 0)
    g_error ("fuzz: cannot write %s", path);
}

/* Copies tests/data/<rel> to <dir>/<name>. */
static void
copy_fixture (const char *rel,
              const char *dir,
              const char *name)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *src = g_build_filename (source_root, "tests", "data", rel, NULL);
  g_autofree char *dst = g_build_filename (dir, name, NULL);
  g_autofree char *contents = NULL;
  gsize length;

  if (!g_file_get_contents (src, &contents, &length, &error))
    g_error ("fuzz: the fixture %s is missing (set MOE_FUZZ_SOURCE_ROOT to the source tree): %s",
             src, error->message);
  write_file (dst, (const guint8 *) contents, length);
}

/* ------------------------------------------------------------------ */
/* JSON followed by more JSON                                          */

/* json-glib 1.6 (Debian bookworm's 1.6.6) accepts an object followed by
 * more objects or arrays: json_parser_load_from_data() returns TRUE with
 * the first as the root, and leaks the others. Python's json.loads and the
 * safetensors reference (serde_json) reject such text ("Extra data"), and
 * so must libmoe: the targets check that it does. (A string or number root
 * followed by an object leaks the same way; libmoe refuses those roots.) */

/* Skips whitespace and C comments (json-glib's scanner skips those). */
static gsize
skip_space (const char *text,
            gsize       len,
            gsize       i)
{
  for (;;)
    {
      while (i < len && (text[i] == ' ' || text[i] == '\t' || text[i] == '\r' || text[i] == '\n'))
        i++;
      if (i + 1 < len && text[i] == '/' && text[i + 1] == '*')
        {
          const char *end = g_strstr_len (text + i + 2, (gssize) (len - i - 2), "*/");
          if (end == NULL)
            return len;
          i = (gsize) (end - text) + 2;
          continue;
        }
      return i;
    }
}

/* TRUE if @text is a JSON value followed by anything but whitespace and
 * comments, scanning as json-glib does ("…" and '…' strings, C comments). */
static gboolean
json_has_trailing_content (const char *text,
                           gsize       len)
{
  gsize i = skip_space (text, len, 0);
  int depth = 0;

  if (i >= len)
    return FALSE;
  if (text[i] != '{' && text[i] != '[' && text[i] != '"' && text[i] != '\'')
    {
      /* a number, true, false or null */
      while (i < len && strchr (" \t\r\n,:{}[]\"'/", text[i]) == NULL)
        i++;
      return skip_space (text, len, i) < len;
    }
  for (; i < len; i++)
    {
      char c = text[i];
      if (c == '"' || c == '\'')
        {
          for (i++; i < len && text[i] != c; i++)
            if (text[i] == '\\')
              i++;
          if (depth == 0)
            break;      /* a string root */
        }
      else if (c == '/' && i + 1 < len && text[i + 1] == '*')
        i = skip_space (text, len, i) - 1;
      else if (c == '{' || c == '[')
        depth++;
      else if ((c == '}' || c == ']') && --depth == 0)
        break;
    }
  if (i >= len)
    return FALSE;       /* unterminated: a parse error */
  return skip_space (text, len, i + 1) < len;
}

/* json-glib 1.6's scanner also leaks (152 bytes) when a high surrogate
 * escape \\uD800–\\uDBFF is not followed by a well-formed low one ("\\ud800\\u").
 * TRUE if @text has a high surrogate escape at all. */
static gboolean
json_has_high_surrogate (const char *text,
                         gsize       len)
{
  for (gsize i = 0; i + 3 < len; i++)
    if (text[i] == '\\' && (text[i + 1] == 'u' || text[i + 1] == 'U') &&
        (text[i + 2] == 'd' || text[i + 2] == 'D') && strchr ("89abAB", text[i + 3]) != NULL &&
        text[i + 3] != '\0')
      return TRUE;
  return FALSE;
}

/* TRUE if parsing @text leaks inside json-glib, whatever libmoe does */
static gboolean
json_glib_leaks (const char *text,
                 gsize       len)
{
  return json_has_trailing_content (text, len) || json_has_high_surrogate (text, len);
}

/* json-glib's leaks (above) are kept out of LeakSanitizer's sight for the
 * inputs that trigger them: they are json-glib's, and the one libmoe must
 * handle, JSON after JSON, is reported once, as the acceptance check below,
 * not as a leak on every such input. */
#if defined(__SANITIZE_ADDRESS__)
# define HAVE_LSAN 1
#elif defined(__has_feature)
# if __has_feature(address_sanitizer)
#  define HAVE_LSAN 1
# endif
#endif
#ifdef HAVE_LSAN
# include <sanitizer/lsan_interface.h>
#endif

static void
ignore_leaks_if (gboolean leaks,
                 gboolean ignore)
{
#ifdef HAVE_LSAN
  if (leaks && ignore)
    __lsan_disable ();
  else if (leaks)
    __lsan_enable ();
#endif
}

static void
check_refused_trailing (gboolean    trailing,
                        gboolean    accepted,
                        const char *what)
{
  if (trailing && accepted)
    g_error ("libmoe accepted %s whose JSON object is followed by more JSON (json-glib keeps the "
             "first value and leaks the rest; Python's json and serde_json refuse it)", what);
}

/* ------------------------------------------------------------------ */
/* Exercising what was loaded                                          */

/* MOE_FUZZ_VERBOSE=1: why the library refused each input (and which
 * models loaded) */
static void
note (const char   *what,
      const GError *error)
{
  static int verbose = -1;

  if (verbose < 0)
    verbose = g_getenv ("MOE_FUZZ_VERBOSE") != NULL;
  if (verbose && error != NULL)
    g_printerr ("fuzz: %s refused: %s\n", what, error->message);
  else if (verbose)
    g_printerr ("fuzz: %s loaded\n", what);
}

static volatile guint8 sink;

static void
exercise_tensor (MoeTensor *t)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(GBytes) bytes = NULL;
  g_autoptr(GBytes) f32 = NULL;
  g_autofree char *text = NULL;
  const guint8 *p;
  gsize n;
  guint n_dims;
  guint8 acc = 0;

  moe_tensor_get_shape (t, &n_dims);
  g_assert_cmpuint (n_dims, ==, moe_tensor_get_n_dims (t));
  g_assert_cmpuint (moe_tensor_get_n_bytes (t), ==,
                    (gsize) moe_tensor_get_n_elements (t) * moe_dtype_get_size (moe_tensor_get_dtype (t)));
  for (guint i = 0; i < n_dims; i++)
    moe_tensor_get_dim (t, (int) i);
  text = moe_tensor_to_string (t);

  /* every byte of the tensor, through a copy of its view of the file */
  bytes = moe_tensor_dup_bytes (t, &error);
  g_clear_error (&error);
  if (bytes != NULL)
    {
      p = g_bytes_get_data (bytes, &n);
      g_assert_cmpuint (n, ==, moe_tensor_get_n_bytes (t));
      for (gsize i = 0; i < n; i++)
        acc ^= p[i];
    }
  /* and every element converted, for the dtypes that convert */
  f32 = moe_tensor_to_f32_bytes (t, &error);
  g_clear_error (&error);
  if (f32 != NULL)
    {
      p = g_bytes_get_data (f32, &n);
      for (gsize i = 0; i < n; i++)
        acc ^= p[i];
    }
  sink = acc;
}

static void
exercise_experts (MoeCheckpoint *ck,
                  const char    *prefix)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeExperts) experts = moe_checkpoint_load_experts (ck, prefix, &error);

  if (experts == NULL)
    {
      g_assert_nonnull (error);
      note ("experts", error);
      return;
    }
  g_assert_no_error (error);
  if (!moe_experts_validate (experts, &error))
    return;
  moe_experts_get_num_experts (experts);
  moe_experts_get_hidden_size (experts);
  moe_experts_get_intermediate_size (experts);
  moe_experts_get_is_transposed (experts);
  exercise_tensor (moe_experts_get_up_weight (experts));
  exercise_tensor (moe_experts_get_down_weight (experts));
  if (moe_experts_get_up_bias (experts) != NULL)
    exercise_tensor (moe_experts_get_up_bias (experts));
  if (moe_experts_get_down_bias (experts) != NULL)
    exercise_tensor (moe_experts_get_down_bias (experts));
}

/* Lists the tensors, reads each one's header entry and bytes, reads the
 * metadata, and loads the experts of every `…experts` prefix the names
 * contain (per-expert keys are fused, as for a model). */
static void
exercise_checkpoint (MoeCheckpoint *ck)
{
  g_auto(GStrv) names = moe_checkpoint_list_tensors (ck);
  g_autoptr(GHashTable) prefixes = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, NULL);
  GHashTableIter iter;
  gpointer key, value;

  moe_checkpoint_get_path (ck);
  for (guint i = 0; names[i] != NULL; i++)
    {
      g_autoptr(GError) error = NULL;
      g_autoptr(GArray) shape = NULL;
      g_autoptr(MoeTensor) t = NULL;
      const char *experts;
      MoeDType dtype;

      g_assert_true (moe_checkpoint_has_tensor (ck, names[i]));
      g_assert_true (moe_checkpoint_get_tensor_info (ck, names[i], &dtype, &shape, &error));
      g_assert_no_error (error);
      t = moe_checkpoint_get_tensor (ck, names[i], &error);
      g_assert_no_error (error);
      g_assert_nonnull (t);
      g_assert_cmpint (moe_tensor_get_dtype (t), ==, dtype);
      g_assert_true (moe_tensor_has_shape (t, (const gint64 *) shape->data, shape->len));
      exercise_tensor (t);

      if ((experts = strstr (names[i], "experts")) != NULL && g_hash_table_size (prefixes) < 16)
        g_hash_table_add (prefixes, g_strndup (names[i], (gsize) (experts - names[i]) + strlen ("experts")));
    }

  g_hash_table_iter_init (&iter, moe_checkpoint_get_metadata (ck));
  while (g_hash_table_iter_next (&iter, &key, &value))
    g_assert_cmpstr (moe_checkpoint_get_metadata_value (ck, key), ==, value);

  {
    g_autoptr(GError) error = NULL;
    g_assert_false (moe_checkpoint_has_tensor (ck, "\x01 not a tensor"));
    g_assert_null (moe_checkpoint_get_tensor (ck, "\x01 not a tensor", &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND);
  }

  g_hash_table_iter_init (&iter, prefixes);
  while (g_hash_table_iter_next (&iter, &key, NULL))
    exercise_experts (ck, key);
  exercise_experts (ck, "\x01 no experts here");
}

/* ------------------------------------------------------------------ */
/* (a) a .safetensors file                                             */

int
moe_fuzz_safetensors (const guint8 *data,
                      gsize         size)
{
  static char *path;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeCheckpoint) ck = NULL;
  guint64 header_len = 0;
  gboolean trailing = FALSE, leaks = FALSE;

  moe_fuzz_setup ();
  if (path == NULL)
    {
      g_autofree char *dir = scratch_dir ("safetensors", NULL);
      path = g_build_filename (dir, "input.safetensors", NULL);
    }
  write_file (path, data, size);

  for (int i = 7; size >= 8 && i >= 0; i--)
    header_len = (header_len << 8) | data[i];
  if (size >= 8 && header_len <= size - 8)
    {
      trailing = json_has_trailing_content ((const char *) data + 8, header_len);
      leaks = json_glib_leaks ((const char *) data + 8, header_len);
    }

  ignore_leaks_if (leaks, TRUE);
  ck = moe_checkpoint_open (path, &error);
  ignore_leaks_if (leaks, FALSE);
  check_refused_trailing (trailing, ck != NULL, "a safetensors header");
  if (ck == NULL)
    {
      g_assert_nonnull (error);
      note ("safetensors", error);
      return 0;
    }
  g_assert_no_error (error);
  exercise_checkpoint (ck);
  return 0;
}

/* ------------------------------------------------------------------ */
/* (b) model.safetensors.index.json beside two valid shards            */

int
moe_fuzz_index (const guint8 *data,
                gsize         size)
{
  static char *dir, *path;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeCheckpoint) ck = NULL;
  gboolean trailing, leaks;

  moe_fuzz_setup ();
  if (dir == NULL)
    {
      dir = scratch_dir ("index", NULL);
      path = g_build_filename (dir, "model.safetensors.index.json", NULL);
      /* the shards tests/data/sharded's index names */
      copy_fixture ("sharded/model-00001-of-00002.safetensors", dir, "model-00001-of-00002.safetensors");
      copy_fixture ("sharded/model-00002-of-00002.safetensors", dir, "model-00002-of-00002.safetensors");
    }
  write_file (path, data, size);

  trailing = json_has_trailing_content ((const char *) data, size);
  leaks = json_glib_leaks ((const char *) data, size);
  ignore_leaks_if (leaks, TRUE);
  ck = moe_checkpoint_open (dir, &error);
  ignore_leaks_if (leaks, FALSE);
  check_refused_trailing (trailing, ck != NULL, "a model.safetensors.index.json");
  if (ck == NULL)
    {
      g_assert_nonnull (error);
      note ("index", error);
      return 0;
    }
  g_assert_no_error (error);
  exercise_checkpoint (ck);
  return 0;
}

/* ------------------------------------------------------------------ */
/* (c) config.json: the getters, then a whole model load               */

static void
exercise_config_getters (MoeConfig  *c,
                         const char *key)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(GArray) ints = NULL;
  g_autofree char *s1 = NULL, *s2 = NULL;
  gboolean is_null = moe_config_is_null (c, key);

#define CLEAR() g_clear_error (&error)
  moe_config_get_int (c, key, &error);
  g_assert_true (!is_null || g_error_matches (error, MOE_ERROR, MOE_ERROR_MISSING_KEY));
  CLEAR ();
  moe_config_get_int_or (c, key, 7, &error); CLEAR ();
  moe_config_get_double (c, key, &error); CLEAR ();
  moe_config_get_double_or (c, key, 0.5, &error); CLEAR ();
  moe_config_get_boolean (c, key, &error); CLEAR ();
  moe_config_get_boolean_or (c, key, TRUE, &error); CLEAR ();
  s1 = moe_config_dup_string (c, key, &error); CLEAR ();
  s2 = moe_config_dup_string_or (c, key, "fallback", &error); CLEAR ();
  ints = moe_config_get_int_array (c, key, &error); CLEAR ();
#undef CLEAR
}

static void
exercise_config (MoeConfig *c,
                 guint      depth)
{
  g_auto(GStrv) keys = moe_config_list_keys (c);
  g_auto(GStrv) subs = moe_config_list_sub_configs (c);
  g_autofree char *text = moe_config_to_string (c);

  g_assert_nonnull (text);
  moe_config_get_name (c);
  moe_config_get_model_type (c);
  for (guint i = 0; keys[i] != NULL; i++)
    {
      g_assert_true (moe_config_has_key (c, keys[i]));
      exercise_config_getters (c, keys[i]);
    }
  g_assert_false (moe_config_has_key (c, "\x01 missing"));
  exercise_config_getters (c, "\x01 missing");

  for (guint i = 0; subs[i] != NULL; i++)
    {
      MoeConfig *sub = moe_config_get_sub_config (c, subs[i]);

      g_assert_nonnull (sub);
      g_assert_true (moe_config_get_parent (sub) == c);
      g_assert_cmpstr (moe_config_get_name (sub), ==, subs[i]);
      if (depth < 64)
        exercise_config (sub, depth + 1);
    }
}

/* The families, each loaded from a directory holding its own test model,
 * so that each family's key parsing goes on to its tensors. */
static const char * const families[] = {
  "qwen3_moe",      /* first: the directory for unknown model types */
  "qwen2_moe", "qwen3_vl_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss",
  NULL,
};

static void
load_model (MoeConfig    *parsed,
            const guint8 *data,
            gsize         size)
{
  static char **dirs;
  const char *model_type = moe_config_get_model_type (parsed);
  guint family = 0;
  g_autofree char *config_path = NULL;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeModel) model = NULL;

  if (dirs == NULL)
    {
      dirs = g_new0 (char *, G_N_ELEMENTS (families));
      for (guint i = 0; families[i] != NULL; i++)
        {
          g_autofree char *weights = g_build_filename ("models", families[i], "model.safetensors", NULL);
          g_autofree char *gen = g_build_filename ("models", families[i], "generation_config.json", NULL);
          dirs[i] = scratch_dir ("config", families[i], NULL);
          copy_fixture (weights, dirs[i], "model.safetensors");
          copy_fixture (gen, dirs[i], "generation_config.json");
        }
    }
  for (guint i = 0; model_type != NULL && families[i] != NULL; i++)
    if (g_str_equal (model_type, families[i]))
      family = i;

  config_path = g_build_filename (dirs[family], "config.json", NULL);
  write_file (config_path, data, size);
  model = moe_model_new_from_pretrained (dirs[family], NULL, NULL, &error);
  if (model == NULL)
    {
      g_assert_nonnull (error);
      note ("model", error);
      return;
    }
  g_assert_no_error (error);
  note ("model", NULL);
  {
    g_autoptr(GHashTable) impl = moe_model_get_experts_implementation (model);
    g_autofree char *name = moe_model_dup_experts_implementation_name (model);
    g_assert_nonnull (name);
    g_assert_cmpint (moe_model_get_vocab_size (model), >, 0);
    g_assert_nonnull (moe_model_get_config (model));
    g_assert_nonnull (moe_model_get_generation_config (model));
    moe_model_get_dtype (model);
    moe_model_get_device (model);
    g_assert_true (g_hash_table_contains (impl, ""));
  }
}

int
moe_fuzz_config (const guint8 *data,
                 gsize         size)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeConfig) config = NULL;
  gboolean trailing = json_has_trailing_content ((const char *) data, size);
  gboolean leaks = json_glib_leaks ((const char *) data, size);

  moe_fuzz_setup ();
  ignore_leaks_if (leaks, TRUE);
  config = moe_config_new_from_data ((const char *) data, (gssize) size, &error);
  ignore_leaks_if (leaks, FALSE);
  check_refused_trailing (trailing, config != NULL, "a config.json");
  if (config == NULL)
    {
      /* model loading would stop at the same parse */
      g_assert_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG);
      note ("config", error);
      return 0;
    }
  g_assert_no_error (error);
  g_assert_null (moe_config_get_parent (config));
  exercise_config (config, 0);
  ignore_leaks_if (leaks, TRUE);
  load_model (config, data, size);
  ignore_leaks_if (leaks, FALSE);
  return 0;
}

/* ------------------------------------------------------------------ */
/* (d) a .plugin keyfile, and a registry scanning its directory         */

/* GLib 2.74's g_key_file_get_locale_string() leaks the GError (102 bytes)
 * that g_key_file_get_string() sets, beside the value it still returns, for
 * an invalid escape in the untranslated value ("Description=a\;b"). TRUE
 * if @text has an escape other than \s \n \t \r and a doubled backslash,
 * so that LeakSanitizer looks away for that input. */
static gboolean
keyfile_has_invalid_escape (const guint8 *text,
                            gsize         len)
{
  for (gsize i = 0; i < len; i++)
    if (text[i] == '\\' && (i + 1 == len || strchr ("sntr\\", text[i + 1]) == NULL || text[i + 1] == '\0'))
      return TRUE;
    else if (text[i] == '\\')
      i++;
  return FALSE;
}

/* A good keyfile beside the input (sorted first): the registry has a
 * plugin to compare with, and a name for the input to shadow. */
static const char good_keyfile[] =
  "[Moe Plugin]\n"
  "Module=eager\n"
  "Name=eager\n"
  "Kind=experts-backend\n"
  "Type=MoeEagerBackend\n"
  "Abi=1\n"
  "Priority=10\n"
  "Devices=cpu;\n"
  "Description=fuzz: its module does not exist\n";

static void
exercise_registry (const char *dir)
{
  g_autoptr(MoePluginRegistry) registry = moe_plugin_registry_new ();
  g_autoptr(GPtrArray) rejected = NULL;
  g_auto(GStrv) backends = NULL;
  g_auto(GStrv) devices = NULL;
  guint n;

  moe_plugin_registry_add_search_path (registry, dir);
  backends = moe_plugin_registry_list_backends (registry);
  devices = moe_plugin_registry_list_devices (registry);
  rejected = moe_plugin_registry_dup_rejected (registry);

  n = g_list_model_get_n_items (G_LIST_MODEL (registry));
  for (guint i = 0; i < n; i++)
    {
      g_autoptr(MoePluginInfo) info = g_list_model_get_item (G_LIST_MODEL (registry), i);
      g_assert_nonnull (info);
      g_assert_true (moe_plugin_registry_lookup (registry, moe_plugin_info_get_kind (info),
                                                 moe_plugin_info_get_name (info)) == info);
    }
  g_assert_null (g_list_model_get_item (G_LIST_MODEL (registry), n));

  /* No module exists in the directory: every open fails, twice (the second
   * time from the remembered error). */
  for (guint pass = 0; pass < 2; pass++)
    {
      for (guint i = 0; backends[i] != NULL; i++)
        {
          g_autoptr(GError) error = NULL;
          g_assert_nonnull (moe_plugin_registry_lookup (registry, MOE_PLUGIN_KIND_EXPERTS_BACKEND, backends[i]));
          g_assert_null (moe_plugin_registry_get_backend (registry, backends[i], &error));
          g_assert_nonnull (error);
        }
      for (guint i = 0; devices[i] != NULL; i++)
        {
          g_autoptr(GError) error = NULL;
          g_assert_null (moe_plugin_registry_get_device (registry, devices[i], &error));
          g_assert_nonnull (error);
        }
    }
  {
    g_autoptr(GError) error = NULL;
    g_assert_null (moe_plugin_registry_get_backend (registry, "\x01 no such backend", &error));
    g_assert_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND);
  }
  moe_plugin_registry_rescan (registry);
  g_assert_cmpuint (g_list_model_get_n_items (G_LIST_MODEL (registry)), ==, n);
}

int
moe_fuzz_plugin (const guint8 *data,
                 gsize         size)
{
  static char *dir, *path;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoePluginInfo) info = NULL;
  gboolean leaks;

  moe_fuzz_setup ();
  if (dir == NULL)
    {
      g_autofree char *good = NULL;
      dir = scratch_dir ("plugin", NULL);
      path = g_build_filename (dir, "fuzz.plugin", NULL);
      good = g_build_filename (dir, "0-eager.plugin", NULL);
      write_file (good, (const guint8 *) good_keyfile, strlen (good_keyfile));
    }
  write_file (path, data, size);

  leaks = keyfile_has_invalid_escape (data, size);
  ignore_leaks_if (leaks, TRUE);
  info = moe_plugin_info_new_from_file (path, &error);
  if (info == NULL)
    {
      g_assert_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE);
      note ("plugin info", error);
    }
  else
    {
      const char * const *devices = moe_plugin_info_get_devices (info);
      g_autofree char *extra = moe_plugin_info_dup_extra (info, "X-Moe-Dtypes");
      g_autofree char *module = moe_plugin_info_dup_extra (info, "Module");

      g_assert_no_error (error);
      g_assert_cmpstr (module, ==, moe_plugin_info_get_module_name (info));
      if (extra != NULL)
        sink ^= (guint8) extra[0];
      g_assert_nonnull (moe_plugin_info_get_name (info));
      g_assert_nonnull (moe_plugin_info_get_module_name (info));
      g_assert_true (g_str_has_prefix (moe_plugin_info_get_module_path (info), dir));
      g_assert_cmpstr (moe_plugin_info_get_keyfile_path (info), ==, path);
      g_assert_nonnull (moe_plugin_info_get_type_name (info));
      moe_plugin_info_get_description (info);
      moe_plugin_info_get_version (info);
      moe_plugin_info_get_kind (info);
      moe_plugin_info_get_priority (info);
      moe_plugin_info_get_abi (info);
      g_assert_nonnull (devices);
      for (guint i = 0; devices[i] != NULL; i++)
        sink ^= (guint8) devices[i][0];
      g_assert_false (moe_plugin_info_is_loaded (info));
    }

  exercise_registry (dir);
  ignore_leaks_if (leaks, FALSE);
  return 0;
}

/* ------------------------------------------------------------------ */
/* (e) generation_config.json                                          */

int
moe_fuzz_generation_config (const guint8 *data,
                            gsize         size)
{
  static char *path;
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeGenerationConfig) config = NULL;
  g_autoptr(MoeGenerationConfig) copy = NULL;
  const gint64 *eos, *copy_eos;
  guint n_eos, n_copy_eos;
  gboolean trailing, leaks;

  moe_fuzz_setup ();
  if (path == NULL)
    {
      g_autofree char *dir = scratch_dir ("generation_config", NULL);
      path = g_build_filename (dir, "generation_config.json", NULL);
    }
  write_file (path, data, size);

  trailing = json_has_trailing_content ((const char *) data, size);
  leaks = json_glib_leaks ((const char *) data, size);
  ignore_leaks_if (leaks, TRUE);
  config = moe_generation_config_new_from_file (path, &error);
  ignore_leaks_if (leaks, FALSE);
  check_refused_trailing (trailing, config != NULL, "a generation_config.json");
  if (config == NULL)
    {
      g_assert_nonnull (error);
      note ("generation config", error);
      return 0;
    }
  g_assert_no_error (error);

  eos = moe_generation_config_get_eos_token_ids (config, &n_eos);
  for (guint i = 0; i < n_eos; i++)
    sink ^= (guint8) eos[i];

  /* a copy holds the same values (and copying sets each property) */
  copy = moe_generation_config_copy (config);
  copy_eos = moe_generation_config_get_eos_token_ids (copy, &n_copy_eos);
  g_assert_cmpuint (n_copy_eos, ==, n_eos);
  g_assert_true (n_eos == 0 || memcmp (eos, copy_eos, n_eos * sizeof (gint64)) == 0);
  {
    static const char * const props[] = {
      "max-new-tokens", "do-sample", "temperature", "top-k", "top-p", "seed", "pad-token-id", NULL,
    };
    for (guint i = 0; props[i] != NULL; i++)
      {
        g_auto(GValue) a = G_VALUE_INIT;
        g_auto(GValue) b = G_VALUE_INIT;
        g_object_get_property (G_OBJECT (config), props[i], &a);
        g_object_get_property (G_OBJECT (copy), props[i], &b);
        g_assert_cmpint (g_param_values_cmp (g_object_class_find_property (G_OBJECT_GET_CLASS (config), props[i]), &a, &b), ==, 0);
      }
  }
  moe_generation_config_set_eos_token_ids (copy, NULL, 0);
  return 0;
}
