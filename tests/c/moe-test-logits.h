/* moe-test-logits.h: rows of logits for the sampling tests (test-sampling
 * on the host, test-cuda-sampling on the device)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <math.h>
#include <glib.h>

/* @V logits: a peaked (normal, spread @spread) row; with @levels > 0 only
 * that many distinct values (ties everywhere) */
static inline float *
moe_test_random_logits (GRand *rand, guint V, double spread, guint levels)
{
  float *x = g_new (float, V);

  for (guint v = 0; v < V; v++)
    {
      /* Box-Muller */
      double u = g_rand_double_range (rand, 1e-12, 1.0), w = g_rand_double (rand);
      double z = sqrt (-2.0 * log (u)) * cos (2 * G_PI * w) * spread;
      x[v] = levels > 0 ? (float) floor (z * levels / 8.0) : (float) z;
    }
  return x;
}
