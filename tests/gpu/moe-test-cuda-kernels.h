/* moe-test-cuda-kernels.h: what the GPU tests that link the kernels
 * directly (test-cuda-attention, test-cuda-rope) share — 16-bit values made
 * and read on the host, copies to and from the device, the skip where
 * there is none.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <string.h>
#include <glib.h>
#include <cuda_runtime_api.h>

#include "moe-cuda-experts.h"   /* MOE_CUDA_F16 */

/* float to bf16 or f16 (@dtype), rounded to nearest even */
static inline guint16
moe_test_to_16 (int dtype, float v)
{
  guint32 u;

  if (dtype == MOE_CUDA_F16)
    {
      _Float16 h = (_Float16) v;
      guint16 r;
      memcpy (&r, &h, 2);
      return r;
    }
  memcpy (&u, &v, 4);
  return (guint16) ((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline double
moe_test_from_16 (int dtype, guint16 v)
{
  if (dtype == MOE_CUDA_F16)
    {
      _Float16 h;
      memcpy (&h, &v, 2);
      return (double) h;
    }
  guint32 u = (guint32) v << 16;
  float f;
  memcpy (&f, &u, 4);
  return f;
}

static inline void *
moe_test_to_device (const void *host, gsize bytes)
{
  void *dev = NULL;
  g_assert_cmpint (cudaMalloc (&dev, bytes), ==, cudaSuccess);
  g_assert_cmpint (cudaMemcpy (dev, host, bytes, cudaMemcpyHostToDevice), ==, cudaSuccess);
  return dev;
}

static inline void *
moe_test_to_host (const void *dev, gsize bytes)
{
  void *host = g_malloc (bytes);
  g_assert_cmpint (cudaMemcpy (host, dev, bytes, cudaMemcpyDeviceToHost), ==, cudaSuccess);
  return host;
}

/* TRUE where there is a CUDA device; else says so (the test then exits 77) */
static inline gboolean
moe_test_have_cuda_device (void)
{
  int n = 0;

  if (cudaGetDeviceCount (&n) != cudaSuccess || n == 0)
    {
      g_print ("no CUDA device\n");
      return FALSE;
    }
  return TRUE;
}
