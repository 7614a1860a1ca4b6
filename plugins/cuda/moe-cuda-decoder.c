/* moe-cuda-decoder.c: whole models on the cuda device
 *
 * The decoder stack of moe-transformer.c, step for step, on the GPU: the
 * weights are copied to the device once (the experts already are), the
 * activations stay there in the model dtype, dense projections run on
 * cuBLAS (float32 accumulation; no TF32, so float32 models keep their
 * precision), the other ops on kernels/moe-cuda-decoder.cu, and each MoE
 * layer's experts through moe_experts_forward(), so that the model's
 * experts implementation (and the decode switch) chooses how they run.
 * Only the logits come back to the host.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <stdlib.h>
#include <string.h>

#include "moe-cuda-device-private.h"
#include "moe-cuda-decoder.h"
#include "moe-cuda-experts.h"
#include "moe-transformer-private.h"

typedef struct {
  MoeTensor *weight;           /* [out, in] */
  MoeTensor *bias;             /* [out] or NULL */
  int        out, in;
} DevLinear;

typedef struct {
  MoeTensor *input_norm, *post_norm, *q_norm, *k_norm, *q_a_norm, *kv_a_norm;
  MoeTensor *sinks, *router_bias, *score_bias;
  DevLinear  qkv;              /* q, k and v stacked: one projection (not MLA) */
  DevLinear  q, o, q_a, q_b, kv_a, kv_b, down, shared_gate;
  DevLinear  gate_up;          /* the dense MLP's or shared expert's gate and up stacked */
  DevLinear  router;           /* in the model dtype: a bf16 model's router weights are bf16 values */
} DevLayer;

typedef struct {
  MoeCudaDevice        *dev;
  const MoeTransformer *m;
  int                   dtype;       /* MOE_CUDA_*: MoeDType's numbering */
  gsize                 elem;        /* bytes per activation */
  MoeTensor            *embed, *lm_head, *final_norm, *inv_freq;
  DevLayer             *layer;
  int                   gemv_rows;   /* projections of this many rows or fewer run as GEMVs */
  gboolean              lt;          /* biased GEMMs on cuBLASLt (MOE_CUDA_CUBLASLT=0: never) */
  int                   prefill_attention_tokens;   /* steps of this many tokens or more: flash kernel or GEMMs */
  int                   rope_store_rows;  /* steps of this many rows or fewer: RoPE + KV write a block per (row, head) */
  gboolean              rope_in_attention;  /* … in the attention kernel itself, for a step of one token a sequence */
  int                   attention_split;  /* decode over more keys: blocks of this many (MOE_CUDA_ATTENTION_SPLIT; 0: one) */
  gboolean              trace;       /* MOE_CUDA_TRACE set: each forward says where its time went */
  gboolean              graphs;      /* decode steps as CUDA graphs (MOE_CUDA_GRAPHS=0: never) */
  gboolean              trim_last;   /* the last layer on the rows that make logits only (MOE_CUDA_TRIM_LAST=0: never) */
  gboolean              sample;      /* do_sample's draws here (MOE_CUDA_SAMPLE=0: the logits to the host, which draws) */
  /* the shared expert runs here, beside the router and the routed experts,
   * its GEMMs on a cuBLAS handle of its own (a handle's workspace is not
   * for two streams at once); NULL: all on the device's stream
   * (MOE_CUDA_SIDE_STREAM=0) */
  cudaStream_t          side;
  cublasHandle_t        side_cublas;
  cudaEvent_t           fork, join;
} Decoder;

typedef struct {
  guint       batch, capacity;
  guint       layers;
  MoeTensor **k, **v;          /* per layer [B][kv_heads][capacity][d] */

  /* the decode step as a CUDA graph: captured on the second one-token
   * step with the same experts implementations (the first runs the
   * just-in-time compiles and fills the allocator), replayed after that
   * with its inputs in fixed buffers; dropped when the cache grows or the
   * implementations change */
  char           *warm;        /* the signature of the last one-token step run directly */
  char           *signature;   /* of the captured graph */
  char           *failed;      /* a signature whose capture failed: not tried again */
  cudaGraphExec_t exec;
  GSList         *pool;        /* the graph's memory */
  MoeTensor      *g_ids, *g_positions, *g_past, *g_valid, *g_logits;
} DevCache;

/* ------------------------------------------------------------------ */
/* Weights                                                             */

/* @n elements of host memory, copied to the device */
static MoeTensor *
upload (Decoder *d, MoeDType dtype, gconstpointer data, gint64 n, GError **error)
{
  g_autoptr(GBytes) bytes = g_bytes_new_static (data, n * moe_dtype_get_size (dtype));
  g_autoptr(MoeTensor) host = moe_tensor_new_from_bytes (dtype, &n, 1, bytes, error);
  return host ? moe_tensor_to_device (host, MOE_DEVICE (d->dev), error) : NULL;
}

static gboolean
upload_linear (Decoder *d, const Linear *lin, DevLinear *out, GError **error)
{
  if (lin->weight == NULL)
    return TRUE;
  if (lin->scale != NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "On cuda the attention and dense layers need %s weights; this checkpoint's are %s "
                   "(load it with dequantize set to run it on cuda, or on the cpu as it is)",
                   moe_dtype_get_name (d->m->dtype), moe_dtype_get_name (moe_tensor_get_dtype (lin->weight)));
      return FALSE;
    }
  out->out = moe_tensor_get_dim (lin->weight, 0);
  out->in = moe_tensor_get_dim (lin->weight, 1);
  out->weight = moe_tensor_to_device (lin->weight, MOE_DEVICE (d->dev), error);
  if (out->weight == NULL)
    return FALSE;
  if (lin->bias != NULL)
    {
      g_autoptr(MoeTensor) b = moe_tensor_to_dtype (lin->bias, d->m->dtype, error);
      out->bias = b ? moe_tensor_to_device (b, MOE_DEVICE (d->dev), error) : NULL;
      if (out->bias == NULL)
        return FALSE;
    }
  return TRUE;
}

/* Linears of one input stacked into one [Σ out, in] weight (and bias,
 * zeros where one has none: adding 0 before the rounding changes nothing),
 * so that they run as one projection. */
static gboolean
upload_stacked (Decoder *d, const Linear * const *lins, guint n, DevLinear *out, GError **error)
{
  gint64 rows = 0, in = 0;
  gsize es = moe_dtype_get_size (d->m->dtype), off = 0, boff = 0;
  gboolean bias = FALSE;
  g_autofree guint8 *w = NULL, *b = NULL;

  if (lins[0]->weight == NULL)
    return TRUE;
  for (guint i = 0; i < n; i++)
    {
      if (lins[i]->scale != NULL)
        return upload_linear (d, lins[i], out, error);   /* says why it cannot */
      rows += moe_tensor_get_dim (lins[i]->weight, 0);
      in = moe_tensor_get_dim (lins[i]->weight, 1);
      bias |= lins[i]->bias != NULL;
    }
  w = g_malloc (rows * in * es);
  b = bias ? g_malloc0 (rows * es) : NULL;
  for (guint i = 0; i < n; i++)
    {
      gsize nb = moe_tensor_get_n_bytes (lins[i]->weight), r = moe_tensor_get_dim (lins[i]->weight, 0);
      memcpy (w + off, moe_tensor_get_data (lins[i]->weight), nb);
      off += nb;
      if (lins[i]->bias != NULL)
        {
          g_autoptr(MoeTensor) typed = moe_tensor_to_dtype (lins[i]->bias, d->m->dtype, error);
          if (typed == NULL)
            return FALSE;
          memcpy (b + boff, moe_tensor_get_data (typed), r * es);
        }
      boff += r * es;
    }
  {
    gint64 shape[2] = { rows, in };
    g_autoptr(GBytes) wb = g_bytes_new_take (g_steal_pointer (&w), rows * in * es);
    g_autoptr(MoeTensor) wt = moe_tensor_new_from_bytes (d->m->dtype, shape, 2, wb, error);
    g_autoptr(MoeTensor) bt = NULL;
    Linear stacked = { wt, NULL, NULL };

    if (wt == NULL)
      return FALSE;
    if (bias)
      {
        g_autoptr(GBytes) bb = g_bytes_new_take (g_steal_pointer (&b), rows * es);
        bt = moe_tensor_new_from_bytes (d->m->dtype, &rows, 1, bb, error);
        if (bt == NULL)
          return FALSE;
        stacked.bias = bt;
      }
    return upload_linear (d, &stacked, out, error);
  }
}

static void
dev_linear_clear (DevLinear *lin)
{
  g_clear_object (&lin->weight);
  g_clear_object (&lin->bias);
}

void
moe_cuda_decoder_free (MoeDevice *device,
                       gpointer   decoder)
{
  Decoder *d = decoder;

  for (guint i = 0; d->layer != NULL && i < d->m->layers; i++)
    {
      DevLayer *L = &d->layer[i];
      MoeTensor **ts[] = { &L->input_norm, &L->post_norm, &L->q_norm, &L->k_norm, &L->q_a_norm, &L->kv_a_norm,
                           &L->sinks, &L->router_bias, &L->score_bias };
      DevLinear *lins[] = { &L->qkv, &L->q, &L->o, &L->q_a, &L->q_b, &L->kv_a, &L->kv_b,
                            &L->gate_up, &L->down, &L->shared_gate, &L->router };
      for (guint j = 0; j < G_N_ELEMENTS (ts); j++)
        g_clear_object (ts[j]);
      for (guint j = 0; j < G_N_ELEMENTS (lins); j++)
        dev_linear_clear (lins[j]);
    }
  g_free (d->layer);
  g_clear_object (&d->embed);
  g_clear_object (&d->lm_head);
  g_clear_object (&d->final_norm);
  g_clear_object (&d->inv_freq);
  if (d->side_cublas != NULL)
    cublasDestroy (d->side_cublas);
  if (d->side != NULL)
    {
      cudaEventDestroy (d->fork);
      cudaEventDestroy (d->join);
      cudaStreamDestroy (d->side);
    }
  g_free (d);
}

gpointer
moe_cuda_decoder_new (MoeDevice      *device,
                      gconstpointer   model,
                      GError        **error)
{
  const MoeTransformer *m = model;
  Decoder *d = g_new0 (Decoder, 1);
  GError *local = NULL;
  gint64 H = m->hidden;

  d->dev = MOE_CUDA_DEVICE (device);
  d->m = m;
  d->dtype = m->dtype;
  d->elem = m->dtype == MOE_DTYPE_F32 ? 4 : 2;
  /* Projections of a few rows run as GEMVs rather than cuBLAS GEMMs: up to
   * 16 rows for bf16/f16 (the tensor-core form), 4 for float32 (the
   * CUDA-core form, measured on the H200 to lose to cuBLAS at 8 rows; see
   * BENCHMARKS.md). MOE_CUDA_GEMV_ROWS (0…16) moves the split. */
  d->gemv_rows = g_getenv ("MOE_CUDA_GEMV_ROWS") ? CLAMP (atoi (g_getenv ("MOE_CUDA_GEMV_ROWS")), 0, MOE_CUDA_GEMV_ROWS)
                 : m->dtype == MOE_DTYPE_F32 ? 4 : 16;
  /* MOE_CUDA_PREFILL_ATTENTION_TOKENS moves the split between the
   * few-query attention kernel and the prefill paths (flash kernel, or
   * GEMMs for float32 and eager attention): the GPU test sets it to 1 to
   * run the fixtures' 9-token prompts (and the decode steps) through them */
  d->prefill_attention_tokens = g_getenv ("MOE_CUDA_PREFILL_ATTENTION_TOKENS")
                                ? MAX (atoi (g_getenv ("MOE_CUDA_PREFILL_ATTENTION_TOKENS")), 1) : 16;
  /* MOE_CUDA_ROPE_STORE_ROWS moves the split between the decode steps'
   * RoPE + KV-write kernel and the prefill's (the GPU test sets 0) */
  d->rope_store_rows = g_getenv ("MOE_CUDA_ROPE_STORE_ROWS") ? MAX (atoi (g_getenv ("MOE_CUDA_ROPE_STORE_ROWS")), 0)
                                                             : 16;
  /* MOE_CUDA_ROPE_IN_ATTENTION=0: a decode step's RoPE + KV write in a
   * kernel of its own before the attention (as for a few tokens a row) */
  d->rope_in_attention = g_strcmp0 (g_getenv ("MOE_CUDA_ROPE_IN_ATTENTION"), "0") != 0;
  d->attention_split = g_getenv ("MOE_CUDA_ATTENTION_SPLIT") ? MAX (atoi (g_getenv ("MOE_CUDA_ATTENTION_SPLIT")), 0)
                                                             : 128;
  /* MOE_CUDA_CUBLASLT=0: the biased projections' GEMMs on cublasGemmEx
   * after a bias kernel (the path where cuBLASLt has no algorithm) */
  d->lt = g_strcmp0 (g_getenv ("MOE_CUDA_CUBLASLT"), "0") != 0 && moe_cuda_device_prepare_lt (d->dev);
  d->trace = g_getenv ("MOE_CUDA_TRACE") != NULL;
  d->graphs = g_strcmp0 (g_getenv ("MOE_CUDA_GRAPHS"), "0") != 0 && !d->trace;
  d->trim_last = g_strcmp0 (g_getenv ("MOE_CUDA_TRIM_LAST"), "0") != 0;
  d->sample = g_strcmp0 (g_getenv ("MOE_CUDA_SAMPLE"), "0") != 0;
  if (m->has_shared && g_strcmp0 (g_getenv ("MOE_CUDA_SIDE_STREAM"), "0") != 0 &&
      (cudaStreamCreateWithFlags (&d->side, cudaStreamNonBlocking) != cudaSuccess ||
       cudaEventCreateWithFlags (&d->fork, cudaEventDisableTiming) != cudaSuccess ||
       cudaEventCreateWithFlags (&d->join, cudaEventDisableTiming) != cudaSuccess ||
       cublasCreate (&d->side_cublas) != CUBLAS_STATUS_SUCCESS ||
       cublasSetStream (d->side_cublas, d->side) != CUBLAS_STATUS_SUCCESS))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED, "CUDA: could not create the decoder's side stream");
      goto fail;
    }
  if (m->dtype != MOE_DTYPE_F32 && m->dtype != MOE_DTYPE_BF16 && m->dtype != MOE_DTYPE_F16)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "On cuda a model runs in float32, bfloat16 or float16, not %s", moe_dtype_get_name (m->dtype));
      goto fail;
    }
  if (m->family == FAMILY_DEEPSEEK_V3 && (m->kv_heads != m->heads || m->rope_dim > 256))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "On cuda MLA needs one key head per query head and at most 256 RoPE dims");
      goto fail;
    }
  if (m->router_kind == ROUTER_SIGMOID_GROUPED && (m->n_group == 0 || m->n_group > 64 ||
                                                   m->num_experts / m->n_group < 2))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "On cuda group-limited routing needs 1…64 groups of at least two experts; this model has "
                   "%u experts in %u groups", m->num_experts, m->n_group);
      goto fail;
    }

#define UP(dst, src, n) G_STMT_START { if ((src) != NULL && ((dst) = upload (d, MOE_DTYPE_F32, (src), (n), &local)) == NULL) goto fail_local; } G_STMT_END
  d->embed = moe_tensor_to_device (m->embed, device, &local);
  if (d->embed == NULL)
    goto fail_local;
  d->lm_head = m->lm_head == m->embed ? g_object_ref (d->embed) : moe_tensor_to_device (m->lm_head, device, &local);
  if (d->lm_head == NULL)
    goto fail_local;
  UP (d->final_norm, m->final_norm, H);
  UP (d->inv_freq, m->inv_freq, m->rope_dim / 2);

  d->layer = g_new0 (DevLayer, m->layers);
  for (guint i = 0; i < m->layers; i++)
    {
      const Layer *L = &m->layer[i];
      DevLayer *D = &d->layer[i];
      const Linear *src[] = { &L->o, &L->q_a, &L->q_b, &L->kv_a, &L->kv_b, &L->down, &L->shared_gate };
      DevLinear *dst[] = { &D->o, &D->q_a, &D->q_b, &D->kv_a, &D->kv_b, &D->down, &D->shared_gate };
      const Linear *qkv[] = { &L->q, &L->k, &L->v }, *gate_up[] = { &L->gate, &L->up };
      gint64 qn_norm = m->qk_norm == QK_NORM_FULL ? (gint64) m->heads * m->head_dim : m->head_dim;
      gint64 kn_norm = m->qk_norm == QK_NORM_FULL ? (gint64) m->kv_heads * m->head_dim : m->head_dim;

      UP (D->input_norm, L->input_norm, H);
      UP (D->post_norm, L->post_norm, H);
      UP (D->q_norm, L->q_norm, qn_norm);
      UP (D->k_norm, L->k_norm, kn_norm);
      UP (D->q_a_norm, L->q_a_norm, m->q_lora);
      UP (D->kv_a_norm, L->kv_a_norm, m->kv_lora);
      UP (D->sinks, L->sinks, m->heads);
      if (L->router != NULL)
        {
          gint64 shape[2] = { m->num_experts, H };
          g_autoptr(GBytes) bytes = g_bytes_new_static (L->router, shape[0] * shape[1] * sizeof (float));
          g_autoptr(MoeTensor) f32 = moe_tensor_new_from_bytes (MOE_DTYPE_F32, shape, 2, bytes, &local);
          g_autoptr(MoeTensor) typed = f32 ? moe_tensor_to_dtype (f32, m->dtype, &local) : NULL;
          Linear lin = { typed, NULL, NULL };
          if (typed == NULL || !upload_linear (d, &lin, &D->router, &local))
            goto fail_local;
        }
      UP (D->router_bias, L->router_bias, m->num_experts);
      UP (D->score_bias, L->score_bias, m->num_experts);
      for (guint j = 0; j < G_N_ELEMENTS (src); j++)
        if (!upload_linear (d, src[j], dst[j], &local))
          goto fail_local;
      if (!(m->family == FAMILY_DEEPSEEK_V3 ? upload_linear (d, &L->q, &D->q, &local)
                                            : upload_stacked (d, qkv, 3, &D->qkv, &local)) ||
          !upload_stacked (d, gate_up, 2, &D->gate_up, &local))
        goto fail_local;
    }
#undef UP
  /* copies from the mapped checkpoint are done once this returns */
  if (!moe_device_synchronize (device, &local))
    goto fail_local;
  return d;

fail_local:
  g_propagate_error (error, local);
fail:
  moe_cuda_decoder_free (device, d);
  return NULL;
}

/* ------------------------------------------------------------------ */
/* KV cache                                                            */

static void
graph_drop (MoeCudaDevice *dev, DevCache *c)
{
  if (c->exec != NULL)
    cudaGraphExecDestroy (c->exec);
  c->exec = NULL;
  if (c->pool != NULL)
    moe_cuda_device_release_graph_pool (dev, g_steal_pointer (&c->pool));
  g_clear_pointer (&c->signature, g_free);
  g_clear_object (&c->g_ids);
  g_clear_object (&c->g_positions);
  g_clear_object (&c->g_past);
  g_clear_object (&c->g_valid);
  g_clear_object (&c->g_logits);
}

void
moe_cuda_decoder_cache_free (MoeDevice *device,
                             gpointer   cache)
{
  DevCache *c = cache;

  graph_drop (MOE_CUDA_DEVICE (device), c);
  g_free (c->warm);
  g_free (c->failed);
  for (guint i = 0; i < c->layers; i++)
    {
      g_clear_object (&c->k[i]);
      g_clear_object (&c->v[i]);
    }
  g_free (c->k);
  g_free (c->v);
  g_free (c);
}

/* Grows every layer's cache to hold @length positions, keeping the first
 * @past. */
static gboolean
cache_reserve (Decoder *d, DevCache *c, guint past, guint length, GError **error)
{
  const MoeTransformer *m = d->m;
  guint cap;

  if (length <= c->capacity)
    return TRUE;
  graph_drop (d->dev, c);   /* its kernels hold the old buffers */
  cap = MAX (length, MAX (c->capacity * 2, 64));
  for (guint i = 0; i < m->layers; i++)
    for (int kv = 0; kv < 2; kv++)
      {
        MoeTensor **slot = kv == 0 ? &c->k[i] : &c->v[i];
        gint64 dim = kv == 0 ? m->head_dim : m->v_head_dim;
        gint64 shape[4] = { c->batch, m->kv_heads, cap, dim };
        g_autoptr(MoeTensor) grown = moe_tensor_new_empty (MOE_DEVICE (d->dev), m->dtype, shape, 4, error);

        if (grown == NULL)
          return FALSE;
        if (*slot != NULL && past > 0 &&
            !moe_cuda_check (cudaMemcpy2DAsync (moe_tensor_get_mutable_data (grown), cap * dim * d->elem,
                                                moe_tensor_get_data (*slot), c->capacity * dim * d->elem,
                                                past * dim * d->elem, (gsize) c->batch * m->kv_heads,
                                                cudaMemcpyDeviceToDevice, d->dev->stream),
                             "growing the KV cache", error))
          return FALSE;
        g_clear_object (slot);
        *slot = g_steal_pointer (&grown);
      }
  c->capacity = cap;
  return TRUE;
}

/* ------------------------------------------------------------------ */
/* Ops                                                                 */

#define DATA(t) ((void *) moe_tensor_get_data (t))
#define OPT(t) ((t) != NULL ? DATA (t) : NULL)

static MoeTensor *
new_act (Decoder *d, gint64 rows, gint64 cols, GError **error)
{
  gint64 shape[2] = { rows, cols };
  return moe_tensor_new_empty (MOE_DEVICE (d->dev), d->m->dtype, shape, 2, error);
}

static MoeTensor *
new_f32 (Decoder *d, gint64 rows, gint64 cols, GError **error)
{
  gint64 shape[2] = { rows, cols };
  return moe_tensor_new_empty (MOE_DEVICE (d->dev), MOE_DTYPE_F32, shape, 2, error);
}

static cudaDataType_t
cuda_type (int dtype)
{
  return dtype == MOE_CUDA_BF16 ? CUDA_R_16BF : dtype == MOE_CUDA_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* y [rows, out] = x [rows, in] (rows @ldx elements apart) · Wᵀ (+ bias) on
 * @stream (the device's or the side stream), as torch's linear: float32
 * accumulation, the bias added before the one rounding to the model dtype,
 * in cuBLASLt's epilogue (torch's addmm on CUDA), or where that has no
 * algorithm, y starts as the bias and cublasGemmEx adds to it (beta = 1).
 * @accumulate (no bias): y += x · Wᵀ, also one rounding. @f32: y is
 * float32, unrounded. */
static gboolean
gemm (Decoder *d, cudaStream_t stream, const DevLinear *lin, MoeTensor *x, int ldx, int rows, gboolean f32,
      MoeTensor *y, gboolean accumulate, GError **error)
{
  const float one = 1.0f, zero = 0.0f;
  cudaDataType_t out_type = f32 ? CUDA_R_32F : cuda_type (d->dtype);
  cublasHandle_t handle = stream == d->side ? d->side_cublas : d->dev->cublas;
  cublasStatus_t st;

  /* bias_rows would overwrite what y holds; biases (cuBLASLt's plans) on
   * the device's stream only (the side stream's shared expert has none) */
  g_assert (!accumulate || lin->bias == NULL);
  g_assert (lin->bias == NULL || stream == d->dev->stream);
  if (lin->bias != NULL && d->lt)
    {
      MoeCudaBiasedGemm g = {
        .type = cuda_type (d->dtype), .out_type = out_type, .out = lin->out, .rows = rows, .in = lin->in,
        .ldx = ldx, .w = DATA (lin->weight), .x = DATA (x), .bias = DATA (lin->bias), .y = DATA (y),
      };
      gboolean ran;
      if (!moe_cuda_device_biased_gemm (d->dev, &g, &ran, error))
        return FALSE;
      if (ran)
        return TRUE;
    }
  if (lin->bias != NULL)
    moe_cuda_bias_rows (d->dtype, DATA (lin->bias), rows, lin->out, DATA (y), d->dev->stream);
  g_mutex_lock (&d->dev->lock);
  st = cublasGemmEx (handle, CUBLAS_OP_T, CUBLAS_OP_N, lin->out, rows, lin->in, &one,
                     DATA (lin->weight), cuda_type (d->dtype), lin->in,
                     DATA (x), cuda_type (d->dtype), ldx, lin->bias != NULL || accumulate ? &one : &zero,
                     DATA (y), out_type, lin->out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  g_mutex_unlock (&d->dev->lock);
  if (st != CUBLAS_STATUS_SUCCESS)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED, "cuBLAS: a %d×%d×%d projection failed (status %d)",
                   rows, lin->out, lin->in, (int) st);
      return FALSE;
    }
  return TRUE;
}

/* y [rows, out] = x · Wᵀ (+ bias), as gemm(); @f32: y stays float32,
 * unrounded, and there is no bias (the router's). A few rows (decode) run
 * as GEMVs on @stream, more on cuBLAS there. */
static MoeTensor *
project_on (Decoder *d, cudaStream_t stream, const DevLinear *lin, MoeTensor *x, int ldx, int rows, gboolean f32,
            GError **error)
{
  g_autoptr(MoeTensor) y = f32 ? new_f32 (d, rows, lin->out, error) : new_act (d, rows, lin->out, error);

  g_assert (!f32 || lin->bias == NULL);
  if (y == NULL)
    return NULL;
  if (rows <= d->gemv_rows)
    {
      MoeCudaGemv g = {
        .dtype = d->dtype, .w = DATA (lin->weight), .out = lin->out, .in = lin->in, .rows = rows,
        .x = DATA (x), .ldx = ldx, .bias = OPT (lin->bias), .y = DATA (y), .y_f32 = f32,
      };
      moe_cuda_gemv (&g, stream);
      return g_steal_pointer (&y);
    }
  return gemm (d, stream, lin, x, ldx, rows, f32, y, FALSE, error) ? g_steal_pointer (&y) : NULL;
}

static MoeTensor *
project (Decoder *d, const DevLinear *lin, MoeTensor *x, int ldx, int rows, gboolean f32, GError **error)
{
  return project_on (d, d->dev->stream, lin, x, ldx, rows, f32, error);
}

static MoeTensor *
linear (Decoder *d, const DevLinear *lin, MoeTensor *x, int ldx, int rows, GError **error)
{
  return project (d, lin, x, ldx, rows, FALSE, error);
}

static void
norm_groups (Decoder *d, MoeTensor *x, gsize offset, MoeTensor *h_add, MoeTensor *h_add2, int rows, int n,
             int groups, int group_stride, int in_stride, MoeTensor *w, MoeTensor *y, gsize y_offset, int out_stride)
{
  moe_cuda_rms_norm (d->dtype, (char *) DATA (x) + offset * d->elem,
                     h_add ? (char *) DATA (h_add) + offset * d->elem : NULL,
                     h_add2 ? (char *) DATA (h_add2) + offset * d->elem : NULL, rows, n, groups, group_stride,
                     in_stride, DATA (w), d->m->eps, d->m->family == FAMILY_GPT_OSS, (char *) DATA (y) + y_offset * d->elem,
                     out_stride, d->dev->stream);
}

static void
norm (Decoder *d, MoeTensor *x, gsize offset, MoeTensor *h_add, int rows, int n, int in_stride,
      MoeTensor *w, MoeTensor *y, gsize y_offset, int out_stride)
{
  norm_groups (d, x, offset, h_add, NULL, rows, n, 1, 0, in_stride, w, y, y_offset, out_stride);
}

typedef struct {
  const MoeDecoderStep *st;
  DevCache  *cache;
  guint      past;
  int        rows;
  MoeTensor *positions;        /* [rows] i64 */
  MoeTensor *key_valid;        /* [B, past + T] u8, or NULL */
  int        key_valid_stride; /* 0: past + T; a graph's: the capacity */
  MoeTensor *past_dev;         /* a graph's past (i32 on the device), or NULL */
  struct _Trace *trace;
} Step;

/* MOE_CUDA_TRACE=1: each forward prints where its time went, on the GPU
 * (events between marks) and on the host, by part of the stack, and how
 * evenly its MoE layers routed: the rows each expert got (what the grouped
 * GEMMs' m-tiles are cut from), from a copy of each layer's expert ids
 * (queued after the experts: it adds a few µs to "shared/dense"). With the
 * side stream, "experts" runs beside the shared expert, and "shared/dense"
 * is only how long the shared expert outlasts the routed ones. */
enum { PART_QKV, PART_ROPE_KV, PART_ATTEND, PART_O, PART_ROUTER, PART_EXPERTS, PART_SHARED, PART_HEAD, N_PARTS };
static const char *part_names[N_PARTS] = {
  "norm+qkv", "rope+kv", "attend", "o+norm", "router", "experts", "shared/dense", "embed+head"
};

typedef struct _Trace {
  gboolean    on;
  cudaEvent_t start;
  GArray     *events;   /* cudaEvent_t after each part */
  GArray     *parts;    /* int */
  double      host[N_PARTS];
  gint64      last;
  gint64     *routed;         /* pinned: each MoE layer's [rows, top_k] ids */
  guint       routed_layers;
  int         routed_rows, routed_k;
  guint       num_experts;
} Trace;

static void
trace_routing (Trace *tr, const MoeTransformer *m, MoeTensor *ids, int rows, cudaStream_t stream)
{
  const size_t n = (size_t) rows * m->top_k;

  if (!tr->on)
    return;
  if (tr->routed == NULL)
    {
      if (cudaMallocHost ((void **) &tr->routed, n * m->layers * sizeof (gint64)) != cudaSuccess)
        {
          tr->routed = NULL;
          return;
        }
      tr->routed_rows = rows, tr->routed_k = m->top_k, tr->num_experts = m->num_experts;
    }
  if (rows != tr->routed_rows || tr->routed_layers >= m->layers)
    return;
  cudaMemcpyAsync (tr->routed + tr->routed_layers++ * n, DATA (ids), n * sizeof (gint64), cudaMemcpyDeviceToHost, stream);
}

static int
compare_guint (gconstpointer a, gconstpointer b)
{
  return (int) *(const guint *) a - (int) *(const guint *) b;
}

/* the routing line: per layer the rows an expert (fewest, median, most),
 * the experts with none, and how full the m-tiles of 64, 128 and 192 rows
 * cut from them are, averaged over the layers */
static void
trace_routing_report (const Trace *tr)
{
  static const int bm[3] = { 64, 128, 192 };
  const size_t n = (size_t) tr->routed_rows * tr->routed_k;
  double lo = 0, median = 0, hi = 0, empty = 0, fill[3] = { 0, };
  g_autofree guint *count = g_new (guint, tr->num_experts);

  if (tr->routed_layers == 0)
    return;
  for (guint l = 0; l < tr->routed_layers; l++)
    {
      const gint64 *ids = tr->routed + l * n;
      guint64 routed = 0, tiled[3] = { 0, };

      memset (count, 0, tr->num_experts * sizeof (guint));
      for (size_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < tr->num_experts)
          count[ids[i]]++, routed++;
      for (guint e = 0; e < tr->num_experts; e++)
        for (int b = 0; b < 3; b++)
          tiled[b] += (count[e] + bm[b] - 1) / bm[b] * (guint64) bm[b];
      for (int b = 0; b < 3; b++)
        fill[b] += tiled[b] ? (double) routed / tiled[b] : 0;
      qsort (count, tr->num_experts, sizeof (guint), compare_guint);
      lo += count[0], median += count[tr->num_experts / 2], hi += count[tr->num_experts - 1];
      for (guint e = 0; e < tr->num_experts && count[e] == 0; e++)
        empty++;
    }
  double L = tr->routed_layers;
  g_printerr ("moe-cuda routing T=%d top-%d over %u experts, mean of %u layers: rows an expert fewest %.1f median %.1f "
              "most %.1f, experts with none %.1f; m-tile fill 64: %.0f%%, 128: %.0f%%, 192: %.0f%%\n",
              tr->routed_rows, tr->routed_k, tr->num_experts, tr->routed_layers, lo / L, median / L, hi / L, empty / L,
              100 * fill[0] / L, 100 * fill[1] / L, 100 * fill[2] / L);
}

static void
trace_mark (Trace *tr, cudaStream_t stream, int part)
{
  cudaEvent_t ev;
  gint64 now;

  if (!tr->on)
    return;
  cudaEventCreate (&ev);
  cudaEventRecord (ev, stream);
  g_array_append_val (tr->events, ev);
  g_array_append_val (tr->parts, part);
  now = g_get_monotonic_time ();
  tr->host[part] += (now - tr->last) / 1000.0;
  tr->last = now;
}

static void
trace_report (Trace *tr, const MoeDecoderStep *st)
{
  double gpu[N_PARTS] = { 0, }, total = 0, host = 0;
  cudaEvent_t prev = tr->start;
  GString *line;

  if (!tr->on)
    return;
  cudaEventSynchronize (g_array_index (tr->events, cudaEvent_t, tr->events->len - 1));
  for (guint i = 0; i < tr->events->len; i++)
    {
      cudaEvent_t ev = g_array_index (tr->events, cudaEvent_t, i);
      float ms = 0;
      cudaEventElapsedTime (&ms, prev, ev);
      gpu[g_array_index (tr->parts, int, i)] += ms;
      total += ms;
      prev = ev;
    }
  line = g_string_new (NULL);
  g_string_append_printf (line, "moe-cuda trace B=%u T=%u past=%u:", st->batch, st->n_tokens, st->cache->length);
  for (int p = 0; p < N_PARTS; p++)
    {
      g_string_append_printf (line, " %s %.3f/%.3f", part_names[p], gpu[p], tr->host[p]);
      host += tr->host[p];
    }
  g_string_append_printf (line, " | total gpu %.3f host %.3f ms", total, host);
  g_printerr ("%s\n", line->str);
  g_string_free (line, TRUE);
  trace_routing_report (tr);
}

/* also where a step fails part-way */
static void
trace_clear (Trace *tr)
{
  if (!tr->on)
    return;
  for (guint i = 0; i < tr->events->len; i++)
    cudaEventDestroy (g_array_index (tr->events, cudaEvent_t, i));
  cudaEventDestroy (tr->start);
  if (tr->routed != NULL)
    cudaFreeHost (tr->routed);
  g_array_unref (tr->events);
  g_array_unref (tr->parts);
}

G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC (Trace, trace_clear)

static gboolean
cublas_check (cublasStatus_t st, const char *what, GError **error)
{
  if (st == CUBLAS_STATUS_SUCCESS)
    return TRUE;
  g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED, "cuBLAS: %s failed (status %d)", what, (int) st);
  return FALSE;
}

/* Many queries (prefill): per chunk of queries, scores = q·kᵀ for every
 * (sequence, head) as one batched GEMM on the tensor cores, the masked
 * softmax, then probabilities·v as another; chunks keep the scores under
 * 64 MiB. */
static gboolean
attend_gemm (Decoder *d, const Step *s, guint li, MoeTensor *q, gsize q_offset, int q_row_stride, int dk, int dv,
             MoeTensor *out, GError **error)
{
  const MoeTransformer *m = d->m;
  int B = s->st->batch, T = s->st->n_tokens, heads = m->heads, group = m->heads / m->kv_heads;
  int n = B * heads, full = s->past + T;
  /* chunks of queries: less memory, and causal chunks skip the later keys */
  int chunk = MAX (1, MIN (T, (int) ((64u << 20) / ((gsize) n * full * sizeof (float)))));
  cudaDataType_t type = cuda_type (d->dtype);
  const float one = 1.0f, zero = 0.0f;
  MoeCudaSoftmax sm = {
    .dtype = d->dtype, .batch = B, .heads = heads, .n_tokens = T, .past = s->past,
    .key_valid = s->key_valid ? DATA (s->key_valid) : NULL, .window = m->layer[li].window,
    .sinks = OPT (d->layer[li].sinks), .eager = m->eager_attention,
  };

  for (int t0 = 0; t0 < T; t0 += chunk)
    {
      int rows = MIN (chunk, T - t0), len = s->past + t0 + rows;   /* later keys are masked anyway */
      g_autoptr(MoeTensor) scores = new_f32 (d, (gint64) n * rows, len, error);
      g_autoptr(MoeTensor) probs = scores ? new_act (d, (gint64) n * rows, len, error) : NULL;
      g_autoptr(MoeTensor) ptrs = NULL;
      gint64 n_ptrs = 6 * (gint64) n;
      MoeCudaAttentionPointers pa = {
        .n = n, .heads = heads, .group = group, .n_tokens = T, .t0 = t0, .rows = rows, .len = len,
        .capacity = s->cache->capacity, .dk = dk, .dv = dv, .q_row_stride = q_row_stride, .elem = d->elem,
      };
      const void **dp;
      gboolean ok;

      if (probs == NULL || (ptrs = moe_tensor_new_empty (MOE_DEVICE (d->dev), MOE_DTYPE_I64, &n_ptrs, 1, error)) == NULL)
        return FALSE;
      pa.k = DATA (s->cache->k[li]);
      pa.q = (const char *) DATA (q) + q_offset * d->elem;
      pa.scores = DATA (scores);
      pa.v = DATA (s->cache->v[li]);
      pa.probs = DATA (probs);
      pa.out = DATA (out);
      dp = DATA (ptrs);
      moe_cuda_attention_pointers (&pa, dp, d->dev->stream);

      g_mutex_lock (&d->dev->lock);
      ok = cublas_check (cublasGemmBatchedEx (d->dev->cublas, CUBLAS_OP_T, CUBLAS_OP_N, len, rows, dk, &m->scaling,
                                              dp, type, dk, dp + n, type, q_row_stride, &zero,
                                              (void **) (dp + 2 * n), CUDA_R_32F, len, n,
                                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "attention scores", error);
      g_mutex_unlock (&d->dev->lock);
      if (!ok)
        return FALSE;
      sm.t0 = t0;
      sm.rows = rows;
      sm.len = len;
      sm.scores = DATA (scores);
      sm.probs = DATA (probs);
      moe_cuda_attention_softmax (&sm, d->dev->stream);
      g_mutex_lock (&d->dev->lock);
      ok = cublas_check (cublasGemmBatchedEx (d->dev->cublas, CUBLAS_OP_N, CUBLAS_OP_N, dv, rows, len, &one,
                                              dp + 3 * n, type, dv, dp + 4 * n, type, len, &zero,
                                              (void **) (dp + 5 * n), type, heads * dv, n,
                                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "attention values", error);
      g_mutex_unlock (&d->dev->lock);
      if (!ok)
        return FALSE;
    }
  return TRUE;
}

/* The attention of @s's query rows, each @q_row_stride elements apart
 * from @q_offset in @q, over the keys and values in the cache */
/* With @rope (attention_gqa's decode steps), @q's rows are the projected
 * q/k/v before RoPE, and the attention kernel rotates them and writes the
 * cache (see MoeCudaAttention) */
static MoeTensor *
attend (Decoder *d, const Step *s, guint li, MoeTensor *q, gsize q_offset, int q_row_stride, int dk, int dv,
        gboolean rope, GError **error)
{
  const MoeTransformer *m = d->m;
  g_autoptr(MoeTensor) out = new_act (d, s->rows, (gint64) m->heads * dv, error), partial = NULL;
  MoeCudaAttention a = {
    .dtype = d->dtype, .batch = s->st->batch, .n_tokens = s->st->n_tokens, .past = s->past,
    .heads = m->heads, .kv_heads = m->kv_heads, .dk = dk, .dv = dv,
    .q = out ? (const char *) DATA (q) + q_offset * d->elem : NULL, .q_row_stride = q_row_stride,
    .k_cache = out ? DATA (s->cache->k[li]) : NULL, .v_cache = out ? DATA (s->cache->v[li]) : NULL,
    .capacity = s->cache->capacity,
    .past_dev = s->past_dev ? DATA (s->past_dev) : NULL, .max_len = s->cache->capacity,
    .key_valid = s->key_valid ? DATA (s->key_valid) : NULL, .key_valid_stride = s->key_valid_stride,
    .window = m->layer[li].window,
    .sinks = OPT (d->layer[li].sinks),
    .scaling = m->scaling, .eager = m->eager_attention,
    .positions = rope ? DATA (s->positions) : NULL, .inv_freq = rope ? DATA (d->inv_freq) : NULL,
    .rope_dim = m->rope_dim, .rope_scale = m->rope_scale,
  };
  const char *msg;

  if (out == NULL)
    return NULL;
  /* many queries: on the tensor cores, one flash kernel where it fits;
   * a few (decode): one kernel */
  a.out = DATA (out);
  if ((int) s->st->n_tokens >= d->prefill_attention_tokens)
    {
      if (!moe_cuda_flash_attention_fits (&a))
        return attend_gemm (d, s, li, q, q_offset, q_row_stride, dk, dv, out, error) ? g_steal_pointer (&out) : NULL;
      moe_cuda_flash_attention (&a, d->dev->stream);
      return g_steal_pointer (&out);
    }
  /* a long context: blocks of keys, then their combination (eager
   * attention rounds probabilities normalised over every key: one block) */
  if (!m->eager_attention && d->attention_split > 0 && moe_cuda_attention_keys (&a) > d->attention_split)
    {
      a.split_keys = d->attention_split;
      partial = new_f32 (d, (gint64) s->rows * m->heads * moe_cuda_attention_splits (&a), dv + 2, error);
      if (partial == NULL)
        return NULL;
      a.partial = DATA (partial);
    }
  msg = moe_cuda_attention (&a, d->dev->stream);
  if (msg != NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED, "cuda attention over %u positions: %s",
                   s->past + s->st->n_tokens, msg);
      return NULL;
    }
  return g_steal_pointer (&out);
}

static void
rope (Decoder *d, const Step *s, MoeTensor *x, gsize offset, int heads, int row_stride, int head_stride)
{
  const MoeTransformer *m = d->m;
  moe_cuda_rope (d->dtype, (char *) DATA (x) + offset * d->elem, s->rows, heads, row_stride, head_stride,
                 DATA (s->positions), DATA (d->inv_freq), m->rope_dim, m->rope_scale, m->rope_interleaved,
                 d->dev->stream);
}

/* attend () of every query row of @q (rows @q_row_stride elements apart),
 * or (@last_rows) of each sequence's last only, at its last position over
 * all its keys; @rows: the output's rows */
static MoeTensor *
attend_rows (Decoder *d, const Step *s, guint li, gboolean last_rows, MoeTensor *q, int q_row_stride, int dk, int dv,
             gboolean rope, int *rows, GError **error)
{
  MoeDecoderStep last_st = *s->st;
  Step last = *s;
  int T = (int) s->st->n_tokens;

  *rows = s->rows;
  if (!last_rows)
    return attend (d, s, li, q, 0, q_row_stride, dk, dv, rope, error);
  last_st.n_tokens = 1;
  last.st = &last_st;
  last.past = s->past + T - 1;
  last.rows = *rows = (int) s->st->batch;
  return attend (d, &last, li, q, (gsize) (T - 1) * q_row_stride, T * q_row_stride, dk, dv, rope, error);
}

/* q/k/v, the KV-cache write and the attention of @x's rows, then o; with
 * @last_rows only each sequence's last row asks (every row's keys and
 * values still go to the cache), and o's rows are those */
static MoeTensor *
attention_gqa (Decoder *d, const Step *s, guint li, MoeTensor *x, gboolean last_rows, GError **error)
{
  const MoeTransformer *m = d->m;
  const DevLayer *L = &d->layer[li];
  int rows = s->rows, hd = m->head_dim, qn = m->heads * hd, kn = m->kv_heads * hd, n = qn + 2 * kn;
  g_autoptr(MoeTensor) qkv = NULL, a = NULL;
  /* a decode step (one token a sequence, the few-query kernel): RoPE and
   * the KV write in the attention kernel */
  const gboolean rope_in_attention = d->rope_in_attention && s->st->n_tokens == 1 && !last_rows &&
                                     !m->rope_interleaved && rows <= d->rope_store_rows &&
                                     d->prefill_attention_tokens > 1;
  cudaStream_t stream = d->dev->stream;

  /* one projection: each row is [q | k | v] */
  if ((qkv = linear (d, &L->qkv, x, m->hidden, rows, error)) == NULL)
    return NULL;
  trace_mark (s->trace, stream, PART_QKV);
  if (m->qk_norm == QK_NORM_FULL)
    {
      norm (d, qkv, 0, NULL, rows, qn, n, L->q_norm, qkv, 0, n);
      norm (d, qkv, qn, NULL, rows, kn, n, L->k_norm, qkv, qn, n);
    }
  else if (m->qk_norm == QK_NORM_PER_HEAD)
    {
      norm_groups (d, qkv, 0, NULL, NULL, rows, hd, m->heads, hd, n, L->q_norm, qkv, 0, n);
      norm_groups (d, qkv, qn, NULL, NULL, rows, hd, m->kv_heads, hd, n, L->k_norm, qkv, qn, n);
    }
  if (m->clip_qkv > 0)
    moe_cuda_clamp (d->dtype, DATA (qkv), (gsize) rows * n, m->clip_qkv, stream);
  if (rope_in_attention)
    {
      /* attend () below rotates and caches them */
    }
  else if (!m->rope_interleaved && rows <= d->rope_store_rows)
    moe_cuda_rope_store_kv (d->dtype, DATA (qkv), s->st->batch, s->st->n_tokens, n, m->heads, m->kv_heads, hd,
                            DATA (s->positions), DATA (d->inv_freq), m->rope_dim, m->rope_scale,
                            DATA (s->cache->k[li]), DATA (s->cache->v[li]), s->cache->capacity, s->past,
                            OPT (s->past_dev), stream);
  else if (!m->rope_interleaved)
    moe_cuda_rope_store_kv_rows (d->dtype, DATA (qkv), s->st->batch, s->st->n_tokens, n, m->heads, m->kv_heads,
                                 hd, DATA (s->positions), DATA (d->inv_freq), m->rope_dim, m->rope_scale,
                                 DATA (s->cache->k[li]), DATA (s->cache->v[li]), s->cache->capacity, s->past,
                                 OPT (s->past_dev), stream);
  else
    {
      /* q's heads and k's follow each other in the row: one rotation */
      rope (d, s, qkv, 0, m->heads + m->kv_heads, n, hd);
      moe_cuda_store_kv (d->dtype, s->st->batch, s->st->n_tokens, m->kv_heads,
                         (char *) DATA (qkv) + (gsize) qn * d->elem, n, hd, hd, NULL, 0, 0, 0,
                         (char *) DATA (qkv) + (gsize) (qn + kn) * d->elem, n, hd, hd,
                         DATA (s->cache->k[li]), DATA (s->cache->v[li]), s->cache->capacity, s->past,
                         OPT (s->past_dev), stream);
    }
  trace_mark (s->trace, stream, PART_ROPE_KV);
  a = attend_rows (d, s, li, last_rows, qkv, n, hd, hd, rope_in_attention, &rows, error);
  trace_mark (s->trace, stream, PART_ATTEND);
  return a ? linear (d, &L->o, a, qn, rows, error) : NULL;
}

/* DeepSeek's multi-head latent attention (see moe-transformer.c);
 * @last_rows as attention_gqa's */
static MoeTensor *
attention_mla (Decoder *d, const Step *s, guint li, MoeTensor *x, gboolean last_rows, GError **error)
{
  const MoeTransformer *m = d->m;
  const DevLayer *L = &d->layer[li];
  int rows = s->rows, qk = m->head_dim, nope = m->nope_dim, rd = m->rope_dim, dv = m->v_head_dim;
  int kvb = nope + dv, lat = m->kv_lora + rd;
  g_autoptr(MoeTensor) q = NULL, latent = NULL, kv = NULL, a = NULL;

  if (m->q_lora > 0)
    {
      g_autoptr(MoeTensor) qa = linear (d, &L->q_a, x, m->hidden, rows, error);
      if (qa == NULL)
        return NULL;
      norm (d, qa, 0, NULL, rows, m->q_lora, m->q_lora, L->q_a_norm, qa, 0, m->q_lora);
      q = linear (d, &L->q_b, qa, m->q_lora, rows, error);
    }
  else
    q = linear (d, &L->q, x, m->hidden, rows, error);
  if (q == NULL || (latent = linear (d, &L->kv_a, x, m->hidden, rows, error)) == NULL)
    return NULL;
  norm (d, latent, 0, NULL, rows, m->kv_lora, lat, L->kv_a_norm, latent, 0, lat);
  if ((kv = linear (d, &L->kv_b, latent, lat, rows, error)) == NULL)
    return NULL;

  rope (d, s, latent, m->kv_lora, 1, lat, 0);
  rope (d, s, q, nope, m->heads, m->heads * qk, qk);
  moe_cuda_store_kv (d->dtype, s->st->batch, s->st->n_tokens, m->heads,
                     DATA (kv), m->heads * kvb, kvb, nope,
                     (char *) DATA (latent) + (gsize) m->kv_lora * d->elem, lat, 0, rd,
                     (char *) DATA (kv) + (gsize) nope * d->elem, m->heads * kvb, kvb, dv,
                     DATA (s->cache->k[li]), DATA (s->cache->v[li]), s->cache->capacity, s->past,
                     OPT (s->past_dev), d->dev->stream);
  a = attend_rows (d, s, li, last_rows, q, m->heads * qk, qk, dv, FALSE, &rows, error);
  return a ? linear (d, &L->o, a, m->heads * dv, rows, error) : NULL;
}

/* The GEMV form of a dense MLP or shared expert, for a few rows, in two
 * halves (a shared expert's first may run on the side stream): h =
 * act(gate(x)) · up(x) on @stream, in the GEMV's epilogue … */
static MoeTensor *
gemv_gate_up (Decoder *d, cudaStream_t stream, const DevLayer *L, MoeTensor *x, int rows, GError **error)
{
  int inter = L->gate_up.out / 2, H = d->m->hidden;
  g_autoptr(MoeTensor) h = new_act (d, rows, inter, error);

  if (h == NULL)
    return NULL;
  MoeCudaGemv gu = {
    .dtype = d->dtype, .w = DATA (L->gate_up.weight), .out = inter, .in = H, .rows = rows,
    .x = DATA (x), .ldx = H, .bias = OPT (L->gate_up.bias), .y = DATA (h),
    .gated = TRUE, .activation = d->m->act_fn,
  };
  moe_cuda_gemv (&gu, stream);
  return g_steal_pointer (&h);
}

/* … then down(h) into a new tensor, or added to @into (the routed
 * experts' output; times sigmoid(@gate) where the model gates it) */
static MoeTensor *
gemv_down (Decoder *d, cudaStream_t stream, const DevLayer *L, MoeTensor *h, int rows, MoeTensor *into,
           MoeTensor *gate, GError **error)
{
  int inter = L->gate_up.out / 2, H = d->m->hidden;
  g_autoptr(MoeTensor) y = into ? g_object_ref (into) : new_act (d, rows, H, error);

  if (y == NULL)
    return NULL;
  MoeCudaGemv down = {
    .dtype = d->dtype, .w = DATA (L->down.weight), .out = H, .in = inter, .rows = rows,
    .x = DATA (h), .ldx = inter, .y = DATA (y), .add = into != NULL, .gate = OPT (gate), .gate_stride = 1,
  };
  moe_cuda_gemv (&down, stream);
  return g_steal_pointer (&y);
}

/* act(gate(x)) · up(x), then down, on @stream: a dense MLP, or the shared
 * expert (times sigmoid(@gate) where the model gates it) in a tensor of its
 * own or added to @into (as gemv_down). A few rows: the two GEMVs; more:
 * cuBLAS and the activation kernel between them. */
static MoeTensor *
mlp (Decoder *d, cudaStream_t stream, const DevLayer *L, MoeTensor *x, int rows, MoeTensor *into, MoeTensor *gate,
     GError **error)
{
  int inter = L->gate_up.out / 2, H = d->m->hidden;

  if (rows <= d->gemv_rows)
    {
      g_autoptr(MoeTensor) h = gemv_gate_up (d, stream, L, x, rows, error);
      return h ? gemv_down (d, stream, L, h, rows, into, gate, error) : NULL;
    }
  {
    g_autoptr(MoeTensor) gu = project_on (d, stream, &L->gate_up, x, H, rows, FALSE, error);
    const gint64 shape[2] = { rows, H };

    if (gu == NULL)
      return NULL;
    /* the shared expert's sigmoid gate multiplies h = act(g) · u before
     * its rounding, and its down GEMM adds to @into (beta = 1):
     * down(sigmoid(s) · h) = sigmoid(s) · down(h), with one rounding where
     * transformers has three (down's, the gate's product, the sum), which
     * moves the sum by about an ulp of the model dtype */
    moe_cuda_act_mul (d->dtype, DATA (gu), rows, inter, 2 * inter, d->m->act_fn, OPT (gate), stream);
    if (into == NULL)
      return project_on (d, stream, &L->down, gu, 2 * inter, rows, FALSE, error);
    /* in place: @into is [rows, H], rows H apart (a tensor of its own),
     * and a shared expert has no biases (moe-transformer.c) */
    if (!moe_tensor_has_shape (into, shape, 2) || moe_tensor_get_dtype (into) != d->m->dtype ||
        L->down.bias != NULL)
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_FAILED,
                     "On cuda the shared expert adds to the routed experts' output: it must be [%d, %d] "
                     "in the model dtype, and the shared expert without biases", rows, H);
        return NULL;
      }
    return gemm (d, stream, &L->down, gu, 2 * inter, rows, FALSE, into, TRUE, error) ? g_object_ref (into) : NULL;
  }
}

/* The routed experts' output; with a shared expert made on the side stream,
 * the shared expert's apart in @shared_out, for the residual add to sum;
 * else added to the routed output. */
static MoeTensor *
moe_block (Decoder *d, guint li, MoeTensor *x, int rows, Trace *tr, MoeTensor **shared_out, GError **error)
{
  const MoeTransformer *m = d->m;
  const DevLayer *L = &d->layer[li];
  gint64 ks[2] = { rows, m->top_k };
  g_autoptr(MoeTensor) ids = moe_tensor_new_empty (MOE_DEVICE (d->dev), MOE_DTYPE_I64, ks, 2, error);
  g_autoptr(MoeTensor) w = ids ? new_f32 (d, rows, m->top_k, error) : NULL;
  g_autoptr(MoeTensor) y = NULL, logits = NULL;
  MoeCudaRouter r = {
    .dtype = d->dtype, .rows = rows, .num_experts = m->num_experts, .top_k = m->top_k,
    .kind = m->router_kind, .norm_topk = m->norm_topk, .weights_in_act_dtype = m->weights_in_act_dtype,
    .routed_scale = m->routed_scale, .n_group = m->n_group, .topk_group = m->topk_group,
  };

  cudaStream_t stream = d->dev->stream;
  /* the shared expert (reading the same x) on the side stream, beside the
   * router and the routed experts: for a few rows, GEMVs (one alone leaves
   * the memory part idle: too few bytes in flight); for many, cuBLAS's
   * GEMMs, bound by the tensor cores, beside the routed experts' GEMMs,
   * bound by the weights' bytes at a prefill's rows an expert, and in the
   * gaps of the routing's small kernels */
  const gboolean side = m->has_shared && d->side != NULL;
  g_autoptr(MoeTensor) gate = NULL, shared = NULL;

  if (w == NULL)
    return NULL;
  if (side)
    {
      cudaEventRecord (d->fork, stream);
      cudaStreamWaitEvent (d->side, d->fork, 0);
      if (!m->shared_gated || (gate = project_on (d, d->side, &L->shared_gate, x, m->hidden, rows, FALSE, error)))
        shared = mlp (d, d->side, L, x, rows, NULL, gate, error);
      /* joined on every path: a capture must not end with a fork open */
      cudaEventRecord (d->join, d->side);
    }
  /* a few rows: the routing kernel makes the router's logits itself */
  if (rows <= d->gemv_rows && m->hidden * d->elem % 16 == 0)
    {
      r.w = DATA (L->router.weight);
      r.x = DATA (x);
      r.hidden = r.ldx = m->hidden;
    }
  if ((!side || shared != NULL) && (r.w != NULL || (logits = project (d, &L->router, x, m->hidden, rows, TRUE, error)) != NULL))
    {
      r.logits = OPT (logits);
      r.bias = OPT (L->router_bias);
      r.score_bias = OPT (L->score_bias);
      r.ids = DATA (ids);
      r.weights = DATA (w);
      moe_cuda_route (&r, stream);
      trace_mark (tr, stream, PART_ROUTER);
      if ((y = moe_experts_forward (m->layer[li].experts, x, ids, w, error)) != NULL)
        {
          trace_mark (tr, stream, PART_EXPERTS);
          trace_routing (tr, m, ids, rows, stream);
        }
    }
  if (side)
    cudaStreamWaitEvent (stream, d->join, 0);
  if (y == NULL || !m->has_shared)
    return g_steal_pointer (&y);
  if (side)
    {
      *shared_out = g_steal_pointer (&shared);
      return g_steal_pointer (&y);
    }
  if (m->shared_gated && (gate = linear (d, &L->shared_gate, x, m->hidden, rows, error)) == NULL)
    return NULL;
  {
    g_autoptr(MoeTensor) sum = mlp (d, stream, L, x, rows, y, gate, error);
    if (sum == NULL)
      return NULL;
  }
  return g_steal_pointer (&y);
}

/* The decoder on @ids (on the device), into @logits_f32 [rows or B, V]:
 * everything it queues may be captured into a CUDA graph. */
static gboolean
run_step (Decoder *d, Step *s, MoeTensor *ids, MoeTensor *logits_f32, GError **error)
{
  const MoeTransformer *m = d->m;
  const MoeDecoderStep *st = s->st;
  Trace *tr = s->trace;
  int rows = s->rows, H = m->hidden, out_rows = st->last_only ? (int) st->batch : rows;
  g_autoptr(MoeTensor) h = NULL, x = NULL, y = NULL, y_shared = NULL, xf = NULL, logits = NULL;
  /* Where only each sequence's last row makes logits (a prompt that
   * generates), the last layer after its keys and values runs on those
   * rows alone: nothing reads the other rows' output (llama.cpp trims the
   * same way; per-row results do not change; the CPU decoder trims as
   * well). Not in a graph: decode steps have one row a sequence anyway. */
  const gboolean trim_last = d->trim_last && st->last_only && rows > out_rows && s->past_dev == NULL;

  if ((h = new_act (d, rows, H, error)) == NULL || (x = new_act (d, rows, H, error)) == NULL)
    return FALSE;
  moe_cuda_embed (d->dtype, DATA (d->embed), DATA (ids), rows, H, DATA (h), d->dev->stream);
  trace_mark (tr, d->dev->stream, PART_HEAD);

  for (guint li = 0; li < m->layers; li++)
    {
      const DevLayer *L = &d->layer[li];
      const gboolean trim = trim_last && li + 1 == m->layers;
      g_autoptr(MoeTensor) a = NULL;

      /* the previous layer's residual add, fused with this norm */
      norm_groups (d, h, 0, y, y_shared, rows, H, 1, 0, H, L->input_norm, x, 0, H);
      g_clear_object (&y_shared);
      a = m->family == FAMILY_DEEPSEEK_V3 ? attention_mla (d, s, li, x, trim, error)
                                          : attention_gqa (d, s, li, x, trim, error);
      if (a == NULL)
        return FALSE;
      if (trim)
        {
          /* the residual stream's last rows, and only they from here on
           * (x too: the experts take their rows from its shape) */
          g_autoptr(MoeTensor) last = new_act (d, out_rows, H, error);
          gsize row_bytes = (gsize) H * d->elem;

          g_clear_object (&x);
          if (last == NULL || (x = new_act (d, out_rows, H, error)) == NULL ||
              !moe_cuda_check (cudaMemcpy2DAsync (DATA (last), row_bytes,
                                                  (const char *) DATA (h) + (st->n_tokens - 1) * row_bytes,
                                                  st->n_tokens * row_bytes, row_bytes, out_rows,
                                                  cudaMemcpyDeviceToDevice, d->dev->stream),
                               "the last rows of the residual stream", error))
            return FALSE;
          g_object_unref (h);
          h = g_steal_pointer (&last);
          rows = out_rows;
        }
      norm (d, h, 0, a, rows, H, H, L->post_norm, x, 0, H);
      trace_mark (tr, d->dev->stream, PART_O);
      g_clear_object (&y);
      y = m->layer[li].is_moe ? moe_block (d, li, x, rows, tr, &y_shared, error)
                              : mlp (d, d->dev->stream, L, x, rows, NULL, NULL, error);
      if (y == NULL)
        return FALSE;
      trace_mark (tr, d->dev->stream, PART_SHARED);
    }

  /* the last residual add and the final norm, on the rows that make logits */
  if ((xf = new_act (d, out_rows, H, error)) == NULL)
    return FALSE;
  if (rows != out_rows)
    norm_groups (d, h, (gsize) (st->n_tokens - 1) * H, y, y_shared, st->batch, H, 1, 0, st->n_tokens * H,
                 d->final_norm, xf, 0, H);
  else
    norm_groups (d, h, 0, y, y_shared, rows, H, 1, 0, H, d->final_norm, xf, 0, H);
  {
    DevLinear head = { d->lm_head, NULL, m->vocab, H };
    logits = linear (d, &head, xf, H, out_rows, error);
  }
  if (logits == NULL)
    return FALSE;
  moe_cuda_to_f32 (d->dtype, DATA (logits), (gsize) out_rows * m->vocab, DATA (logits_f32), d->dev->stream);
  trace_mark (tr, d->dev->stream, PART_HEAD);
  return moe_cuda_check (cudaGetLastError (), "the decoder's kernels", error);
}

/* What a decode graph depends on besides the batch and the cache's
 * capacity: every MoE layer's experts implementation; NULL where one reads
 * the routing on the host (eager), which a graph cannot hold. */
static char *
graph_signature (Decoder *d)
{
  GString *sig = g_string_new (NULL);

  for (guint i = 0; i < d->m->layers; i++)
    if (d->m->layer[i].is_moe)
      {
        const char *impl = moe_experts_get_implementation (d->m->layer[i].experts);
        if (g_str_equal (impl, "eager"))
          return g_string_free (sig, TRUE), NULL;
        g_string_append_printf (sig, "%s,", impl);
      }
  return g_string_free (sig, FALSE);
}

static MoeTensor *
new_typed (Decoder *d, MoeDType dtype, gint64 n, GError **error)
{
  return moe_tensor_new_empty (MOE_DEVICE (d->dev), dtype, &n, 1, error);
}

/* The step's result to the host, and the wait for it: the logits, or only
 * each row's token, picked on the device — greedy, or sampled (the rows
 * the kernel leaves to the host get their logits). */
static gboolean
send_back (Decoder *d, const MoeDecoderStep *st, MoeTensor *logits_f32, int rows, GError **error)
{
  MoeDeviceClass *klass = MOE_DEVICE_GET_CLASS (d->dev);
  cudaStream_t stream = d->dev->stream;
  const MoeSampling *sampling = st->sampling;
  const gsize row_bytes = (gsize) d->m->vocab * sizeof (float);
  g_autoptr(MoeTensor) tokens = NULL, draws = NULL;

  if (st->tokens == NULL || (sampling != NULL && !d->sample))
    {
      /* (every row left to the host, where sampling takes no token) */
      for (int r = 0; st->tokens != NULL && r < rows; r++)
        st->tokens[r] = -1;
      return klass->copy_to_host (MOE_DEVICE (d->dev), st->logits, DATA (logits_f32), rows * row_bytes, error);
    }
  if ((tokens = new_typed (d, MOE_DTYPE_I64, rows, error)) == NULL)
    return FALSE;
  if (sampling == NULL)
    moe_cuda_argmax (DATA (logits_f32), rows, (int) d->m->vocab, DATA (tokens), stream);
  else
    {
      MoeCudaSampling s = { DATA (logits_f32), rows, (int) d->m->vocab, (float) sampling->temperature,
                            (int) MIN (sampling->top_k, (guint) G_MAXINT), sampling->top_p, NULL, DATA (tokens) };

      if ((draws = upload (d, MOE_DTYPE_F64, sampling->draws, rows, error)) == NULL)
        return FALSE;
      s.draws = DATA (draws);
      moe_cuda_sample (&s, stream);
    }
  if (!moe_cuda_check (cudaMemcpyAsync (st->tokens, DATA (tokens), (gsize) rows * sizeof (gint64),
                                        cudaMemcpyDeviceToHost, stream), "copying the chosen tokens", error) ||
      !moe_device_synchronize (MOE_DEVICE (d->dev), error))
    return FALSE;
  for (int r = 0; sampling != NULL && r < rows; r++)
    if (st->tokens[r] < 0 && sampling->draws[r] >= 0 &&
        !klass->copy_to_host (MOE_DEVICE (d->dev), (char *) st->logits + r * row_bytes,
                              (const char *) DATA (logits_f32) + r * row_bytes, row_bytes, error))
      return FALSE;
  return TRUE;
}

/* A one-token step through the cache's graph: the inputs into its fixed
 * buffers, then a replay (capturing it first where it is due). FALSE with
 * no error set: no graph for this step, run it directly. */
static gboolean
graph_step (Decoder *d, Step *s, const char *sig, GError **error)
{
  const MoeDecoderStep *st = s->st;
  DevCache *c = s->cache;
  MoeCudaDevice *dev = d->dev;
  cudaStream_t stream = dev->stream;
  guint B = st->batch, len = s->past + 1;
  int past = s->past;

  if (c->exec != NULL && g_strcmp0 (c->signature, sig) != 0)
    graph_drop (dev, c);
  if (c->exec == NULL && (g_strcmp0 (c->warm, sig) != 0 || g_strcmp0 (c->failed, sig) == 0))
    return FALSE;
  if (c->g_ids == NULL &&
      ((c->g_ids = new_typed (d, MOE_DTYPE_I64, B, error)) == NULL ||
       (c->g_positions = new_typed (d, MOE_DTYPE_I64, B, error)) == NULL ||
       (c->g_past = new_typed (d, MOE_DTYPE_I32, 1, error)) == NULL ||
       (c->g_valid = new_typed (d, MOE_DTYPE_U8, (gint64) B * c->capacity, error)) == NULL ||
       (c->g_logits = new_f32 (d, B, d->m->vocab, error)) == NULL))
    return FALSE;

  /* this step's inputs (the masks as [B, capacity]) */
  if (!moe_cuda_check (cudaMemcpyAsync (DATA (c->g_ids), st->ids, B * sizeof (gint64), cudaMemcpyHostToDevice, stream),
                       "a decode graph's input", error) ||
      !moe_cuda_check (cudaMemcpyAsync (DATA (c->g_positions), st->positions, B * sizeof (gint64),
                                        cudaMemcpyHostToDevice, stream), "a decode graph's input", error) ||
      !moe_cuda_check (cudaMemcpyAsync (DATA (c->g_past), &past, sizeof past, cudaMemcpyHostToDevice, stream),
                       "a decode graph's input", error) ||
      !moe_cuda_check (st->key_valid != NULL
                       ? cudaMemcpy2DAsync (DATA (c->g_valid), c->capacity, st->key_valid, len, len, B,
                                            cudaMemcpyHostToDevice, stream)
                       : cudaMemset2DAsync (DATA (c->g_valid), c->capacity, 1, len, B, stream),
                       "a decode graph's input", error))
    return FALSE;

  if (c->exec == NULL)
    {
      Step gs = *s;
      GError *local = NULL;
      cudaGraph_t graph = NULL;
      cudaError_t err;
      gboolean ok;

      gs.positions = c->g_positions;
      gs.key_valid = c->g_valid;
      gs.key_valid_stride = c->capacity;
      gs.past_dev = c->g_past;
      moe_cuda_device_open_graph_pool (dev);
      err = cudaStreamBeginCapture (stream, cudaStreamCaptureModeRelaxed);
      ok = err == cudaSuccess && run_step (d, &gs, c->g_ids, c->g_logits, &local);
      if (err == cudaSuccess)
        err = cudaStreamEndCapture (stream, &graph);
      c->pool = moe_cuda_device_close_graph_pool (dev);
      if (ok && err == cudaSuccess)
        err = cudaGraphInstantiate (&c->exec, graph, 0);
      if (graph != NULL)
        cudaGraphDestroy (graph);
      if (!ok || err != cudaSuccess)
        {
          /* nothing captured ran: the step runs directly, now and later */
          g_debug ("moe-cuda: no decode graph: %s", local ? local->message : cudaGetErrorString (err));
          g_clear_error (&local);
          cudaGetLastError ();
          c->exec = NULL;
          graph_drop (dev, c);
          g_free (c->failed);
          c->failed = g_strdup (sig);
          return FALSE;
        }
      c->signature = g_strdup (sig);
    }
  return moe_cuda_check (cudaGraphLaunch (c->exec, stream), "replaying the decode graph", error) &&
         send_back (d, st, c->g_logits, B, error);
}

gboolean
moe_cuda_decoder_forward (MoeDevice  *device,
                          gpointer    decoder,
                          gpointer    step,
                          GError    **error)
{
  Decoder *d = decoder;
  const MoeTransformer *m = d->m;
  MoeDecoderStep *st = step;
  MoeKvCache *kv = st->cache;
  int rows = st->batch * st->n_tokens, out_rows = st->last_only ? (int) st->batch : rows;
  g_autoptr(GRecMutexLocker) exclusive = g_rec_mutex_locker_new (&d->dev->exclusive);
  g_autoptr(MoeTensor) ids = NULL, positions = NULL, key_valid = NULL, logits_f32 = NULL;
  g_autofree char *sig = NULL;
  DevCache *c;
  g_auto(Trace) tr = { 0, };
  Step s = { st, NULL, kv->length, rows, NULL, NULL, 0, NULL, &tr };
  GError *local = NULL;
  gsize n_valid;

  if (kv->device_cache == NULL)
    {
      c = g_new0 (DevCache, 1);
      c->batch = st->batch;
      c->layers = m->layers;
      c->k = g_new0 (MoeTensor *, m->layers);
      c->v = g_new0 (MoeTensor *, m->layers);
      kv->device_cache = c;
    }
  c = s.cache = kv->device_cache;
  if (!cache_reserve (d, c, s.past, s.past + st->n_tokens, error))
    return FALSE;

  /* decode steps replay a graph */
  /* (graphs hold the few-query attention kernel, which reads past on the
   * device; the prefill GEMM path's chunks depend on it) */
  if (d->graphs && st->n_tokens == 1 && (int) st->n_tokens < d->prefill_attention_tokens &&
      (sig = graph_signature (d)) != NULL)
    {
      if (graph_step (d, &s, sig, &local))
        return TRUE;
      if (local != NULL)
        {
          g_propagate_error (error, local);
          return FALSE;
        }
    }

  if (d->trace)
    {
      tr.on = TRUE;
      tr.events = g_array_new (FALSE, FALSE, sizeof (cudaEvent_t));
      tr.parts = g_array_new (FALSE, FALSE, sizeof (int));
      tr.last = g_get_monotonic_time ();
      cudaEventCreate (&tr.start);
      cudaEventRecord (tr.start, d->dev->stream);
    }
  ids = upload (d, MOE_DTYPE_I64, st->ids, rows, error);
  positions = ids ? upload (d, MOE_DTYPE_I64, st->positions, rows, error) : NULL;
  if (positions == NULL)
    return FALSE;
  /* a mask with nothing masked is no mask: the kernels skip reading it */
  n_valid = (gsize) st->batch * (s.past + st->n_tokens);
  if (st->key_valid != NULL && memchr (st->key_valid, 0, n_valid) != NULL &&
      (key_valid = upload (d, MOE_DTYPE_U8, st->key_valid, (gint64) n_valid, error)) == NULL)
    return FALSE;
  s.positions = positions;
  s.key_valid = key_valid;
  if ((logits_f32 = new_f32 (d, out_rows, m->vocab, error)) == NULL || !run_step (d, &s, ids, logits_f32, error))
    return FALSE;
  trace_report (&tr, st);
  if (sig != NULL)
    {
      g_free (c->warm);
      c->warm = g_steal_pointer (&sig);
    }
  return send_back (d, st, logits_f32, out_rows, error);
}
