/* moe-bench-sampling.c: do_sample's token choice for a batch of rows of
 * Qwen's 151,936 logits, one row after another (_moe_sample_token) against
 * the rows at once on threads (_moe_sample_tokens, what generation runs):
 * a table of ms a step for each filter set and batch. Builds
 * libmoe/moe-sampling.c in itself, as tests/c/test-sampling.c does.
 *
 *   moe-bench-sampling [-b B,...] [-r REPEATS]
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <glib.h>

#include "moe-sampling-private.h"

#define V 151936

static char *opt_batches;
static int opt_repeats = 5;

static GOptionEntry entries[] = {
  { "batches", 'b', 0, G_OPTION_ARG_STRING, &opt_batches, "Batch sizes (default 1,8)", "B,..." },
  { "repeats", 'r', 0, G_OPTION_ARG_INT, &opt_repeats, "Timed steps, the median kept (default 5, at most 64)", "N" },
  G_OPTION_ENTRY_NULL
};

static const struct {
  const char *name;
  double temperature, top_p;
  guint top_k;
} filters[] = {
  { "no filter", 1.0, 1.0, 0 },
  { "top-k 20, top-p 0.8, temperature 0.7 (Qwen's)", 0.7, 0.8, 20 },
  { "top-p 0.9, temperature 0.7", 0.7, 0.9, 0 },
  { "top-p 0.95, temperature 2 (flat: most tokens kept)", 2.0, 0.95, 0 },
};

static int
by_value (const void *a, const void *b)
{
  double x = *(const double *) a, y = *(const double *) b;
  return (x > y) - (x < y);
}

int
main (int argc, char *argv[])
{
  g_autoptr(GOptionContext) context = g_option_context_new ("- do_sample's token choice, row by row and at once");
  g_autoptr(GError) error = NULL;
  g_auto(GStrv) batches = NULL;
  g_autoptr(GRand) rand = g_rand_new_with_seed (2026);
  guint max_b = 0;
  int reps;
  float *x;

  g_option_context_add_main_entries (context, entries, NULL);
  if (!g_option_context_parse (context, &argc, &argv, &error) || opt_repeats < 1)
    {
      g_printerr ("%s\n", error ? error->message : "--repeats must be at least 1");
      return 2;
    }
  reps = MIN (opt_repeats, 64);
  batches = g_strsplit (opt_batches ? opt_batches : "1,8", ",", -1);
  for (guint i = 0; batches[i] != NULL; i++)
    max_b = MAX (max_b, (guint) atoi (batches[i]));
  if (max_b == 0)
    {
      g_printerr ("no batch size in --batches\n");
      return 2;
    }
  /* peaked rows: normal logits, spread 3 */
  x = g_new (float, (gsize) max_b * V);
  for (gsize i = 0; i < (gsize) max_b * V; i++)
    {
      double u = g_rand_double_range (rand, 1e-12, 1.0), w = g_rand_double (rand);
      x[i] = (float) (sqrt (-2.0 * log (u)) * cos (2 * G_PI * w) * 3.0);
    }

  printf ("| %u logits a row, %u threads | B | row by row, ms a step | at once, ms a step | speed-up |\n"
          "|---|---:|---:|---:|---:|\n", V, g_get_num_processors ());
  for (guint f = 0; f < G_N_ELEMENTS (filters); f++)
    for (guint i = 0; batches[i] != NULL; i++)
      {
        guint B = (guint) atoi (batches[i]);
        g_autofree gint64 *tokens = g_new (gint64, MAX (B, 1));
        g_autofree double *draws = g_new (double, MAX (B, 1));
        const MoeSampling s = { filters[f].temperature, filters[f].top_k, filters[f].top_p, draws };
        double ms[2][64];

        if (B == 0)
          continue;
        for (int r = 0; r < reps; r++)
          for (int way = 0; way < 2; way++)
            {
              g_autoptr(GRand) rng = g_rand_new_with_seed (r + 1);
              gint64 t0 = g_get_monotonic_time ();

              if (way == 0)
                for (guint b = 0; b < B; b++)
                  tokens[b] = _moe_sample_token (x + (gsize) b * V, V, filters[f].temperature, filters[f].top_k,
                                                 filters[f].top_p, rng);
              else
                {
                  _moe_sample_draws (rng, B, NULL, draws);
                  _moe_sample_tokens (x, B, V, &s, tokens);
                }
              ms[way][r] = (g_get_monotonic_time () - t0) / 1e3;
            }
        for (int way = 0; way < 2; way++)
          qsort (ms[way], reps, sizeof (double), by_value);
        printf ("| %s | %u | %.2f | %.2f | %.2f× |\n", filters[f].name, B, ms[0][reps / 2], ms[1][reps / 2],
                ms[0][reps / 2] / ms[1][reps / 2]);
      }
  g_free (x);
  return 0;
}
