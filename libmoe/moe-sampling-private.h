/* moe-sampling-private.h: do_sample's token choice (internal; the test
 * tests/c/test-sampling.c builds moe-sampling.c in itself)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <glib.h>

G_BEGIN_DECLS

/* One token drawn from a row of @V logits, as transformers' sampling: the
 * logits over @temperature, then the @top_k best (0: all; equal logits in
 * id order), then the fewest of those, best first, that hold @top_p of
 * their probability (at least one), then a draw from @rng over the kept
 * tokens' probabilities, walking them best first (with neither filter:
 * every token, in id order, so that nothing is sorted) */
guint _moe_sample_token (const float *logits,
                         gint64       V,
                         double       temperature,
                         guint        top_k,
                         double       top_p,
                         GRand       *rng);

/* The tokens _moe_sample_token () gives, called for each of @B rows of @V
 * logits in turn — row i's into @tokens[i], rows with @skip[i] set (@skip
 * may be NULL) left alone, one draw from @rng a sampled row in row order —
 * with the rows shared among threads */
void _moe_sample_tokens (const float    *logits,
                         guint           B,
                         gint64          V,
                         const gboolean *skip,
                         double          temperature,
                         guint           top_k,
                         double          top_p,
                         GRand          *rng,
                         gint64         *tokens);

G_END_DECLS
