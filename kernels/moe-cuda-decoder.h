/* moe-cuda-decoder.h: the kernels of a whole model's decoder stack on the
 * CUDA device (C ABI), besides the experts and cuBLAS's matmuls
 *
 * Activations are stored in the model dtype (MOE_CUDA_F32, _F16, _BF16),
 * computed in float32 and rounded to that dtype after each op, as torch
 * computes them; norm weights, routers and RoPE frequencies are float32.
 * Every function queues its work on @stream and returns at once.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Router kinds, as moe-transformer-private.h's RouterKind. */
enum { MOE_CUDA_ROUTER_SOFTMAX_TOPK, MOE_CUDA_ROUTER_SIGMOID_GROUPED, MOE_CUDA_ROUTER_TOPK_SOFTMAX };

/* out[r] = table[ids[r]] for @rows rows of @width */
void moe_cuda_embed          (int dtype, const void *table, const int64_t *ids, int rows, int width,
                              void *out, cudaStream_t stream);

/* RMSNorm of @rows rows, each @groups vectors of width @n @group_stride
 * apart (per-head norms; 1 and 0 for whole rows), rows @in_stride and
 * @out_stride elements apart; with @h_add, x = h + h_add first (rounded,
 * written back to x): the residual add fused with the next norm; with
 * @h_add2 too (laid out as @h_add), x = h + (h_add + h_add2), each sum
 * rounded: a shared expert's output made beside the routed experts'.
 * @weight_last: GPT-OSS's (w · x).to(dtype) instead of w · x.to(dtype). */
void moe_cuda_rms_norm       (int dtype, void *x, const void *h_add, const void *h_add2, int rows, int n, int groups,
                              int group_stride, int in_stride, const float *weight, float eps, int weight_last,
                              void *y, int out_stride, cudaStream_t stream);

/* x clamped to [-limit, limit] */
void moe_cuda_clamp          (int dtype, void *x, size_t n, float limit, cudaStream_t stream);

/* Rotates the first @rope_dim dims of each of @heads head vectors per row
 * (@head_stride apart; rows @row_stride apart) by the row's position.
 * @interleaved: DeepSeek's (x0, x1), (x2, x3)… pairs. */
void moe_cuda_rope           (int dtype, void *x, int rows, int heads, int row_stride, int head_stride,
                              const int64_t *positions, const float *inv_freq, int rope_dim,
                              float scale, int interleaved, cudaStream_t stream);

/* Writes rows [B, T] of keys and values into a layer's cache, laid out
 * [B][kv_heads][capacity][d], at positions past…past+T-1 (past read from
 * @past_dev where that is set: a CUDA graph's replays differ there). A key is @k1
 * (@n1 dims per head) followed by @k2 (@n2 dims, DeepSeek's shared RoPE
 * part: @k2_head_stride 0); strides in elements. */
void moe_cuda_store_kv       (int dtype, int batch, int n_tokens, int kv_heads,
                              const void *k1, int k1_row_stride, int k1_head_stride, int n1,
                              const void *k2, int k2_row_stride, int k2_head_stride, int n2,
                              const void *v, int v_row_stride, int v_head_stride, int dv,
                              void *k_cache, void *v_cache, int capacity, int past, const int *past_dev,
                              cudaStream_t stream);

/* For rows [B, T] of [q heads | k heads | v heads] (@head_dim each, rows
 * @row_stride apart): moe_cuda_rope on the q and k heads (not interleaved),
 * then moe_cuda_store_kv of k and v, in one kernel — for a few rows (a
 * decode step). A prefill's rows: moe_cuda_rope_store_kv_rows (a block per
 * (row, head) recomputes each row's cos and sin per head: a 2048-token
 * prefill was 6% slower this way than through the two). */
void moe_cuda_rope_store_kv  (int dtype, void *qkv, int batch, int n_tokens, int row_stride, int heads,
                              int kv_heads, int head_dim, const int64_t *positions, const float *inv_freq,
                              int rope_dim, float scale, void *k_cache, void *v_cache, int capacity, int past,
                              const int *past_dev, cudaStream_t stream);

/* The same cache and q, for many rows (a prefill): each row's cos and sin
 * computed once for all its heads. k's heads in @qkv are left as they were
 * (not rotated): attention reads keys from the cache. */
void moe_cuda_rope_store_kv_rows (int dtype, void *qkv, int batch, int n_tokens, int row_stride, int heads,
                                  int kv_heads, int head_dim, const int64_t *positions, const float *inv_freq,
                                  int rope_dim, float scale, void *k_cache, void *v_cache, int capacity,
                                  int past, const int *past_dev, cudaStream_t stream);

typedef struct {
  int dtype;
  int batch, n_tokens, past;           /* keys 0…past+n_tokens-1 */
  const int *past_dev;                  /* or past read here (CUDA graphs), NULL: @past */
  int max_len;                          /* with past_dev: the most keys there may be */
  int heads, kv_heads, dk, dv;
  const void *q;                        /* [B*T][heads][dk] */
  int q_row_stride;                     /* elements between rows */
  const void *k_cache, *v_cache;        /* [B][kv_heads][capacity][d] */
  int capacity;
  const uint8_t *key_valid;             /* [B][past+T] (rows @key_valid_stride apart when set) or NULL */
  int key_valid_stride;
  int window;                           /* sliding window, 0: none */
  const float *sinks;                   /* [heads] or NULL */
  float scaling;
  int eager;                            /* round scores and probabilities (GPT-OSS) */
  void *out;                            /* [B*T][heads][dv] */
  int split_keys;                       /* > 0 (not eager): blocks of this many keys, then their combination */
  float *partial;                       /* with @split_keys: [B*T][heads][splits][dv + 2] scratch */
  /* With @inv_freq (a decode step: @n_tokens 1, keys = values' dims, not
   * interleaved): @q's rows are the projected [q heads | k heads | v heads]
   * before RoPE, and the kernel does moe_cuda_rope_store_kv ()'s work for
   * them itself — q and the row's key rotated, the key and value written
   * into the cache — one kernel and one wait less a layer */
  const int64_t *positions;             /* [B] */
  const float *inv_freq;                /* [rope_dim / 2] or NULL */
  int rope_dim;
  float rope_scale;
} MoeCudaAttention;

/* The keys one launch covers (a graph's: @a->max_len, whatever the step's
 * past), and the blocks moe_cuda_attention () splits them into (1 without
 * @a->split_keys): what @a->partial must hold. */
int moe_cuda_attention_keys   (const MoeCudaAttention *a);
int moe_cuda_attention_splits (const MoeCudaAttention *a);

/* Returns NULL, or a static message saying what failed. */
const char *moe_cuda_attention       (const MoeCudaAttention *a, cudaStream_t stream);

/* Many queries (prefill) in one tensor-core kernel, FlashAttention-2's
 * scheme (moe-cuda-flash-attention.cu); what it fits: bf16 and f16, not
 * eager (rounded) attention, head dims up to 192 (keys) and 128 (values). */
int         moe_cuda_flash_attention_fits (const MoeCudaAttention *a);
void        moe_cuda_flash_attention      (const MoeCudaAttention *a, cudaStream_t stream);

/* The two flash kernels: mma.sync (any GPU the plugin is built for, 64
 * queries a block) and, on Hopper, warpgroup MMAs (128 queries a block;
 * heads of 65…192 key and 65…128 value dims). moe_cuda_flash_attention ()
 * takes the wgmma one where it fits, unless MOE_CUDA_FLASH=mma. */
typedef enum {
  MOE_CUDA_FLASH_ANY,
  MOE_CUDA_FLASH_MMA_SYNC,
  MOE_CUDA_FLASH_WGMMA,
} MoeCudaFlashKernel;

/* Runs @a through @kernel; 0 (and nothing launched) where that kernel
 * does not take @a on this device. */
int         moe_cuda_flash_attention_with (const MoeCudaAttention *a, MoeCudaFlashKernel kernel,
                                           cudaStream_t stream);

/* Attention for many queries as two batched cuBLAS GEMMs around this: the
 * masked softmax of the scores [B*heads][rows][len] (float32, already
 * scaled) of queries t0…t0+rows-1, written as probabilities in the model
 * dtype, ready for the product with the values. */
typedef struct {
  int dtype;
  int batch, heads, n_tokens, past;     /* the step: keys 0…past+n_tokens-1 exist */
  int t0, rows, len;                    /* this chunk's queries, and the keys it reads */
  const float *scores;
  void *probs;
  const uint8_t *key_valid;             /* [B][past+n_tokens] or NULL */
  int window;
  const float *sinks;
  int eager;
} MoeCudaSoftmax;

void moe_cuda_attention_softmax (const MoeCudaSoftmax *s, cudaStream_t stream);

/* The six pointer lists of the two batched GEMMs, per (b, h) in order:
 * K, q, scores, V, probabilities, out; made on the device so that prefill
 * never waits for a host copy. */
typedef struct {
  int n, heads, group, n_tokens, t0, rows, len, capacity, dk, dv, q_row_stride, elem;
  const char *k, *q, *scores, *v, *probs, *out;
} MoeCudaAttentionPointers;

void moe_cuda_attention_pointers (const MoeCudaAttentionPointers *a, const void **out, cudaStream_t stream);

typedef struct {
  int dtype;
  int rows, num_experts, top_k;
  int kind;                             /* MOE_CUDA_ROUTER_* */
  int norm_topk, weights_in_act_dtype;
  float routed_scale;
  int n_group, topk_group;
  const float *logits;                  /* [rows, E]: x · routerᵀ in float32 */
  /* or, with @w set, the kernel makes the logits itself (a few rows):
   * w [E, hidden] in the model dtype, x [rows, hidden] rows @ldx apart;
   * hidden a multiple of 16 bytes' elements */
  const void *w, *x;
  int hidden, ldx;
  const float *bias;                    /* [E] or NULL: added to the logits */
  const float *score_bias;              /* [E] or NULL: DeepSeek's choice bias */
  int64_t *ids;                         /* [rows, top_k] */
  float *weights;                       /* [rows, top_k] */
} MoeCudaRouter;

void moe_cuda_route          (const MoeCudaRouter *r, cudaStream_t stream);

/* A gated MLP's middle, in place: rows of [g | u] (@width each, rows
 * @row_stride apart) become g = act(g) · u, each op rounded; with @gate
 * ([rows], Qwen2-MoE's shared expert gate) g = act(g) · u · sigmoid(gate[r])
 * before the rounding, so that its down GEMM adds the gated shared expert
 * to the routed experts' output. */
void moe_cuda_act_mul        (int dtype, void *gu, int rows, int width, int row_stride, int activation,
                              const void *gate, cudaStream_t stream);

/* every one of @rows rows of y (@width wide) = bias: a projection's GEMM
 * with beta = 1 then adds its products in float32 before its one rounding */
void moe_cuda_bias_rows      (int dtype, const void *bias, int rows, int width, void *y, cudaStream_t stream);

/* y [rows, out] = x [rows, in] (rows @ldx apart) · wᵀ (+ bias) for a few
 * rows (≤ MOE_CUDA_GEMV_ROWS): weights read once, at the memory's speed
 * where a GEMM library's tiles would leave most of the GPU idle (bf16/f16
 * on the tensor cores, 16 outputs a block; float32 a warp per output); with
 * an epilogue that saves a pass over the output. */
#define MOE_CUDA_GEMV_ROWS 16
typedef struct {
  int dtype;
  const void *w;          /* [out, in]; [2·out, in] (gate; up) with @gated */
  int out, in, rows;
  const void *x;          /* [rows, in], rows @ldx apart */
  int ldx;
  const void *bias;       /* [out] ([2·out] with @gated) or NULL */
  void *y;                /* [rows, out] */
  int y_f32;              /* y in float32, unrounded (plain only) */
  int gated;              /* y = act(x·gateᵀ + b) · (x·upᵀ + b), each rounded */
  int activation;
  int add;                /* y += x·wᵀ, or y += sigmoid(gate[r]) · x·wᵀ */
  const void *gate;       /* [rows] @gate_stride apart, or NULL: y (+)= sigmoid(gate[r]) · x·wᵀ, no bias */
  int gate_stride;
} MoeCudaGemv;

void moe_cuda_gemv           (const MoeCudaGemv *g, cudaStream_t stream);

/* out[r] = the first index of row r's largest value (greedy decoding) */
void moe_cuda_argmax         (const float *x, int rows, int n, int64_t *out, cudaStream_t stream);

/* do_sample where the logits are (moe-cuda-sampling.cu): row r's token
 * drawn with draws[r] as libmoe/moe-sampling.c draws it — the logits over
 * @temperature, the @top_k best, the fewest of those that hold @top_p of
 * their probability, the draw walked over the kept tokens in id order —
 * into out[r]; -1 where the row has no draw (negative) or a top-k past
 * MOE_CUDA_SAMPLE_MAX_KEPT: the host samples those */
#define MOE_CUDA_SAMPLE_MAX_KEPT 1024
typedef struct {
  const float *logits;    /* [rows, n] */
  int rows, n;
  float temperature;
  int top_k;              /* 0: none */
  double top_p;           /* 1 or more: none */
  const double *draws;    /* [rows]: uniform on [0, 1), or negative */
  int64_t *out;           /* [rows] */
} MoeCudaSampling;

void moe_cuda_sample         (const MoeCudaSampling *s, cudaStream_t stream);

/* y = x as float32 */
void moe_cuda_to_f32         (int dtype, const void *x, size_t n, float *y, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
