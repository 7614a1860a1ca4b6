/* test-sampling.c: do_sample's token choice (libmoe/moe-sampling.c, built
 * into this test) against the plain statement of it: every token sorted,
 * the filters applied in that order, the draw walked over the kept tokens.
 * The same draws must give the same tokens, on a vocabulary of Qwen's size
 * and on small ones, with ties, for each filter alone and together.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <string.h>
#include <glib.h>

#include "moe-sampling-private.h"
#include "moe-test-logits.h"

typedef struct {
  double temperature;
  guint  top_k;
  double top_p;
} Filters;

static int
by_rank (gconstpointer a, gconstpointer b, gpointer data)
{
  const double *p = data;
  guint x = *(const guint *) a, y = *(const guint *) b;

  if (p[x] != p[y])
    return p[x] > p[y] ? -1 : 1;
  return x < y ? -1 : x > y;
}

static int
by_id (gconstpointer a, gconstpointer b, gpointer data)
{
  guint x = *(const guint *) a, y = *(const guint *) b;

  return x < y ? -1 : x > y;
}

/* transformers' warpers as written: scale, sort, keep the top k, keep the
 * fewest that hold top_p, draw over what is kept in id order */
static guint
reference (const float *logits, guint V, const Filters *f, GRand *rng)
{
  g_autofree double *p = g_new (double, V);
  g_autofree guint *order = g_new (guint, V);
  double max = -INFINITY, sum = 0, acc = 0, r;
  guint n = f->top_k > 0 ? MIN (f->top_k, V) : V;

  for (guint v = 0; v < V; v++)
    {
      p[v] = logits[v] / f->temperature;
      max = MAX (max, p[v]);
      order[v] = v;
    }
  if (n == V && f->top_p >= 1.0)
    {
      for (guint v = 0; v < V; v++)
        sum += exp (p[v] - max);
      r = g_rand_double (rng) * sum;
      for (guint v = 0; v < V; v++)
        if (r < (acc += exp (p[v] - max)))
          return v;
      return V - 1;
    }
  g_qsort_with_data (order, V, sizeof (guint), by_rank, p);
  /* top-k's probabilities over the k; top-p alone's over the vocabulary,
   * summed in id order */
  if (n < V)
    for (guint i = 0; i < n; i++)
      sum += exp (p[order[i]] - max);
  else
    for (guint v = 0; v < V; v++)
      sum += exp (p[v] - max);
  if (f->top_p < 1.0)
    {
      guint keep = 0;
      while (keep < n)
        {
          acc += exp (p[order[keep++]] - max) / sum;
          if (acc >= f->top_p)
            break;
        }
      n = MAX (keep, 1);
    }
  /* the kept tokens' probabilities in id order, as torch.multinomial
   * walks them */
  g_qsort_with_data (order, n, sizeof (guint), by_id, NULL);
  sum = 0;
  for (guint i = 0; i < n; i++)
    sum += exp (p[order[i]] - max);
  r = g_rand_double (rng) * sum;
  acc = 0;
  for (guint i = 0; i < n; i++)
    if (r < (acc += exp (p[order[i]] - max)))
      return order[i];
  return order[n - 1];
}

/* @draws draws from one row of logits, each with its own seed, by both */
static void
check_row (const float *logits, guint V, const Filters *f, guint draws)
{
  for (guint d = 0; d < draws; d++)
    {
      g_autoptr(GRand) a = g_rand_new_with_seed (d + 1);
      g_autoptr(GRand) b = g_rand_new_with_seed (d + 1);
      guint got = _moe_sample_token (logits, V, f->temperature, f->top_k, f->top_p, a);
      guint want = reference (logits, V, f, b);

      if (got != want)
        g_error ("V %u, temperature %g, top-k %u, top-p %g, draw %u: token %u, expected %u", V, f->temperature,
                 f->top_k, f->top_p, d, got, want);
      /* each took one draw */
      g_assert_cmpuint (g_rand_int (a), ==, g_rand_int (b));
    }
}

static const Filters filters[] = {
  { 1.0, 0, 1.0 },    /* neither */
  { 0.7, 20, 1.0 },   /* top-k */
  { 1.0, 1, 1.0 },    /* top-k 1: greedy */
  { 1.0, 300, 1.0 },  /* top-k past the first 256 */
  { 0.7, 0, 0.9 },    /* top-p */
  { 2.0, 0, 0.95 },   /* top-p over a flatter distribution: more than 256 tokens */
  { 0.6, 0, 0.999 },  /* top-p: more than 2048 tokens where the vocabulary is large */
  { 0.7, 20, 0.8 },   /* Qwen's: both */
  { 1.0, 0, 0.0 },    /* top-p 0: the best token alone */
};

static void
test_vocabularies (void)
{
  static const guint sizes[] = { 1, 7, 256, 1000, 151936 };
  g_autoptr(GRand) rand = g_rand_new_with_seed (2026);

  for (guint s = 0; s < G_N_ELEMENTS (sizes); s++)
    for (guint shape = 0; shape < 3; shape++)
      {
        /* sharp, flat, and with ties */
        g_autofree float *x = moe_test_random_logits (rand, sizes[s], shape == 1 ? 0.5 : 3.0, shape == 2 ? 4 : 0);
        for (guint i = 0; i < G_N_ELEMENTS (filters); i++)
          check_row (x, sizes[s], &filters[i], sizes[s] > 10000 ? 2 : 40);
      }
}

/* The draws follow the probabilities: a two-token row at logits 0 and
 * log 3 gives the second three times in four. */
static void
test_distribution (void)
{
  const float x[2] = { 0.0f, (float) log (3.0) };
  const Filters f = { 1.0, 0, 1.0 };
  g_autoptr(GRand) rng = g_rand_new_with_seed (5);
  guint second = 0, n = 40000;

  for (guint i = 0; i < n; i++)
    second += _moe_sample_token (x, 2, f.temperature, f.top_k, f.top_p, rng);
  g_assert_cmpfloat (fabs (second / (double) n - 0.75), <, 0.01);
}

/* Rows at once (on threads): the tokens of one call a row, in row order,
 * the skipped rows left as they were and taking no draw */
static void
test_rows (void)
{
  static const guint sizes[] = { 7, 151936 };
  g_autoptr(GRand) rand = g_rand_new_with_seed (77);

  for (guint s = 0; s < G_N_ELEMENTS (sizes); s++)
    for (guint i = 0; i < G_N_ELEMENTS (filters); i++)
      {
        const guint B = 9, V = sizes[s];
        const gboolean skip[9] = { FALSE, TRUE, FALSE, FALSE, FALSE, TRUE, FALSE, FALSE, FALSE };
        const Filters *f = &filters[i];
        g_autofree float *x = g_new (float, (gsize) B * V);
        gint64 got[9];
        double draws[9];
        const MoeSampling sampling = { f->temperature, f->top_k, f->top_p, draws };
        g_autoptr(GRand) a = g_rand_new_with_seed (100 + i);
        g_autoptr(GRand) b = g_rand_new_with_seed (100 + i);

        for (guint r = 0; r < B; r++)
          {
            g_autofree float *row = moe_test_random_logits (rand, V, r % 2 ? 0.5 : 3.0, r % 3 == 2 ? 4 : 0);
            memcpy (x + (gsize) r * V, row, V * sizeof (float));
            got[r] = -7;
          }
        _moe_sample_draws (a, B, skip, draws);
        _moe_sample_tokens (x, B, V, &sampling, got);
        for (guint r = 0; r < B; r++)
          {
            gint64 want = skip[r] ? -7 : (gint64) _moe_sample_token (x + (gsize) r * V, V, f->temperature, f->top_k,
                                                                     f->top_p, b);
            if (got[r] != want)
              g_error ("V %u, filters %u, row %u: token %" G_GINT64_FORMAT ", expected %" G_GINT64_FORMAT, V, i, r,
                       got[r], want);
          }
        /* one draw a sampled row */
        g_assert_cmpuint (g_rand_int (a), ==, g_rand_int (b));
      }
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);
  g_test_add_func ("/sampling/vocabularies", test_vocabularies);
  g_test_add_func ("/sampling/distribution", test_distribution);
  g_test_add_func ("/sampling/rows", test_rows);
  return g_test_run ();
}
