/* moe-transformer-private.h: the decoder stack behind MoeModel (internal)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include "moe-private.h"

G_BEGIN_DECLS

typedef struct _MoeTransformer MoeTransformer;
typedef struct _MoeKvCache MoeKvCache;

MoeTransformer *_moe_transformer_new          (MoeConfig      *config,
                                               MoeCheckpoint  *checkpoint,
                                               MoeDType        dtype,
                                               gboolean        dequantize,
                                               GCancellable   *cancellable,
                                               GError        **error);
void            _moe_transformer_free         (MoeTransformer *self);

/* The sub-config key ("" or "text_config") whose experts implementation
 * applies to the decoder's MoE layers. */
const char     *_moe_transformer_get_experts_key (MoeTransformer *self);
/* (element-type MoeExperts) every MoE layer's experts */
GPtrArray      *_moe_transformer_get_experts  (MoeTransformer *self);
gint64          _moe_transformer_get_vocab_size (MoeTransformer *self);

MoeKvCache     *_moe_kv_cache_new             (MoeTransformer *self,
                                               guint           batch);
void            _moe_kv_cache_free            (MoeKvCache     *cache);
guint           _moe_kv_cache_get_length      (MoeKvCache     *cache);

/* Runs T new tokens of B sequences through the decoder, appending their
 * keys and values to @cache. @positions is [B, T]; @key_valid is
 * [B, past + T] (which cached and new positions may be attended to; NULL:
 * all). Writes logits [B, T, V] into @logits, or only the last position's
 * [B, V] when @last_only. */
gboolean        _moe_transformer_forward      (MoeTransformer *self,
                                               MoeKvCache     *cache,
                                               const gint64   *ids,
                                               guint           batch,
                                               guint           n_tokens,
                                               const gint64   *positions,
                                               const guint8   *key_valid,
                                               gboolean        last_only,
                                               float          *logits,
                                               GError        **error);

G_END_DECLS
