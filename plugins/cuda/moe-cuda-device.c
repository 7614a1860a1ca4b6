/* moe-cuda-device.c: the "cuda" device
 *
 * One GPU (the first one CUDA_VISIBLE_DEVICES leaves), one stream that all
 * work and copies go on, a caching allocator (freed blocks are kept by size
 * class and reused; they are stream-ordered, so reusing a block whose last
 * kernel has not run yet is safe), and the experts schedules of
 * kernels/moe-cuda-experts.cu.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>

#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>

#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

#include "moe-cuda-experts.h"

#include "moe-cuda-device-private.h"

typedef struct {
  cudaLibrary_t library;
  cudaKernel_t  gate_up, down, tma_gate_up, tma_down, tall_gate_up, tall_down, large_gate_up, large_down;
} JitKernels;

G_DEFINE_FINAL_TYPE (MoeCudaDevice, moe_cuda_device, MOE_TYPE_DEVICE)

gboolean
moe_cuda_check (cudaError_t   err,
            const char   *what,
            GError      **error)
{
  if (err == cudaSuccess)
    return TRUE;
  g_set_error (error, MOE_ERROR,
               err == cudaErrorMemoryAllocation ? MOE_ERROR_OUT_OF_MEMORY : MOE_ERROR_FAILED,
               "CUDA: %s failed: %s", what, cudaGetErrorString (err));
  return FALSE;
}

static gboolean
device_ready (MoeCudaDevice  *self,
              GError        **error)
{
  if (self->init_error == NULL)
    return TRUE;
  g_set_error (error, MOE_ERROR, MOE_ERROR_NO_DEVICE, "%s", self->init_error);
  return FALSE;
}

/* Small blocks round to 512 bytes, large ones to 2 MiB, so that the freed
 * blocks of one forward are reused by the next. */
static gsize
size_class (gsize size)
{
  gsize align = size <= (1u << 20) ? 512 : (2u << 20);
  return (MAX (size, 1) + align - 1) / align * align;
}

static void
release_cached_locked (MoeCudaDevice *self)
{
  GHashTableIter iter;
  gpointer list;

  g_hash_table_iter_init (&iter, self->free_blocks);
  while (g_hash_table_iter_next (&iter, NULL, &list))
    {
      for (GSList *l = list; l != NULL; l = l->next)
        cudaFree (l->data);
      g_slist_free (list);
    }
  g_hash_table_remove_all (self->free_blocks);
}

static gpointer
cuda_alloc (MoeDevice  *device,
            gsize       size,
            GError    **error)
{
  MoeCudaDevice *self = MOE_CUDA_DEVICE (device);
  gsize cls = size_class (size);
  gpointer ptr = NULL;
  GSList *list;
  cudaError_t err;

  if (!device_ready (self, error))
    return NULL;

  g_mutex_lock (&self->lock);
  list = g_hash_table_lookup (self->free_blocks, GSIZE_TO_POINTER (cls));
  if (list != NULL)
    {
      ptr = list->data;
      g_hash_table_insert (self->free_blocks, GSIZE_TO_POINTER (cls), g_slist_delete_link (list, list));
    }
  else
    {
      err = cudaMalloc (&ptr, cls);
      if (err == cudaErrorMemoryAllocation)
        {
          /* give the cached blocks back and try once more */
          cudaGetLastError ();
          cudaStreamSynchronize (self->stream);
          release_cached_locked (self);
          err = cudaMalloc (&ptr, cls);
        }
      if (err != cudaSuccess)
        {
          size_t free_b = 0, total_b = 0;
          cudaGetLastError ();
          cudaMemGetInfo (&free_b, &total_b);
          g_mutex_unlock (&self->lock);
          g_set_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY,
                       "CUDA: could not allocate %" G_GSIZE_FORMAT " bytes of device memory "
                       "(%zu of %zu bytes free): %s", size, free_b, total_b, cudaGetErrorString (err));
          return NULL;
        }
    }
  g_hash_table_insert (self->in_use, ptr, GSIZE_TO_POINTER (cls));
  g_mutex_unlock (&self->lock);
  return ptr;
}

static void
cuda_free (MoeDevice *device,
           gpointer   ptr)
{
  MoeCudaDevice *self = MOE_CUDA_DEVICE (device);
  gpointer cls;

  if (ptr == NULL)
    return;
  g_mutex_lock (&self->lock);
  if (self->graph_pool_open && g_hash_table_contains (self->in_use, ptr))
    /* a CUDA graph being captured uses this block: it stays its own */
    self->graph_pool = g_slist_prepend (self->graph_pool, ptr);
  else if (g_hash_table_steal_extended (self->in_use, ptr, NULL, &cls))
    {
      GSList *list = g_hash_table_lookup (self->free_blocks, cls);
      g_hash_table_insert (self->free_blocks, cls, g_slist_prepend (list, ptr));
    }
  else
    g_critical ("moe-cuda: freeing %p, which this device did not allocate", ptr);
  g_mutex_unlock (&self->lock);
}

void
moe_cuda_device_open_graph_pool (MoeCudaDevice *self)
{
  g_mutex_lock (&self->lock);
  g_assert (!self->graph_pool_open);
  self->graph_pool_open = TRUE;
  self->graph_pool = NULL;
  g_mutex_unlock (&self->lock);
}

GSList *
moe_cuda_device_close_graph_pool (MoeCudaDevice *self)
{
  GSList *pool;

  g_mutex_lock (&self->lock);
  self->graph_pool_open = FALSE;
  pool = g_steal_pointer (&self->graph_pool);
  g_mutex_unlock (&self->lock);
  return pool;
}

void
moe_cuda_device_release_graph_pool (MoeCudaDevice *self,
                                    GSList        *pool)
{
  /* a replay may still be running */
  cudaStreamSynchronize (self->stream);
  g_mutex_lock (&self->lock);
  for (GSList *l = pool; l != NULL; l = l->next)
    {
      gpointer cls;
      if (g_hash_table_steal_extended (self->in_use, l->data, NULL, &cls))
        {
          GSList *list = g_hash_table_lookup (self->free_blocks, cls);
          g_hash_table_insert (self->free_blocks, cls, g_slist_prepend (list, l->data));
        }
    }
  g_mutex_unlock (&self->lock);
  g_slist_free (pool);
}

/* ------------------------------------------------------------------ */
/* cuBLASLt: biased projections                                        */

/* what a plan depends on: its shape, dtypes and the pointers' alignment
 * (the heuristic assumes it) */
typedef struct {
  int type, out_type, out, rows, in, ldx, align;
} LtKey;

/* a matmul descriptor and layouts for one key, and the heuristic's algorithm
 * for them (none: the caller takes cublasGemmEx) */
typedef struct {
  LtKey                  key;
  cublasLtMatmulDesc_t   desc;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t   algo;
  gboolean               have_algo;
} LtPlan;

#define LT_WORKSPACE (32u << 20)
/* a prefill of each new length adds a plan per biased shape: start over
 * past this many */
#define LT_MAX_PLANS 512

static guint
lt_key_hash (gconstpointer p)
{
  const int *k = p;
  guint h = 5381;

  for (guint i = 0; i < sizeof (LtKey) / sizeof (int); i++)
    h = h * 33 + (guint) k[i];
  return h;
}

static gboolean
lt_key_equal (gconstpointer a, gconstpointer b)
{
  return memcmp (a, b, sizeof (LtKey)) == 0;
}

static void
lt_plan_free (gpointer data)
{
  LtPlan *p = data;

  if (p->desc != NULL)
    cublasLtMatmulDescDestroy (p->desc);
  if (p->a != NULL)
    cublasLtMatrixLayoutDestroy (p->a);
  if (p->b != NULL)
    cublasLtMatrixLayoutDestroy (p->b);
  if (p->c != NULL)
    cublasLtMatrixLayoutDestroy (p->c);
  g_free (p);
}

/* The handle and its workspace, once (a decoder's load, outside any
 * graph capture); FALSE where they cannot be made: the decoder's
 * projections then add their biases as before. */
gboolean
moe_cuda_device_prepare_lt (MoeCudaDevice *self)
{
  gboolean ok;

  if (self->init_error != NULL)
    return FALSE;
  g_mutex_lock (&self->lock);
  if (self->lt == NULL && self->lt_plans == NULL)
    {
      cublasLtHandle_t lt = NULL;
      cublasStatus_t st = cublasLtCreate (&lt);
      cudaError_t err = st == CUBLAS_STATUS_SUCCESS ? cudaMalloc (&self->lt_workspace, LT_WORKSPACE) : cudaSuccess;
      if (st == CUBLAS_STATUS_SUCCESS && err == cudaSuccess)
        self->lt = lt;
      else
        {
          g_debug ("moe-cuda: no cuBLASLt (status %d, %s); biases added by a kernel", (int) st,
                   cudaGetErrorString (err));
          cudaGetLastError ();
          self->lt_workspace = NULL;
          if (lt != NULL)
            cublasLtDestroy (lt);
        }
      /* also marks the attempt made */
      self->lt_plans = g_hash_table_new_full (lt_key_hash, lt_key_equal, NULL, lt_plan_free);
    }
  ok = self->lt != NULL;
  g_mutex_unlock (&self->lock);
  return ok;
}

/* Column-major, the operands of the decoder's cublasGemmEx call: yᵀ
 * [out, rows] = Aᵀ · B, A = w seen as [in, out], B = x as [in, rows] (@ldx
 * apart), C = D = yᵀ. */
static LtPlan *
lt_plan_new (MoeCudaDevice *self, const LtKey *key, const MoeCudaBiasedGemm *g)
{
  LtPlan *p = g_new0 (LtPlan, 1);
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  const uint64_t workspace = LT_WORKSPACE;
  const uint32_t align = (uint32_t) key->align;
  const cublasLtMatmulPreferenceAttributes_t aligns[] = {
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
  };
  cublasLtMatmulPreference_t pref = NULL;
  cublasLtMatmulHeuristicResult_t result = { 0 };
  int found = 0;
  gboolean ok;

#define OK(call) ((call) == CUBLAS_STATUS_SUCCESS)
  p->key = *key;
  /* float32 accumulation and scale (no TF32); the bias's dtype is left at
   * its default, the output's: the model dtype, as the biases are */
  ok = OK (cublasLtMatmulDescCreate (&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) &&
       OK (cublasLtMatmulDescSetAttribute (p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a)) &&
       OK (cublasLtMatmulDescSetAttribute (p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b)) &&
       OK (cublasLtMatmulDescSetAttribute (p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue)) &&
       /* the heuristic reads the bias pointer's alignment */
       OK (cublasLtMatmulDescSetAttribute (p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias, sizeof g->bias)) &&
       OK (cublasLtMatrixLayoutCreate (&p->a, g->type, g->in, g->out, g->in)) &&
       OK (cublasLtMatrixLayoutCreate (&p->b, g->type, g->in, g->rows, g->ldx)) &&
       OK (cublasLtMatrixLayoutCreate (&p->c, g->out_type, g->out, g->rows, g->out)) &&
       OK (cublasLtMatmulPreferenceCreate (&pref)) &&
       OK (cublasLtMatmulPreferenceSetAttribute (pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &workspace, sizeof workspace));
  for (guint i = 0; ok && i < G_N_ELEMENTS (aligns); i++)
    ok = OK (cublasLtMatmulPreferenceSetAttribute (pref, aligns[i], &align, sizeof align));
  ok = ok && OK (cublasLtMatmulAlgoGetHeuristic (self->lt, p->desc, p->a, p->b, p->c, p->c, pref, 1,
                                                 &result, &found));
#undef OK
  if (pref != NULL)
    cublasLtMatmulPreferenceDestroy (pref);
  p->have_algo = ok && found > 0 && result.state == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= LT_WORKSPACE;
  if (p->have_algo)
    p->algo = result.algo;
  else
    g_debug ("moe-cuda: no cuBLASLt algorithm for a %d×%d×%d biased projection; bias by a kernel",
             g->rows, g->out, g->in);
  return p;
}

/* @g on cuBLASLt with the plan of its key (made on its first call: the
 * heuristic is asked once a shape). *@ran FALSE, and no error, where
 * there is no cuBLASLt or no algorithm for it; FALSE with @error where the
 * matmul fails. */
gboolean
moe_cuda_device_biased_gemm (MoeCudaDevice           *self,
                             const MoeCudaBiasedGemm *g,
                             gboolean                *ran,
                             GError                 **error)
{
  guintptr bits = (guintptr) g->w | (guintptr) g->x | (guintptr) g->bias | (guintptr) g->y;
  LtKey key = {
    .type = g->type, .out_type = g->out_type, .out = g->out, .rows = g->rows, .in = g->in, .ldx = g->ldx,
    .align = (int) MIN (bits & -bits, 256),
  };
  const float one = 1.0f, zero = 0.0f;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  LtPlan *p;

  *ran = FALSE;
  g_mutex_lock (&self->lock);
  if (self->lt == NULL)
    {
      g_mutex_unlock (&self->lock);
      return TRUE;
    }
  p = g_hash_table_lookup (self->lt_plans, &key);
  if (p == NULL)
    {
      if (g_hash_table_size (self->lt_plans) >= LT_MAX_PLANS)
        g_hash_table_remove_all (self->lt_plans);
      p = lt_plan_new (self, &key, g);
      g_hash_table_insert (self->lt_plans, &p->key, p);
    }
  if (p->have_algo)
    {
      st = cublasLtMatmulDescSetAttribute (p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias, sizeof g->bias);
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmul (self->lt, p->desc, &one, g->w, p->a, g->x, p->b, &zero, g->y, p->c, g->y, p->c,
                             &p->algo, self->lt_workspace, LT_WORKSPACE, self->stream);
      *ran = TRUE;
    }
  g_mutex_unlock (&self->lock);
  if (st != CUBLAS_STATUS_SUCCESS)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED, "cuBLASLt: a %d×%d×%d biased projection failed (status %d)",
                   g->rows, g->out, g->in, (int) st);
      return FALSE;
    }
  return TRUE;
}

static gboolean
cuda_copy_from_host (MoeDevice      *device,
                     gpointer        dst,
                     gconstpointer   src,
                     gsize           size,
                     GError        **error)
{
  MoeCudaDevice *self = MOE_CUDA_DEVICE (device);

  /* from pageable memory the call returns once @src has been staged, so the
   * caller may free it at once */
  return device_ready (self, error) &&
         moe_cuda_check (cudaMemcpyAsync (dst, src, size, cudaMemcpyHostToDevice, self->stream),
                     "copy to the device", error);
}

/* After a synchronization: reports (once) a bad id a kernel saw. */
static gboolean
check_bad_id (MoeCudaDevice  *self,
              GError        **error)
{
  long long pos, id;
  int E, K;

  g_mutex_lock (&self->lock);
  pos = self->bad_id[0];
  id = self->bad_id[1];
  E = self->bad_id_experts;
  K = MAX (self->bad_id_top_k, 1);
  self->bad_id[0] = 0;
  g_mutex_unlock (&self->lock);
  if (pos == 0)
    return TRUE;
  g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
               "An experts forward on cuda got top_k_index[%lld, %lld] = %lld; valid expert ids are "
               "0…%d, and %d for a slot that contributes nothing (that forward's output is wrong: "
               "the slot was left out)", (pos - 1) / K, (pos - 1) % K, id, E - 1, E);
  return FALSE;
}

static gboolean
cuda_copy_to_host (MoeDevice      *device,
                   gpointer        dst,
                   gconstpointer   src,
                   gsize           size,
                   GError        **error)
{
  MoeCudaDevice *self = MOE_CUDA_DEVICE (device);

  if (!device_ready (self, error))
    return FALSE;
  /* The driver's copy into fresh pageable memory takes its first-touch
   * faults one at a time: a forward's 1.24 GB of logits 0.87-1.14 s on the
   * H100 machine, faulted in first 174-258 ms (tools/cuda-host-copy-probe.cu:
   * huge pages, pinning for the copy, staging through pinned buffers were
   * all slower). While the device still runs the work queued before. */
  moe_cpu_fault_in (dst, size);
  return moe_cuda_check (cudaMemcpyAsync (dst, src, size, cudaMemcpyDeviceToHost, self->stream),
                         "copy to the host", error) &&
         moe_cuda_check (cudaStreamSynchronize (self->stream), "the work before a copy to the host", error) &&
         check_bad_id (self, error);
}

static gboolean
cuda_synchronize (MoeDevice  *device,
                  GError    **error)
{
  MoeCudaDevice *self = MOE_CUDA_DEVICE (device);

  return device_ready (self, error) &&
         moe_cuda_check (cudaStreamSynchronize (self->stream), "synchronize", error) &&
         check_bad_id (self, error);
}

static gboolean
is_gpu_float (MoeDType d)
{
  return d == MOE_DTYPE_F32 || d == MOE_DTYPE_BF16 || d == MOE_DTYPE_F16;
}

/* The schedules with requirements of their own. Each message names the
 * requirement, as transformers' errors do. */

static gboolean
wgmma_shapes_supported (MoeExperts  *experts,
                        const char  *who,
                        guint        multiple,
                        GError     **error)
{
  gint64 H = moe_experts_get_hidden_size (experts), I = moe_experts_get_intermediate_size (experts);

  if (moe_experts_get_is_transposed (experts))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "%s in libmoe runs non-transposed expert weights only (gate_up [E, 2I, H], "
                   "down [E, H, I]); these are transposed: use grouped_mm", who);
      return FALSE;
    }
  if (H % multiple != 0 || I % multiple != 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "%s needs the hidden and intermediate sizes to be multiples of %u (aligned rows for "
                   "the tensor cores' copies); these are %" G_GINT64_FORMAT " and %" G_GINT64_FORMAT
                   ": use grouped_mm", who, multiple, H, I);
      return FALSE;
    }
  return TRUE;
}

static gboolean
deepgemm_supported (MoeCudaDevice  *self,
                    MoeExperts     *experts,
                    GError        **error)
{
  MoeDType wd = moe_tensor_get_dtype (moe_experts_get_up_weight (experts));
  MoeTensor *scale = moe_experts_get_up_weight_scale (experts);
  gboolean ok;

  if (self->cc_major != 9 && self->cc_major != 10)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "DeepGEMM requires Hopper (SM90) or Blackwell (SM100); current device is SM%d%d (%s)",
                   self->cc_major, self->cc_minor, self->gpu_name);
      return FALSE;
    }
  g_mutex_lock (&self->jit_lock);
  if (!self->have_toolkit)
    self->have_toolkit = moe_cuda_toolkit_find (&self->toolkit, error);
  ok = self->have_toolkit &&
       moe_cuda_toolkit_require (&self->toolkit, 12, self->cc_major == 10 ? 9 : 3,
                                 self->cc_major == 10 ? "deepgemm on SM100" : "deepgemm on SM90", error);
  g_mutex_unlock (&self->jit_lock);
  if (!ok)
    return FALSE;
  if (wd == MOE_DTYPE_I8 && self->cc_major < 10)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "FP4 expert weights require SM100+ for deepgemm; this GPU is SM%d%d: use batched_mm or "
                   "grouped_mm, which run FP4 experts, or load with the dequantize option",
                   self->cc_major, self->cc_minor);
      return FALSE;
    }
  if (self->cc_major == 10)
    {
      if (wd == MOE_DTYPE_F8E4M3 && moe_tensor_get_dtype (scale) == MOE_DTYPE_F32)
        g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                     "deepgemm on SM100 needs UE8M0 expert scales (scale_fmt \"ue8m0\"); rounding these "
                     "float32 scales to powers of two would silently corrupt the output");
      else
        g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                     "libmoe's deepgemm kernels are written for SM90 (Hopper wgmma); SM100 (Blackwell) "
                     "kernels are not built yet: use grouped_mm");
      return FALSE;
    }
  /* the backend itself refuses other weight dtypes */
  return wgmma_shapes_supported (experts, "deepgemm", 8, error);
}

static gboolean
fused_supported (MoeCudaDevice  *self,
                 MoeExperts     *experts,
                 GError        **error)
{
  if (self->cc_major != 9)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "libmoe's sonicmoe kernels need compute capability 9.0 (Hopper wgmma); this GPU is "
                   "SM%d%d (%s)", self->cc_major, self->cc_minor, self->gpu_name);
      return FALSE;
    }
  /* the backend itself checks gating, activation and dtype (bf16) */
  return wgmma_shapes_supported (experts, "sonicmoe", 8, error);
}

static gboolean
fused_expert_parallel_supported (MoeCudaDevice  *self,
                                 GError        **error)
{
  if (self->cc_major >= 10)
    return TRUE;
  g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
               "deepgemm_megamoe requires Blackwell (SM100); this GPU is SM%d%d (%s)",
               self->cc_major, self->cc_minor, self->gpu_name);
  return FALSE;
}

static gboolean
cuda_supports_experts (MoeDevice           *device,
                       MoeExpertsSchedule   schedule,
                       MoeExperts          *experts,
                       GError             **error)
{
  MoeDType up = moe_tensor_get_dtype (moe_experts_get_up_weight (experts));
  MoeTensor *others[] = {
    moe_experts_get_down_weight (experts), moe_experts_get_up_bias (experts), moe_experts_get_down_bias (experts),
  };
  const char *names[] = { "down-weight", "up-bias", "down-bias" };

  if (!device_ready (MOE_CUDA_DEVICE (device), error))
    return FALSE;
  switch (schedule)
    {
    case MOE_EXPERTS_SCHEDULE_PER_EXPERT:
    case MOE_EXPERTS_SCHEDULE_PER_ROW:
    case MOE_EXPERTS_SCHEDULE_GROUPED:
      break;
    case MOE_EXPERTS_SCHEDULE_DEEPGEMM:
      if (!deepgemm_supported (MOE_CUDA_DEVICE (device), experts, error))
        return FALSE;
      break;
    case MOE_EXPERTS_SCHEDULE_FUSED:
      if (!fused_supported (MOE_CUDA_DEVICE (device), experts, error))
        return FALSE;
      break;
    case MOE_EXPERTS_SCHEDULE_FUSED_EXPERT_PARALLEL:
      return fused_expert_parallel_supported (MOE_CUDA_DEVICE (device), error);
    default:
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "The cuda device does not know experts schedule %d", (int) schedule);
      return FALSE;
    }
  if (up == MOE_DTYPE_F8E4M3 || up == MOE_DTYPE_I8)
    {
      /* moe_experts_validate() checked the scales; eager would need them multiplied out */
      if (schedule == MOE_EXPERTS_SCHEDULE_PER_EXPERT)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                       "eager does not run FP8/FP4 experts on cuda; use batched_mm or grouped_mm, "
                       "or load the checkpoint with the dequantize option");
          return FALSE;
        }
      return TRUE;
    }
  if (!is_gpu_float (up))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "On cuda the experts' weights must be F32, BF16 or F16, not %s",
                   moe_dtype_get_name (up));
      return FALSE;
    }
  for (guint i = 0; i < G_N_ELEMENTS (others); i++)
    if (others[i] != NULL && moe_tensor_get_dtype (others[i]) != up)
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                     "On cuda %s must have up-weight's dtype %s, not %s", names[i],
                     moe_dtype_get_name (up), moe_dtype_get_name (moe_tensor_get_dtype (others[i])));
        return FALSE;
      }
  return TRUE;
}

/* ---- deepgemm: GEMMs compiled just in time ---------------------------- */

static void
jit_kernels_free (gpointer data)
{
  JitKernels *k = data;

  cudaLibraryUnload (k->library);
  g_free (k);
}

/* The text nvcc compiles: the shared device code (embedded from kernels/)
 * and the two GEMMs specialised to the inner sizes. */
static char *
jit_source (gboolean  fp8,
            int       hidden,
            int       inter,
            GError  **error)
{
  const char *files[] = { "moe-cuda-experts.h", "moe-cuda-elements.cuh", "moe-cuda-gemm.cuh" };
  GString *src = g_string_new ("/* libmoe deepgemm kernels, compiled just in time */\n#define MOE_JIT 1\n");

  for (guint i = 0; i < G_N_ELEMENTS (files); i++)
    {
      g_autofree char *path = g_strconcat ("/org/libmoe/cuda/", files[i], NULL);
      g_autoptr(GBytes) text = g_resources_lookup_data (path, G_RESOURCE_LOOKUP_FLAGS_NONE, error);
      g_auto(GStrv) lines = NULL;

      if (text == NULL)
        {
          g_string_free (src, TRUE);
          return NULL;
        }
      /* one translation unit: the headers' include guards would warn */
      lines = g_strsplit (g_bytes_get_data (text, NULL), "#pragma once", -1);
      g_string_append_printf (src, "#line 1 \"%s\"\n", files[i]);
      for (guint j = 0; lines[j] != NULL; j++)
        g_string_append (src, lines[j]);
    }
  /* each projection four times: bulk tensor copies (16-byte aligned
   * rows) in the wide tile, its form for many rows an expert, and the tall
   * tile (route picks by the rows each expert got), and cp.async (8-byte
   * aligned); the schedule picks by the shapes */
  for (int mode = 0; mode < 2; mode++)
    {
      const char *name = mode == 0 ? "gate_up" : "down", *mode_name = mode == 0 ? "MODE_GATE_UP" : "MODE_DOWN";
      int k = mode == 0 ? hidden : inter;
      const char *f = fp8 ? "true" : "false";

      /* (prefix, tile shape) of the bulk-copy kernels */
      const char *tma[3][2] = { { "tma", "TmaWide" }, { "tall", "TmaTall" }, { "large", "TmaWideLarge" } };

      g_string_append_printf (src,
        "\nextern \"C\" __global__ void __launch_bounds__ (256)\n"
        "moe_deepgemm_%s (MoeCudaExperts p, Route r, const void *a, const float *s, void *dst, int n_tiles)\n"
        "{\n  wgmma_gemm<__nv_bfloat16, %s, %s, %d> (p, r, a, s, dst, n_tiles);\n}\n",
        name, mode_name, f, k);
      for (int t = 0; t < 3; t++)
        g_string_append_printf (src,
          "extern \"C\" __global__ void __launch_bounds__ (%s<%s>::THREADS, 1)\n"
          "moe_deepgemm_%s_%s (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,\n"
          "                      MoeCudaExperts p, Route r, const float *s, void *dst, int n_tiles)\n"
          "{\n  tma_gemm<__nv_bfloat16, %s, %s, %d, %s<%s>> (&ta, &tb, p, r, s, dst, n_tiles);\n}\n",
          tma[t][1], f, tma[t][0], name, mode_name, f, k, tma[t][1], f);
    }
  return g_string_free (src, FALSE);
}

/* The deepgemm GEMMs for these shapes: compiled with the toolkit on first
 * use (or read from the disk cache), loaded once per device. */
static const JitKernels *
jit_kernels_get (MoeCudaDevice  *self,
                 gboolean        fp8,
                 int             hidden,
                 int             inter,
                 GError        **error)
{
  g_autofree char *key = g_strdup_printf ("%s %d %d", fp8 ? "fp8" : "bf16", hidden, inter);
  const char *args[] = {
    "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a", NULL,
  };
  JitKernels *k;
  g_autofree char *source = NULL;
  g_autoptr(GBytes) cubin = NULL;
  cudaError_t err;

  g_mutex_lock (&self->jit_lock);
  k = g_hash_table_lookup (self->jit_kernels, key);
  if (k != NULL)
    {
      g_mutex_unlock (&self->jit_lock);
      return k;
    }
  source = jit_source (fp8, hidden, inter, error);
  if (source != NULL)
    cubin = moe_cuda_jit_compile (&self->toolkit, source, args, error);
  if (cubin == NULL)
    {
      g_prefix_error (error, "deepgemm: compiling its kernels for hidden %d, intermediate %d: ", hidden, inter);
      g_mutex_unlock (&self->jit_lock);
      return NULL;
    }
  k = g_new0 (JitKernels, 1);
  err = cudaLibraryLoadData (&k->library, g_bytes_get_data (cubin, NULL), NULL, NULL, 0, NULL, NULL, 0);
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->gate_up, k->library, "moe_deepgemm_gate_up");
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->down, k->library, "moe_deepgemm_down");
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->tma_gate_up, k->library, "moe_deepgemm_tma_gate_up");
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->tma_down, k->library, "moe_deepgemm_tma_down");
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->tall_gate_up, k->library, "moe_deepgemm_tall_gate_up");
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->tall_down, k->library, "moe_deepgemm_tall_down");
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->large_gate_up, k->library, "moe_deepgemm_large_gate_up");
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel (&k->large_down, k->library, "moe_deepgemm_large_down");
  if (err != cudaSuccess)
    {
      cudaGetLastError ();
      if (k->library != NULL)
        cudaLibraryUnload (k->library);
      g_free (k);
      g_mutex_unlock (&self->jit_lock);
      return moe_cuda_check (err, "loading deepgemm's compiled kernels", error), NULL;
    }
  g_hash_table_insert (self->jit_kernels, g_steal_pointer (&key), k);
  g_mutex_unlock (&self->jit_lock);
  return k;
}

static gconstpointer
data_or_null (MoeTensor *t)
{
  return t != NULL ? moe_tensor_get_data (t) : NULL;
}

static MoeTensor *
cuda_run_experts (MoeDevice           *device,
                  MoeExpertsSchedule   schedule,
                  MoeExperts          *experts,
                  MoeTensor           *hidden_states,
                  MoeTensor           *top_k_index,
                  MoeTensor           *top_k_weights,
                  GError             **error)
{
  MoeCudaDevice *self = MOE_CUDA_DEVICE (device);
  g_autoptr(GRecMutexLocker) exclusive = g_rec_mutex_locker_new (&self->exclusive);
  MoeTensor *up = moe_experts_get_up_weight (experts);
  MoeDType dtype = moe_tensor_get_dtype (hidden_states);
  g_autoptr(MoeTensor) ids = NULL;
  g_autoptr(MoeTensor) out = NULL;
  g_autoptr(MoeTensor) workspace = NULL;
  g_autoptr(GBytes) host_ids = NULL;
  MoeCpuActivation act;
  MoeCudaExperts e = { 0, };
  const char *msg;
  gboolean is_quantized = moe_tensor_get_dtype (up) == MOE_DTYPE_F8E4M3 || moe_tensor_get_dtype (up) == MOE_DTYPE_I8;

  if (moe_tensor_get_dtype (up) != dtype && !is_quantized)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "On cuda hidden_states must have the experts' dtype %s, not %s",
                   moe_dtype_get_name (moe_tensor_get_dtype (up)), moe_dtype_get_name (dtype));
      return NULL;
    }
  if (!moe_cpu_activation_from_name (moe_experts_get_activation (experts), &act))
    g_return_val_if_reached (NULL);   /* moe_experts_validate() refused it */

  /* the ids are checked on the host already; the device needs its own copy */
  ids = moe_tensor_to_device (top_k_index, device, error);
  if (ids == NULL)
    return NULL;
  if (schedule == MOE_EXPERTS_SCHEDULE_PER_EXPERT)
    {
      /* this schedule reads the routing on the host anyway: check it now */
      const gint64 *v;
      gint64 n = moe_tensor_get_n_elements (top_k_index), E = moe_experts_get_num_experts (experts);
      host_ids = moe_tensor_dup_bytes (top_k_index, error);
      if (host_ids == NULL)
        return NULL;
      v = g_bytes_get_data (host_ids, NULL);
      for (gint64 i = 0; i < n; i++)
        if (v[i] < 0 || v[i] > E)
          {
            gint64 K = moe_tensor_get_dim (top_k_index, 1);
            g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                         "top_k_index[%" G_GINT64_FORMAT ", %" G_GINT64_FORMAT "] is %" G_GINT64_FORMAT
                         "; valid expert ids are 0…%" G_GINT64_FORMAT ", and %" G_GINT64_FORMAT
                         " for a slot that contributes nothing", i / K, i % K, v[i], E - 1, E);
            return NULL;
          }
    }

  e.dtype = dtype;
  e.routing_dtype = moe_tensor_get_dtype (top_k_weights);
  e.num_experts = moe_experts_get_num_experts (experts);
  e.hidden = moe_experts_get_hidden_size (experts);
  e.inter = moe_experts_get_intermediate_size (experts);
  e.tokens = moe_tensor_get_dim (hidden_states, 0);
  e.top_k = moe_tensor_get_dim (top_k_index, 1);
  e.has_gate = moe_experts_get_has_gate (experts);
  e.interleaved = moe_experts_get_gate_layout (experts) == MOE_GATE_LAYOUT_INTERLEAVED;
  e.transposed = moe_experts_get_is_transposed (experts);
  e.activation = act;
  e.alpha = moe_experts_get_swiglu_alpha (experts);
  e.limit = moe_experts_get_swiglu_limit (experts);
  e.up = moe_tensor_get_data (up);
  e.down = moe_tensor_get_data (moe_experts_get_down_weight (experts));
  e.up_bias = data_or_null (moe_experts_get_up_bias (experts));
  e.down_bias = data_or_null (moe_experts_get_down_bias (experts));
  e.x = moe_tensor_get_data (hidden_states);
  e.ids = moe_tensor_get_data (ids);
  e.routing = moe_tensor_get_data (top_k_weights);
  e.bad_id = self->bad_id_device;
  if (is_quantized)
    {
      MoeTensor *us = moe_experts_get_up_weight_scale (experts), *ds = moe_experts_get_down_weight_scale (experts);
      MoeTensor *biases[] = { moe_experts_get_up_bias (experts), moe_experts_get_down_bias (experts) };
      for (guint i = 0; i < G_N_ELEMENTS (biases); i++)
        if (biases[i] != NULL && moe_tensor_get_dtype (biases[i]) != dtype)
          {
            g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                         "On cuda the biases of quantized experts must have the hidden states' dtype %s",
                         moe_dtype_get_name (dtype));
            return NULL;
          }
      e.weight_format = moe_tensor_get_dtype (up) == MOE_DTYPE_I8 ? MOE_CUDA_WEIGHTS_FP4 : MOE_CUDA_WEIGHTS_FP8;
      e.scale_dtype = moe_tensor_get_dtype (us) == MOE_DTYPE_E8M0 ? MOE_CUDA_E8M0 : MOE_CUDA_F32;
      e.up_scale = moe_tensor_get_data (us);
      e.down_scale = moe_tensor_get_data (ds);
      e.up_scale_rows = moe_tensor_get_dim (us, 1);
      /* gate and up scaled as two matrices (fused per-expert checkpoint scales) */
      if (e.weight_format == MOE_CUDA_WEIGHTS_FP8 && e.has_gate &&
          e.up_scale_rows == 2 * ((e.inter + 127) / 128) && e.up_scale_rows != (2 * e.inter + 127) / 128)
        e.up_scale_split = e.inter;
    }

  if (schedule == MOE_EXPERTS_SCHEDULE_DEEPGEMM)
    {
      const JitKernels *k;

      if (dtype != MOE_DTYPE_BF16)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                       "DeepGEMM experts path requires bfloat16 hidden states, not %s", moe_dtype_get_name (dtype));
          return NULL;
        }
      k = jit_kernels_get (self, is_quantized, e.hidden, e.inter, error);
      if (k == NULL)
        return NULL;
      e.jit_gate_up = k->gate_up;
      e.jit_down = k->down;
      e.jit_tma_gate_up = k->tma_gate_up;
      e.jit_tma_down = k->tma_down;
      e.jit_tall_gate_up = k->tall_gate_up;
      e.jit_tall_down = k->tall_down;
      e.jit_large_gate_up = k->large_gate_up;
      e.jit_large_down = k->large_down;
    }

  out = moe_tensor_new_empty (device, dtype, moe_tensor_get_shape (hidden_states, NULL), 2, error);
  if (out == NULL)
    return NULL;
  e.out = moe_tensor_get_mutable_data (out);
  {
    gint64 n = (gint64) moe_cuda_experts_workspace_size (&e, schedule);
    workspace = moe_tensor_new_empty (device, MOE_DTYPE_U8, &n, 1, error);
    if (workspace == NULL)
      return NULL;
  }

  g_mutex_lock (&self->lock);
  self->bad_id_experts = e.num_experts;
  self->bad_id_top_k = e.top_k;
  msg = moe_cuda_experts_run (&e, schedule, host_ids ? g_bytes_get_data (host_ids, NULL) : NULL,
                              moe_tensor_get_mutable_data (workspace), self->cublas, self->stream);
  g_mutex_unlock (&self->lock);
  if (msg != NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED, "CUDA experts: %s", msg);
      return NULL;
    }
  return g_steal_pointer (&out);
}

static void
moe_cuda_device_finalize (GObject *object)
{
  MoeCudaDevice *self = MOE_CUDA_DEVICE (object);

  /* devices live as long as the registry; this runs only at teardown */
  if (self->init_error == NULL)
    {
      cudaStreamSynchronize (self->stream);
      release_cached_locked (self);
      g_clear_pointer (&self->lt_plans, g_hash_table_unref);
      if (self->lt != NULL)
        {
          cudaFree (self->lt_workspace);
          cublasLtDestroy (self->lt);
        }
      cublasDestroy (self->cublas);
      cudaStreamDestroy (self->stream);
      cudaFreeHost ((gpointer) self->bad_id);
    }
  g_hash_table_unref (self->in_use);
  g_hash_table_unref (self->free_blocks);
  g_hash_table_unref (self->jit_kernels);
  moe_cuda_toolkit_clear (&self->toolkit);
  g_free (self->gpu_name);
  g_free (self->init_error);
  g_mutex_clear (&self->jit_lock);
  g_mutex_clear (&self->lock);
  g_rec_mutex_clear (&self->exclusive);
  G_OBJECT_CLASS (moe_cuda_device_parent_class)->finalize (object);
}

static void
moe_cuda_device_class_init (MoeCudaDeviceClass *klass)
{
  GObjectClass *object_class = G_OBJECT_CLASS (klass);
  MoeDeviceClass *device_class = MOE_DEVICE_CLASS (klass);

  object_class->finalize = moe_cuda_device_finalize;
  device_class->alloc = cuda_alloc;
  device_class->free = cuda_free;
  device_class->copy_from_host = cuda_copy_from_host;
  device_class->copy_to_host = cuda_copy_to_host;
  device_class->synchronize = cuda_synchronize;
  device_class->supports_experts = cuda_supports_experts;
  device_class->run_experts = cuda_run_experts;
  device_class->decoder_new = moe_cuda_decoder_new;
  device_class->decoder_free = moe_cuda_decoder_free;
  device_class->decoder_forward = moe_cuda_decoder_forward;
  device_class->decoder_cache_free = moe_cuda_decoder_cache_free;
}

static void
moe_cuda_device_init (MoeCudaDevice *self)
{
  cudaError_t err;
  cublasStatus_t st;

  g_mutex_init (&self->lock);
  g_rec_mutex_init (&self->exclusive);
  self->in_use = g_hash_table_new (g_direct_hash, g_direct_equal);
  /* no value destroy func: the lists are replaced by their own updated heads */
  self->free_blocks = g_hash_table_new (g_direct_hash, g_direct_equal);

  g_mutex_init (&self->jit_lock);
  self->jit_kernels = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, jit_kernels_free);
  self->gpu_name = g_strdup ("?");

  err = cudaSetDevice (0);
  if (err == cudaSuccess)
    {
      struct cudaDeviceProp prop;
      err = cudaGetDeviceProperties (&prop, 0);
      if (err == cudaSuccess)
        {
          self->cc_major = prop.major;
          self->cc_minor = prop.minor;
          g_free (self->gpu_name);
          self->gpu_name = g_strdup (prop.name);
        }
    }
  if (err == cudaSuccess)
    err = cudaStreamCreateWithFlags (&self->stream, cudaStreamNonBlocking);
  if (err == cudaSuccess)
    err = cudaHostAlloc ((void **) &self->bad_id, 2 * sizeof (long long), cudaHostAllocMapped);
  if (err == cudaSuccess)
    {
      self->bad_id[0] = 0;
      err = cudaHostGetDevicePointer ((void **) &self->bad_id_device, (void *) self->bad_id, 0);
    }
  if (err != cudaSuccess)
    {
      self->init_error = g_strdup_printf ("CUDA: could not set up the device: %s", cudaGetErrorString (err));
      return;
    }
  st = cublasCreate (&self->cublas);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasSetStream (self->cublas, self->stream);
  if (st != CUBLAS_STATUS_SUCCESS)
    {
      self->init_error = g_strdup_printf ("cuBLAS: could not create a handle (status %d)", (int) st);
      cudaStreamDestroy (self->stream);
    }
}

/* A machine without a GPU or driver loads the plugin and says so here. */
static gboolean
cuda_plugin_init (GError **error)
{
  int count = 0;
  cudaError_t err = cudaGetDeviceCount (&count);

  if (err != cudaSuccess || count == 0)
    {
      cudaGetLastError ();
      g_set_error (error, MOE_ERROR, MOE_ERROR_NO_DEVICE, "No CUDA device: %s",
                   err != cudaSuccess ? cudaGetErrorString (err) : "the driver reports none");
      return FALSE;
    }
  g_type_ensure (MOE_TYPE_CUDA_DEVICE);
  return TRUE;
}

MOE_PLUGIN_DEFINE (cuda, cuda_plugin_init)
