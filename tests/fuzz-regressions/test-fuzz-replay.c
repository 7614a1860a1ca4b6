/* test-fuzz-replay.c: every fuzz reproducer and seed, through the fuzz
 * targets, in the normal build
 *
 * For each target T of fuzz/fuzz-targets.c, every file under
 * tests/fuzz-regressions/T/ (inputs that once crashed or leaked: they must
 * not any more) and under fuzz/corpus/T/ (the seeds) is one test case,
 * /fuzz-regressions/T/FILE or /fuzz-corpus/T/FILE. Each runs in a
 * subprocess, so a crash fails that case alone and names its file, with a
 * time limit (a hang fails too) and, outside sanitizer and valgrind runs, an
 * address-space limit of 2 GiB over the start-up size (an input that makes
 * the library ask for more fails at once instead of swapping; libFuzzer's
 * default malloc limit is the same 2 GiB).
 *
 * The directories are MOE_FUZZ_REGRESSIONS and MOE_FUZZ_CORPUS (meson sets
 * them). One case alone: test-fuzz-replay -p /fuzz-regressions/config/FILE.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <glib.h>

#include "fuzz-targets.h"

#if defined(__SANITIZE_ADDRESS__)
# define UNDER_ASAN 1
#elif defined(__has_feature)
# if __has_feature(address_sanitizer)
#  define UNDER_ASAN 1
# endif
#endif

#define TIME_LIMIT_S 60
#define MEMORY_LIMIT (G_GUINT64_CONSTANT (2) << 30)

typedef struct
{
  const MoeFuzzTarget *target;
  char                *path;
} Case;

static GPtrArray *cases;   /* Case*, freed after the run (LeakSanitizer builds) */

static void
case_free (gpointer p)
{
  Case *c = p;

  g_free (c->path);
  g_free (c);
}

static void
limit_memory (void)
{
#ifndef UNDER_ASAN
  const char *preload = g_getenv ("LD_PRELOAD");
  g_autofree char *statm = NULL;
  struct rlimit rl;
  guint64 pages;

  if (preload != NULL && strstr (preload, "vgpreload") != NULL)
    return;   /* valgrind manages the address space itself */
  if (!g_file_get_contents ("/proc/self/statm", &statm, NULL, NULL) ||
      sscanf (statm, "%" G_GUINT64_FORMAT, &pages) != 1)
    return;
  rl.rlim_cur = rl.rlim_max = pages * (guint64) sysconf (_SC_PAGESIZE) + MEMORY_LIMIT;
  if (setrlimit (RLIMIT_AS, &rl) != 0)
    g_test_message ("could not limit the address space: %s", g_strerror (errno));
#endif
}

static void
replay (gconstpointer data)
{
  const Case *c = data;

  if (g_test_subprocess ())
    {
      g_autoptr(GError) error = NULL;
      g_autofree char *contents = NULL;
      g_autofree guint8 *input = NULL;
      gsize length;

      if (!g_file_get_contents (c->path, &contents, &length, &error))
        g_error ("%s: %s", c->path, error->message);
      /* exactly the file's bytes, never NULL (libFuzzer's contract) */
      input = g_malloc (MAX (length, 1));
      memcpy (input, contents, length);
      g_clear_pointer (&contents, g_free);

      limit_memory ();
      c->target->func (input, length);
      return;
    }

  g_test_message ("replaying %s through the %s target", c->path, c->target->name);
  g_test_trap_subprocess (NULL, TIME_LIMIT_S * G_USEC_PER_SEC,
                          G_TEST_SUBPROCESS_INHERIT_STDOUT | G_TEST_SUBPROCESS_INHERIT_STDERR);
  if (!g_test_trap_has_passed ())
    g_test_message ("%s crashes, hangs or trips an assertion in the %s target: "
                    "reproduce with fuzz/fuzz-%s %s in a -Dfuzzing=true build (tools/fuzz.sh)",
                    c->path, c->target->name, c->target->name, c->path);
  g_test_trap_assert_passed ();
}

static int
compare_strings (gconstpointer a,
                 gconstpointer b)
{
  return strcmp (*(const char * const *) a, *(const char * const *) b);
}

static void
add_case (const char          *kind,
          const MoeFuzzTarget *target,
          const char          *path)
{
  Case *c = g_new0 (Case, 1);
  g_autofree char *base = g_path_get_basename (path);
  g_autofree char *test_path = NULL;

  /* GTest paths are /-separated: keep file names as they are otherwise */
  g_strdelimit (base, "/", '_');
  test_path = g_strdup_printf ("/%s/%s/%s", kind, target->name, base);
  c->target = target;
  c->path = g_strdup (path);
  g_ptr_array_add (cases, c);
  g_test_add_data_func (test_path, c, replay);
}

/* Adds a case per regular file in @dir (sorted; dot files and README*
 * skipped), or for @dir itself if it is a file. Returns how many. */
static guint
add_cases (const char          *kind,
           const MoeFuzzTarget *target,
           const char          *dir)
{
  g_autoptr(GDir) d = NULL;
  g_autoptr(GPtrArray) files = g_ptr_array_new_with_free_func (g_free);
  const char *name;

  if (g_file_test (dir, G_FILE_TEST_IS_REGULAR))
    {
      add_case (kind, target, dir);
      return 1;
    }
  if ((d = g_dir_open (dir, 0, NULL)) == NULL)
    return 0;
  while ((name = g_dir_read_name (d)) != NULL)
    {
      g_autofree char *path = g_build_filename (dir, name, NULL);
      if (name[0] == '.' || g_str_has_prefix (name, "README") || !g_file_test (path, G_FILE_TEST_IS_REGULAR))
        continue;
      g_ptr_array_add (files, g_steal_pointer (&path));
    }
  g_ptr_array_sort (files, compare_strings);
  for (guint i = 0; i < files->len; i++)
    add_case (kind, target, g_ptr_array_index (files, i));
  return files->len;
}

int
main (int    argc,
      char **argv)
{
  const char *regressions = g_getenv ("MOE_FUZZ_REGRESSIONS");
  const char *corpus = g_getenv ("MOE_FUZZ_CORPUS");
  guint n = 0;
  int status;

  g_test_init (&argc, &argv, NULL);
  cases = g_ptr_array_new_with_free_func (case_free);
  /* every case runs and reports, even after one failed (in the parent:
   * the targets' own assertions stay fatal in the subprocesses) */
  if (!g_test_subprocess ())
    g_test_set_nonfatal_assertions ();

  for (guint i = 0; moe_fuzz_targets[i].name != NULL; i++)
    {
      const MoeFuzzTarget *target = &moe_fuzz_targets[i];
      if (regressions != NULL)
        {
          g_autofree char *dir = g_build_filename (regressions, target->name, NULL);
          n += add_cases ("fuzz-regressions", target, dir);
        }
      if (corpus != NULL)
        {
          g_autofree char *dir = g_build_filename (corpus, target->name, NULL);
          n += add_cases ("fuzz-corpus", target, dir);
        }
    }

  if (n == 0)
    {
      g_printerr ("no inputs found: set MOE_FUZZ_REGRESSIONS and MOE_FUZZ_CORPUS (meson test does)\n");
      g_ptr_array_unref (cases);
      return 1;
    }
  status = g_test_run ();
  g_ptr_array_unref (cases);
  return status;
}
