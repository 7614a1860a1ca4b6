/* moe-sampling.c: do_sample's choice of a token from a row of logits
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe-sampling-private.h"

/* Whether token a comes before token b in the sampling order: higher
 * (scaled) logit first, the lower id first among equals */
static inline gboolean
ranks_before (const double *p, guint a, guint b)
{
  return p[a] > p[b] || (p[a] == p[b] && a < b);
}

static int
compare_rank (gconstpointer a, gconstpointer b, gpointer data)
{
  guint x = *(const guint *) a, y = *(const guint *) b;

  return ranks_before (data, x, y) ? -1 : ranks_before (data, y, x) ? 1 : 0;
}

/* Beyond this many tokens of a @V-token vocabulary, first_in_order sorts
 * them all: its heap's replacements cost more than the sort there */
#define HEAP_MAX(V) ((V) / 64)

/* a double's bits as an unsigned integer in the doubles' order (−0 as 0) */
static inline guint64
order_key (double x)
{
  guint64 b;

  x += 0.0;
  memcpy (&b, &x, sizeof b);
  return b >> 63 ? ~b : b | G_GUINT64_CONSTANT (1) << 63;
}

/* Every token of a @V-token vocabulary into @top in the sampling order: a
 * stable radix sort of the ids in order, 16 bits of the keys'
 * complements a pass from the lowest (the larger first, equals in id
 * order) — where comparing tokens took ~26 ms for 151,936 of them */
static void
all_in_order (const double *p, guint V, guint *top)
{
  g_autofree guint64 *keys = g_new (guint64, 2 * (gsize) V);
  g_autofree guint *ids = g_new (guint, V);
  g_autofree guint *count = g_new (guint, 1 << 16);
  guint64 *k_src = keys, *k_dst = keys + V;
  guint *i_src = top, *i_dst = ids;

  for (guint v = 0; v < V; v++)
    {
      top[v] = v;
      keys[v] = ~order_key (p[v]);
    }
  for (int shift = 0; shift < 64; shift += 16)
    {
      guint at = 0;

      memset (count, 0, sizeof (guint) << 16);
      for (guint i = 0; i < V; i++)
        count[(k_src[i] >> shift) & 0xffff]++;
      if (count[(k_src[0] >> shift) & 0xffff] == V)
        continue;   /* one digit for all: nothing moves */
      for (guint d = 0; d < 1 << 16; d++)
        {
          guint c = count[d];
          count[d] = at;
          at += c;
        }
      for (guint i = 0; i < V; i++)
        {
          guint j = count[(k_src[i] >> shift) & 0xffff]++;
          k_dst[j] = k_src[i];
          i_dst[j] = i_src[i];
        }
      { guint64 *t = k_src; k_src = k_dst; k_dst = t; }
      { guint *t = i_src; i_src = i_dst; i_dst = t; }
    }
  if (i_src != top)
    memcpy (top, i_src, V * sizeof (guint));
}

/* The first @m tokens of the sampling order into @top (V of them), in
 * order: a heap of the best @m so far (its root the last of them) over one
 * pass of the vocabulary, then that heap sorted: O(V log m); past
 * HEAP_MAX, all of them by all_in_order (). */
static void
first_in_order (const double *p, guint V, guint m, guint *top)
{
  guint n = 0;

  if (m > HEAP_MAX (V))
    {
      all_in_order (p, V, top);
      return;
    }
  for (guint v = 0; v < V; v++)
    {
      guint i;

      if (n < m)
        {
          /* sift up: the heap's root is its last token in the order */
          for (i = n++; i > 0 && ranks_before (p, top[(i - 1) / 2], v); i = (i - 1) / 2)
            top[i] = top[(i - 1) / 2];
          top[i] = v;
        }
      else if (ranks_before (p, v, top[0]))
        {
          /* replace the root, sift down */
          for (i = 0;;)
            {
              guint c = 2 * i + 1;
              if (c >= m)
                break;
              if (c + 1 < m && ranks_before (p, top[c], top[c + 1]))
                c++;
              if (!ranks_before (p, v, top[c]))
                break;
              top[i] = top[c];
              i = c;
            }
          top[i] = v;
        }
    }
  g_qsort_with_data (top, m, sizeof (guint), compare_rank, (gpointer) p);
}

static int
compare_id (gconstpointer a, gconstpointer b)
{
  guint x = *(const guint *) a, y = *(const guint *) b;

  return x < y ? -1 : x > y;
}

/* @top's first @n tokens (of a @V-token vocabulary) put in id order: a
 * sort where they are few, one pass over the vocabulary where many */
static void
in_id_order (guint *top, guint n, guint V)
{
  g_autofree guint8 *kept = NULL;
  guint i = 0;

  if (n <= HEAP_MAX (V))
    {
      qsort (top, n, sizeof (guint), compare_id);
      return;
    }
  kept = g_new0 (guint8, V);
  for (guint j = 0; j < n; j++)
    kept[top[j]] = 1;
  for (guint v = 0; v < V; v++)
    if (kept[v])
      top[i++] = v;
}

/* token v's unnormalized probability, from @w where it is kept there */
static inline double
weight (const double *p, const double *w, double max, guint v)
{
  return w != NULL ? w[v] : exp (p[v] - max);
}

/* _moe_sample_token () with its one draw @u (uniform on [0, 1)) taken
 * before: the same token, as nothing else draws */
static guint
sample_with_draw (const float *logits,
                  gint64       V,
                  double       temperature,
                  guint        top_k,
                  double       top_p,
                  double       u)
{
  g_autofree guint *order = NULL;
  g_autofree double *p = g_new (double, V), *w = NULL;
  double max = -INFINITY, sum = 0, acc = 0, r;
  guint n, m;

  for (gint64 v = 0; v < V; v++)
    {
      p[v] = logits[v] / temperature;
      max = MAX (max, p[v]);
    }
  n = top_k > 0 ? (guint) MIN ((gint64) top_k, V) : (guint) V;

  if (n == V && top_p >= 1.0)
    {
      /* p becomes the unnormalized probabilities: nothing ranks them here */
      for (gint64 v = 0; v < V; v++)
        sum += (p[v] = exp (p[v] - max));
      r = u * sum;
      for (gint64 v = 0; v < V; v++)
        {
          acc += p[v];
          if (r < acc)
            return v;
        }
      return V - 1;
    }

  /* the kept tokens lie in the order's first n (top-k); with top-p alone,
   * in as many as hold top_p of the probability (over the vocabulary,
   * summed in id order, each token's kept in w for what follows): the
   * first 256, 2048, … of them until those do, or all */
  if (n == V)
    {
      w = g_new (double, V);
      for (gint64 v = 0; v < V; v++)
        sum += w[v] = exp (p[v] - max);
    }
  order = g_new (guint, V);
  for (m = n < V ? n : MIN (n, 256);; m = m * 8 > HEAP_MAX (n) ? n : m * 8)
    {
      /* m tokens hold at most m / sum (the best's probability is 1 / sum) */
      if (m < n && m / sum < top_p)
        continue;
      first_in_order (p, V, m, order);
      if (m == n)
        break;
      acc = 0;
      for (guint i = 0; i < m && acc < top_p; i++)
        acc += weight (p, w, max, order[i]) / sum;
      if (acc >= top_p)
        break;
    }
  if (top_p < 1.0)
    {
      guint keep = 0;

      if (n < V)
        {
          /* top-k: the probabilities over the k */
          sum = 0;
          for (guint i = 0; i < n; i++)
            sum += weight (p, w, max, order[i]);
        }
      acc = 0;
      for (; keep < m; keep++)
        {
          acc += weight (p, w, max, order[keep]) / sum;
          if (acc >= top_p)
            {
              keep++;
              break;
            }
        }
      n = MAX (MIN (keep, m), 1);
    }
  /* the draw walks the kept tokens in id order, as torch.multinomial does
   * over transformers' masked probabilities (and a device can, with no
   * sort of what it keeps) */
  in_id_order (order, n, V);
  sum = 0;
  for (guint i = 0; i < n; i++)
    sum += weight (p, w, max, order[i]);
  r = u * sum;
  acc = 0;
  for (guint i = 0; i < n; i++)
    {
      acc += weight (p, w, max, order[i]);
      if (r < acc)
        return order[i];
    }
  return order[n - 1];
}

guint
_moe_sample_token (const float *logits,
                   gint64       V,
                   double       temperature,
                   guint        top_k,
                   double       top_p,
                   GRand       *rng)
{
  return sample_with_draw (logits, V, temperature, top_k, top_p, g_rand_double (rng));
}

void
_moe_sample_draws (GRand          *rng,
                   guint           B,
                   const gboolean *skip,
                   double         *draws)
{
  for (guint i = 0; i < B; i++)
    draws[i] = skip != NULL && skip[i] ? -1.0 : g_rand_double (rng);
}

typedef struct {
  const float *logits;
  gint64 V;
  const MoeSampling *s;
  guint n;                  /* rows to sample */
  const guint *rows;        /* their indexes */
  gint64 *tokens;
  gint next;                /* the next of them to take (atomic) */
} Rows;

static gpointer
sample_rows (gpointer data)
{
  Rows *r = data;
  const MoeSampling *s = r->s;

  for (guint j; (j = (guint) g_atomic_int_add (&r->next, 1)) < r->n;)
    r->tokens[r->rows[j]] = sample_with_draw (r->logits + (gsize) r->rows[j] * r->V, r->V, s->temperature,
                                              s->top_k, s->top_p, s->draws[r->rows[j]]);
  return NULL;
}

/* Rows shorter than this are sampled on the calling thread alone: a row of
 * V logits takes some V × 2-8 ns */
#define SAMPLE_THREADS_MIN_V 16384

/* (A row of Qwen's 151,936 logits takes ~0.3 ms with Qwen's top-k and
 * top-p, ~1.0-1.3 with no filter and ~2.6 with top-p alone on the
 * development machine's CPU: one after another, a batch-8 step's 3-17 ms
 * beside an H100's 5.5 ms forward; tools/moe-bench-sampling.) */
void
_moe_sample_tokens (const float       *logits,
                    guint              B,
                    gint64             V,
                    const MoeSampling *s,
                    gint64            *tokens)
{
  g_autofree guint *rows = g_new (guint, B);
  GThread *threads[16] = { NULL, };
  Rows r = { logits, V, s, 0, rows, tokens, 0 };
  guint workers;

  for (guint i = 0; i < B; i++)
    if (s->draws[i] >= 0)
      rows[r.n++] = i;
  /* this thread and the others: one a row at most, no more than the
   * processors (one that cannot start leaves its rows to the rest); short
   * rows all here, as starting a thread (tens of µs) costs more than one */
  workers = V < SAMPLE_THREADS_MIN_V ? 1 : MIN (r.n, MIN ((guint) g_get_num_processors (), G_N_ELEMENTS (threads)));
  for (guint t = 1; t < workers; t++)
    threads[t] = g_thread_try_new ("moe-sample", sample_rows, &r, NULL);
  sample_rows (&r);
  for (guint t = 1; t < workers; t++)
    if (threads[t] != NULL)
      g_thread_join (threads[t]);
}
