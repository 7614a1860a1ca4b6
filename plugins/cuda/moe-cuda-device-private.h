/* moe-cuda-device-private.h: the cuda device's state, shared by its
 * experts (moe-cuda-device.c) and whole-model (moe-cuda-decoder.c) halves
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>

#include <moe-plugin.h>

G_BEGIN_DECLS

#define MOE_TYPE_CUDA_DEVICE (moe_cuda_device_get_type ())
G_DECLARE_FINAL_TYPE (MoeCudaDevice, moe_cuda_device, MOE, CUDA_DEVICE, MoeDevice)

struct _MoeCudaDevice
{
  MoeDevice       parent_instance;

  cudaStream_t    stream;
  cublasHandle_t  cublas;
  char           *init_error;    /* why the stream or cuBLAS could not be made */

  /* cuBLASLt, for projections with a bias in the GEMM's epilogue: made by
   * the first decoder (NULL: not yet, or it could not be; the decoder then
   * adds the bias as before), with its workspace and the plans made so far,
   * all under @lock */
  cublasLtHandle_t lt;
  void           *lt_workspace;
  GHashTable     *lt_plans;      /* LtKey -> LtPlan */

  /* the experts kernels check the ids on the device and report the first
   * bad one here (mapped host memory), read at the next synchronization */
  volatile long long *bad_id;    /* {t * K + k + 1, id}, or {0, …} */
  long long      *bad_id_device;
  int             bad_id_experts, bad_id_top_k;   /* of the latest forward */

  GMutex          lock;          /* the allocator's tables, the cuBLAS handle, bad_id */
  GRecMutex       exclusive;     /* held by a decoder step and an experts forward: what one
                                    thread queues is not interleaved with another's, so
                                    that a CUDA graph captures only its own work */
  gboolean        graph_pool_open;  /* blocks freed now belong to the graph being captured */
  GSList         *graph_pool;
  GHashTable     *in_use;        /* device pointer -> its size class */
  GHashTable     *free_blocks;   /* size class -> GSList of device pointers */

  int             cc_major, cc_minor;   /* compute capability */
  char           *gpu_name;

  /* deepgemm: the toolkit its kernels are compiled with (found on the
   * first forward that needs it) and the kernels compiled so far */
  GMutex          jit_lock;
  MoeCudaToolkit  toolkit;
  gboolean        have_toolkit;
  GHashTable     *jit_kernels;   /* "fp8|bf16 H I" -> JitKernels */
};

gboolean moe_cuda_check              (cudaError_t    err,
                                      const char    *what,
                                      GError       **error);

/* A CUDA graph's memory: blocks freed while it is captured stay the
 * graph's (its replays use them) until it is destroyed. */
void     moe_cuda_device_open_graph_pool    (MoeCudaDevice *self);
GSList  *moe_cuda_device_close_graph_pool   (MoeCudaDevice *self);
void     moe_cuda_device_release_graph_pool (MoeCudaDevice *self,
                                             GSList        *pool);

/* y [rows, out] = x [rows, in] (rows @ldx elements apart) · wᵀ + bias on
 * cuBLASLt, the bias added in its epilogue in float32 before the one
 * rounding (as torch's linear on CUDA), on the device's stream */
typedef struct {
  cudaDataType_t type;          /* of w, x and bias */
  cudaDataType_t out_type;      /* of y */
  int            out, rows, in, ldx;
  const void    *w, *x, *bias;  /* w [out, in], bias [out] */
  void          *y;
} MoeCudaBiasedGemm;

gboolean moe_cuda_device_prepare_lt  (MoeCudaDevice *self);
gboolean moe_cuda_device_biased_gemm (MoeCudaDevice           *self,
                                      const MoeCudaBiasedGemm *g,
                                      gboolean                *ran,
                                      GError                 **error);

/* moe-cuda-decoder.c: MoeDeviceClass's decoder vfuncs */
gpointer moe_cuda_decoder_new        (MoeDevice     *device,
                                      gconstpointer  model,
                                      GError       **error);
void     moe_cuda_decoder_free       (MoeDevice     *device,
                                      gpointer       decoder);
gboolean moe_cuda_decoder_forward    (MoeDevice     *device,
                                      gpointer       decoder,
                                      gpointer       step,
                                      GError       **error);
void     moe_cuda_decoder_cache_free (MoeDevice     *device,
                                      gpointer       cache);

G_END_DECLS
