/* moe-sampling-private.h: do_sample's token choice (internal; the test
 * tests/c/test-sampling.c builds moe-sampling.c in itself)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <glib.h>

G_BEGIN_DECLS

/* do_sample's settings for a step's rows, and each row's one draw (uniform
 * on [0, 1); negative: the row is not sampled) */
typedef struct {
  double        temperature;
  guint         top_k;         /* 0: no top-k */
  double        top_p;         /* 1: no top-p */
  const double *draws;         /* [B] */
} MoeSampling;

/* One token drawn from a row of @V logits, as transformers' sampling: the
 * logits over @temperature, then the @top_k best (0: all; equal logits in
 * id order), then the fewest of those, best first, that hold @top_p of
 * their probability (at least one), then a draw from @rng over the kept
 * tokens' probabilities, walking them in id order (as torch.multinomial
 * over the masked probabilities) */
guint _moe_sample_token (const float *logits,
                         gint64       V,
                         double       temperature,
                         guint        top_k,
                         double       top_p,
                         GRand       *rng);

/* One draw from @rng for each of @B rows not @skip[i] (@skip may be NULL),
 * in row order, into @draws; -1 for the others */
void _moe_sample_draws (GRand          *rng,
                        guint           B,
                        const gboolean *skip,
                        double         *draws);

/* The tokens _moe_sample_token () gives, for each of @B rows of @V logits
 * with its draw from @s — row i's into @tokens[i], rows not sampled left
 * alone — with the rows shared among threads */
void _moe_sample_tokens (const float       *logits,
                         guint              B,
                         gint64             V,
                         const MoeSampling *s,
                         gint64            *tokens);

G_END_DECLS
