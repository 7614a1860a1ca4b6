/* moe-transformer-private.h: the decoder stack behind MoeModel (internal)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include "moe-private.h"
#include "moe-sampling-private.h"

G_BEGIN_DECLS

typedef struct _MoeTransformer MoeTransformer;
typedef struct _MoeKvCache MoeKvCache;

/* The decoder's description is shared with the devices built with libmoe
 * (plugins/cuda), which run the same stack with their own kernels: the
 * weights below are the host copies (norms and routers as float32, linears
 * in the model dtype); the experts already live on the device. */
typedef enum {
  FAMILY_QWEN2_MOE,
  FAMILY_QWEN3_MOE,
  FAMILY_QWEN3_VL_MOE,
  FAMILY_MIXTRAL,
  FAMILY_OLMOE,
  FAMILY_DEEPSEEK_V3,
  FAMILY_GPT_OSS,
} Family;


typedef enum {
  ROUTER_SOFTMAX_TOPK,     /* Qwen, Mixtral, OLMoE: softmax over E, top-k, optional renorm */
  ROUTER_SIGMOID_GROUPED,  /* DeepSeek-V3: sigmoid, biased group-limited choice */
  ROUTER_TOPK_SOFTMAX,     /* GPT-OSS: biased logits, top-k, softmax over the k */
} RouterKind;

typedef enum {
  QK_NORM_NONE,
  QK_NORM_PER_HEAD,        /* Qwen3: RMSNorm over head_dim */
  QK_NORM_FULL,            /* OLMoE: RMSNorm over the whole projection */
} QkNorm;

typedef struct {
  MoeTensor *weight;       /* [out, in], model dtype; or FP8/FP4 with @scale */
  MoeTensor *bias;         /* [out] or NULL */
  MoeTensor *scale;        /* the checkpoint's weight_scale_inv, or NULL */
} Linear;

typedef struct {
  /* attention */
  float      *input_norm;
  float      *post_norm;
  Linear      q, k, v, o;
  float      *q_norm, *k_norm;
  Linear      q_a, q_b, kv_a, kv_b;       /* MLA */
  float      *q_a_norm, *kv_a_norm;
  float      *sinks;                      /* [heads] or NULL */
  guint       window;                     /* sliding window, 0 = full */
  /* feed-forward */
  gboolean    is_moe;
  Linear      gate, up, down;             /* dense MLP, or the shared expert */
  Linear      shared_gate;                /* Qwen2-MoE: sigmoid gate of the shared expert */
  float      *router;                     /* [E, H] float32 */
  float      *router_bias;                /* [E] or NULL */
  float      *score_bias;                 /* DeepSeek e_score_correction_bias [E] */
  MoeExperts *experts;
} Layer;

struct _MoeTransformer
{
  Family      family;
  char       *experts_key;
  MoeDType    dtype;
  guint       hidden, layers, heads, kv_heads, head_dim, v_head_dim, vocab;
  guint       rope_dim;                   /* rotated dims per head */
  guint       nope_dim;                   /* MLA: dims per head without RoPE */
  guint       q_lora, kv_lora;
  float       eps;
  float       scaling;                    /* attention score scale */
  float      *inv_freq;                   /* [rope_dim / 2] */
  float       rope_scale;                 /* YaRN's attention factor on cos/sin */
  gboolean    rope_interleaved;           /* DeepSeek: rotate (x0, x1), (x2, x3)… */
  QkNorm      qk_norm;
  gboolean    eager_attention;            /* rounds scores and probabilities (GPT-OSS has no SDPA path) */
  double      clip_qkv;
  RouterKind  router_kind;
  guint       num_experts, top_k;
  gboolean    norm_topk;
  gboolean    weights_in_act_dtype;       /* Qwen/OLMoE cast routing weights to the logits dtype */
  double      routed_scale;
  guint       n_group, topk_group;
  gboolean    shared_gated;               /* Qwen2-MoE */
  gboolean    has_shared;
  char       *act;
  MoeCpuActivation act_fn;
  MoeTensor  *embed;                      /* [V, H] */
  float      *final_norm;
  MoeTensor  *lm_head;                    /* [V, H] */
  Layer      *layer;
  GPtrArray  *all_experts;
  MoeDevice  *device;                     /* where it runs: the CPU, or a device's decoder */
  gpointer    device_decoder;             /* the device's state (MoeDeviceClass.decoder_new) */
};

struct _MoeKvCache
{
  MoeTransformer *model;
  guint           batch;
  guint           length;
  guint           capacity;
  float         **k;                      /* per layer [capacity][B][kv_heads][dk] */
  float         **v;                      /* per layer [capacity][B][kv_heads][dv] */
  gpointer        device_cache;           /* on a device: its own, made by decoder_forward */
};

/* One forward step as MoeDeviceClass.decoder_forward gets it: all host
 * memory; the device keeps its KV cache in cache->device_cache and leaves
 * cache->length (the past) for the caller to advance. */
typedef struct {
  MoeKvCache   *cache;
  const gint64 *ids;           /* [B, T] */
  guint         batch, n_tokens;
  const gint64 *positions;     /* [B, T] */
  const guint8 *key_valid;     /* [B, past + T] or NULL */
  gboolean      last_only;
  float        *logits;        /* [B, T, V], or [B, V] when last_only; unwritten with @tokens */
  gint64       *tokens;        /* or NULL; with last_only: [B], each row's next token, the logits
                                * left on the device: greedy (the first index of its largest
                                * logit), or sampled as @sampling says */
  const MoeSampling *sampling; /* with @tokens: do_sample's (NULL: greedy); a row with a draw
                                * that the device leaves to the host gets token -1 and its
                                * logits in @logits (a row with no draw: no token) */
} MoeDecoderStep;

MoeTransformer *_moe_transformer_new          (MoeConfig      *config,
                                               MoeCheckpoint  *checkpoint,
                                               MoeDType        dtype,
                                               gboolean        dequantize,
                                               MoeDevice      *device,
                                               GCancellable   *cancellable,
                                               GError        **error);
void            _moe_transformer_free         (MoeTransformer *self);

/* The sub-config key ("" or "text_config") whose experts implementation
 * applies to the decoder's MoE layers. */
const char     *_moe_transformer_get_experts_key (MoeTransformer *self);
/* (element-type MoeExperts) every MoE layer's experts */
GPtrArray      *_moe_transformer_get_experts  (MoeTransformer *self);
gint64          _moe_transformer_get_vocab_size (MoeTransformer *self);
/* the routed experts per layer and the slots each token takes */
guint           _moe_transformer_get_num_experts (MoeTransformer *self);
guint           _moe_transformer_get_top_k    (MoeTransformer *self);

/* the greedy next token: the first index of the largest of @vocab logits
 * (devices that compute it themselves match this) */
gint64          _moe_greedy_token             (const float    *logits,
                                               gint64          vocab);

MoeKvCache     *_moe_kv_cache_new             (MoeTransformer *self,
                                               guint           batch);
void            _moe_kv_cache_free            (MoeKvCache     *cache);
guint           _moe_kv_cache_get_length      (MoeKvCache     *cache);

/* Runs T new tokens of B sequences through the decoder, appending their
 * keys and values to @cache. @positions is [B, T]; @key_valid is
 * [B, past + T] (which cached and new positions may be attended to; NULL:
 * all). Writes logits [B, T, V] into @logits, or only the last position's
 * [B, V] when @last_only; or, with @last_only and @tokens set, only each
 * sequence's next token into @tokens — greedy (its logits' first argmax),
 * or with @sampling drawn as _moe_sample_tokens () does (a row with no
 * draw gets no token): a device computes it where its logits are and leaves
 * @logits unwritten, the host path computes the logits into @logits
 * first. */
gboolean        _moe_transformer_forward      (MoeTransformer *self,
                                               MoeKvCache     *cache,
                                               const gint64   *ids,
                                               guint           batch,
                                               guint           n_tokens,
                                               const gint64   *positions,
                                               const guint8   *key_valid,
                                               gboolean        last_only,
                                               float          *logits,
                                               const MoeSampling *sampling,
                                               gint64         *tokens,
                                               GError        **error);

G_END_DECLS
