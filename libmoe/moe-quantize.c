/* moe-quantize.c: FP8 and FP4 quantization of expert weights, and of a
 * whole checkpoint's experts into a checkpoint transformers reads back
 *
 * The recipe is transformers' fine-grained FP8 (DeepSeek's checkpoints):
 * FP8 scale = amax / 448 per 128×128 block (UE8M0: rounded up to a power of
 * two), weight = e4m3(w / scale), rounded to nearest even; FP4 scale = amax
 * / 6 per row and 32 inputs rounded up to a power of two, code = the
 * nearest e2m1 magnitude (ties to the even code). An all-zero block gets
 * scale 1.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <glib/gstdio.h>

#include "moe-private.h"

#define FP8_MAX 448.0f
#define FP4_MAX 6.0f

/**
 * moe_quant_format_from_name:
 * @name: "fp8", "fp8-ue8m0" (or "fp8_ue8m0") or "fp4"
 * @format: (out): the format
 *
 * Returns: %TRUE if @name is a format
 */
gboolean
moe_quant_format_from_name (const char     *name,
                            MoeQuantFormat *format)
{
  g_return_val_if_fail (name != NULL, FALSE);

  if (g_str_equal (name, "fp8"))
    *format = MOE_QUANT_FORMAT_FP8;
  else if (g_str_equal (name, "fp8-ue8m0") || g_str_equal (name, "fp8_ue8m0"))
    *format = MOE_QUANT_FORMAT_FP8_UE8M0;
  else if (g_str_equal (name, "fp4"))
    *format = MOE_QUANT_FORMAT_FP4;
  else
    return FALSE;
  return TRUE;
}

/* 2^⌈log2 x⌉ as a UE8M0 exponent byte (x > 0, finite) */
static guint8
pow2_ceil_e8m0 (float x)
{
  int e;
  float m = frexpf (x, &e);     /* x = m · 2^e, m in [0.5, 1) */
  int p = m == 0.5f ? e - 1 : e;
  return (guint8) CLAMP (p + 127, 0, 254);
}

static guint8
f32_to_e4m3_bits (float v)
{
  float r = moe_f32_round_to_e4m3 (v);
  guint8 sign = signbit (r) ? 0x80 : 0;
  float a = fabsf (r);
  int e;

  if (a == 0.0f)
    return sign;
  if (a < 0.015625f)                     /* subnormal: m · 2^-9 */
    return sign | (guint8) lrintf (a * 512.0f);
  frexpf (a, &e);                        /* a = 1.m · 2^(e-1) */
  return sign | (guint8) ((e - 1 + 7) << 3) | (guint8) lrintf ((a / ldexpf (1.0f, e - 1) - 1.0f) * 8.0f);
}

/* the nearest e2m1 code of |x| ≤ 6, ties to the even code */
static guint8
nearest_fp4 (float x)
{
  static const float magnitude[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };
  float a = fabsf (x), best = INFINITY;
  guint8 idx = 0;

  for (guint8 i = 0; i < 8; i++)
    {
      float d = fabsf (a - magnitude[i]);
      if (d < best || (d == best && (i % 2) == 0 && (idx % 2) != 0))
        best = d, idx = i;
    }
  return (x < 0.0f && idx > 0) ? (idx | 8) : idx;
}

static void
quantize_fp8 (const float *w, gsize n, gsize k, gboolean ue8m0, guint8 *q, gpointer scale)
{
  gsize rb = (n + 127) / 128, cb = (k + 127) / 128;

  for (gsize bi = 0; bi < rb; bi++)
    for (gsize bj = 0; bj < cb; bj++)
      {
        gsize r1 = MIN (n, (bi + 1) * 128), c1 = MIN (k, (bj + 1) * 128);
        float amax = 0.0f, s;

        for (gsize r = bi * 128; r < r1; r++)
          for (gsize c = bj * 128; c < c1; c++)
            amax = MAX (amax, fabsf (w[r * k + c]));
        s = amax > 0.0f ? amax / FP8_MAX : 1.0f;
        if (ue8m0)
          {
            guint8 e = pow2_ceil_e8m0 (s);
            ((guint8 *) scale)[bi * cb + bj] = e;
            s = moe_e8m0_to_f32 (e);
          }
        else
          ((float *) scale)[bi * cb + bj] = s;
        for (gsize r = bi * 128; r < r1; r++)
          for (gsize c = bj * 128; c < c1; c++)
            q[r * k + c] = f32_to_e4m3_bits (w[r * k + c] / s);
      }
}

static void
quantize_fp4 (const float *w, gsize n, gsize k, guint8 *q, guint8 *scale)
{
  gsize groups = k / 32;

  for (gsize r = 0; r < n; r++)
    for (gsize g = 0; g < groups; g++)
      {
        const float *x = w + r * k + g * 32;
        float amax = 0.0f, s;
        guint8 e;

        for (guint j = 0; j < 32; j++)
          amax = MAX (amax, fabsf (x[j]));
        e = amax > 0.0f ? pow2_ceil_e8m0 (amax / FP4_MAX) : 127;
        scale[r * groups + g] = e;
        s = moe_e8m0_to_f32 (e);
        for (guint j = 0; j < 32; j += 2)
          q[r * (k / 2) + g * 16 + j / 2] = nearest_fp4 (x[j] / s) | (nearest_fp4 (x[j + 1] / s) << 4);
      }
}

/* The quantized shapes of a [.., n, k] weight (of @w, its last two
 * dimensions swapped with @swap): the weight and its scale. */
static gboolean
quantized_shapes (MoeTensor *w, gboolean swap, MoeQuantFormat format, gint64 *qshape, gint64 *sshape,
                  GError **error)
{
  guint nd = moe_tensor_get_n_dims (w);
  gint64 s[8];
  gint64 n, k;

  if (nd < 2 || !moe_dtype_is_float (moe_tensor_get_dtype (w)) || moe_tensor_get_dtype (w) == MOE_DTYPE_F64)
    {
      g_autofree char *d = moe_tensor_to_string (w);
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "Only F32, BF16 or F16 matrices [.., out, in] are quantized, not %s", d);
      return FALSE;
    }
  memcpy (s, moe_tensor_get_shape (w, NULL), nd * sizeof (gint64));
  if (swap)
    {
      s[nd - 2] = s[nd - 1];
      s[nd - 1] = moe_tensor_get_dim (w, nd - 2);
    }
  n = s[nd - 2];
  k = s[nd - 1];
  if (format == MOE_QUANT_FORMAT_FP4 && k % 32 != 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "FP4 needs the input size to be a multiple of 32 (one scale per 32 inputs); it is %" G_GINT64_FORMAT, k);
      return FALSE;
    }
  memcpy (qshape, s, nd * sizeof (gint64));
  memcpy (sshape, s, nd * sizeof (gint64));
  if (format == MOE_QUANT_FORMAT_FP4)
    {
      qshape[nd - 1] = k / 2;
      sshape[nd - 1] = k / 32;
    }
  else
    {
      sshape[nd - 2] = (n + 127) / 128;
      sshape[nd - 1] = (k + 127) / 128;
    }
  return TRUE;
}

static MoeDType
quantized_dtype (MoeQuantFormat format)
{
  return format == MOE_QUANT_FORMAT_FP4 ? MOE_DTYPE_I8 : MOE_DTYPE_F8E4M3;
}

static MoeDType
scale_dtype (MoeQuantFormat format)
{
  return format == MOE_QUANT_FORMAT_FP8 ? MOE_DTYPE_F32 : MOE_DTYPE_E8M0;
}

/**
 * moe_tensor_quantize:
 * @self: an F32, BF16 or F16 weight `[out, in]`, or `[E, out, in]`
 * @format: the format
 * @scale: (out) (transfer full): the dequantization scales
 *   (transformers' `weight_scale_inv`): FP8 `[.., ⌈out/128⌉, ⌈in/128⌉]`
 *   F32 or E8M0, FP4 `[.., out, in/32]` E8M0
 * @error: return location for a #GError
 *
 * Quantizes a weight as transformers' fine-grained FP8 does (see
 * [enum@QuantFormat]); value × scale gives the weight back, to the
 * format's precision.
 *
 * Returns: (transfer full): F8E4M3 `[.., out, in]`, or I8 `[.., out, in/2]`
 *   (FP4, two codes per byte, element 2j in the low nibble)
 */
MoeTensor *
moe_tensor_quantize (MoeTensor       *self,
                     MoeQuantFormat   format,
                     MoeTensor      **scale,
                     GError         **error)
{
  g_autoptr(MoeTensor) f32 = NULL, q = NULL, s = NULL;
  gint64 qshape[8], sshape[8];
  guint nd;
  gsize n, k, E = 1, sper;

  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);
  g_return_val_if_fail (scale != NULL, NULL);

  if (!quantized_shapes (self, FALSE, format, qshape, sshape, error))
    return NULL;
  nd = moe_tensor_get_n_dims (self);
  n = moe_tensor_get_dim (self, nd - 2);
  k = moe_tensor_get_dim (self, nd - 1);
  for (guint i = 0; i + 2 < nd; i++)
    E *= moe_tensor_get_dim (self, i);
  if (!(f32 = moe_tensor_to_dtype (self, MOE_DTYPE_F32, error)) ||
      !(q = moe_tensor_new_empty (NULL, quantized_dtype (format), qshape, nd, error)) ||
      !(s = moe_tensor_new_empty (NULL, scale_dtype (format), sshape, nd, error)))
    return NULL;
  sper = (gsize) (sshape[nd - 2] * sshape[nd - 1]);
  for (gsize e = 0; e < E; e++)
    {
      const float *w = (const float *) moe_tensor_get_data (f32) + e * n * k;
      guint8 *qd = (guint8 *) moe_tensor_get_mutable_data (q) + e * n * (format == MOE_QUANT_FORMAT_FP4 ? k / 2 : k);
      guint8 *sd = (guint8 *) moe_tensor_get_mutable_data (s) + e * sper * moe_dtype_get_size (scale_dtype (format));
      if (format == MOE_QUANT_FORMAT_FP4)
        quantize_fp4 (w, n, k, qd, sd);
      else
        quantize_fp8 (w, n, k, format == MOE_QUANT_FORMAT_FP8_UE8M0, qd, sd);
    }
  *scale = g_steal_pointer (&s);
  return g_steal_pointer (&q);
}

/* ------------------------------------------------------------------ */
/* Checkpoints                                                         */

/* Per-expert projection weights, as transformers' checkpoints name them:
 * <…>.experts.<N>.(gate_proj|up_proj|down_proj|w1|w2|w3).weight */
static gboolean
is_expert_weight (const char *name)
{
  static const char *projections[] = { "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3" };
  const char *e = strstr (name, ".experts.");
  const char *p;

  if (e == NULL || !g_str_has_suffix (name, ".weight"))
    return FALSE;
  p = e + strlen (".experts.");
  if (!g_ascii_isdigit (*p))
    return FALSE;
  while (g_ascii_isdigit (*p))
    p++;
  if (*p++ != '.')
    return FALSE;
  for (guint i = 0; i < G_N_ELEMENTS (projections); i++)
    if (strlen (p) == strlen (projections[i]) + strlen (".weight") && g_str_has_prefix (p, projections[i]))
      return TRUE;
  return FALSE;
}

/* Fused experts as Qwen3-VL-MoE's checkpoints hold them, …experts.gate_up_proj
 * and …experts.down_proj [E, ·, ·], without biases: quantized as transformers'
 * FP8 experts hold them, [E, 2I, H] and [E, H, I] (the layout its Qwen3-VL
 * conversion keeps as it is; transformers 5.17 does not dequantize fused
 * experts on load, though), each with its …_scale_inv. Sets @transpose where the
 * checkpoint stores them [E, in, out]. GPT-OSS's (biased, gate and up
 * interleaved) have no FP8 form in transformers, and are refused. */
static gboolean
plan_fused_experts (MoeCheckpoint *ck, const char *source, const char *name, gboolean *transpose, GError **error)
{
  const char *tail = g_str_has_suffix (name, ".experts.gate_up_proj") ? ".gate_up_proj"
                     : g_str_has_suffix (name, ".experts.down_proj") ? ".down_proj" : NULL;
  g_autofree char *prefix = tail ? g_strndup (name, strlen (name) - strlen (tail)) : NULL;
  g_autofree char *up_name = tail ? g_strconcat (prefix, ".gate_up_proj", NULL) : NULL;
  g_autofree char *down_name = tail ? g_strconcat (prefix, ".down_proj", NULL) : NULL;
  g_autofree char *bias_name = tail ? g_strconcat (prefix, ".gate_up_proj_bias", NULL) : NULL;
  g_autoptr(GArray) u = NULL, d = NULL;

  if (tail == NULL || moe_checkpoint_has_tensor (ck, bias_name))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED,
                   "%s: %s is not quantized: fused experts are quantized when they are a Qwen3-VL-MoE "
                   "pair (….experts.gate_up_proj and ….experts.down_proj, no biases); transformers' FP8 "
                   "experts cannot hold GPT-OSS's biased, interleaved ones", source, name);
      return FALSE;
    }
  if (!moe_checkpoint_get_tensor_info (ck, up_name, NULL, &u, error) ||
      !moe_checkpoint_get_tensor_info (ck, down_name, NULL, &d, error))
    return FALSE;
  if (u->len != 3 || d->len != 3)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "%s: %s and %s are not both [experts, ·, ·]", source, up_name, down_name);
      return FALSE;
    }
  *transpose = _moe_fused_experts_transposed ((const gint64 *) u->data, (const gint64 *) d->data);
  return TRUE;
}

/* [E, k, n] float32 from [E, n, k] */
static MoeTensor *
transposed (MoeTensor *w, GError **error)
{
  g_autoptr(MoeTensor) f32 = moe_tensor_to_dtype (w, MOE_DTYPE_F32, error);
  gint64 E = moe_tensor_get_dim (w, 0), n = moe_tensor_get_dim (w, 1), k = moe_tensor_get_dim (w, 2);
  gint64 shape[3] = { E, k, n };
  g_autoptr(MoeTensor) t = f32 ? moe_tensor_new_empty (NULL, MOE_DTYPE_F32, shape, 3, error) : NULL;
  const float *src;
  float *dst;

  if (t == NULL)
    return NULL;
  src = moe_tensor_get_data (f32);
  dst = moe_tensor_get_mutable_data (t);
  for (gint64 e = 0; e < E; e++)
    for (gint64 i = 0; i < n; i++)
      for (gint64 j = 0; j < k; j++)
        dst[(e * k + j) * n + i] = src[(e * n + i) * k + j];
  return g_steal_pointer (&t);
}

typedef struct {
  char      *name;
  MoeTensor *source;       /* the checkpoint's tensor */
  MoeDType   dtype;        /* written as */
  gint64     shape[8];
  guint      n_dims;
  gsize      size;
  int        role;         /* 0 copied, 1 quantized weight, 2 its scale */
  gboolean   transpose;    /* fused experts stored [E, in, out], written [E, out, in] */
} OutEntry;

static void
out_entry_free (gpointer p)
{
  OutEntry *o = p;
  g_free (o->name);
  g_clear_object (&o->source);
  g_free (o);
}

static gsize
shape_bytes (MoeDType dtype, const gint64 *shape, guint n_dims)
{
  gsize n = 1;
  for (guint i = 0; i < n_dims; i++)
    n *= (gsize) shape[i];
  return n * moe_dtype_get_size (dtype);
}

static char *
safetensors_header (GPtrArray *entries)
{
  g_autoptr(JsonBuilder) b = json_builder_new ();
  g_autoptr(JsonGenerator) gen = json_generator_new ();
  g_autoptr(JsonNode) root = NULL;
  gsize offset = 0;

  json_builder_begin_object (b);
  json_builder_set_member_name (b, "__metadata__");
  json_builder_begin_object (b);
  json_builder_set_member_name (b, "format");
  json_builder_add_string_value (b, "pt");
  json_builder_end_object (b);
  for (guint i = 0; i < entries->len; i++)
    {
      OutEntry *o = entries->pdata[i];
      json_builder_set_member_name (b, o->name);
      json_builder_begin_object (b);
      json_builder_set_member_name (b, "dtype");
      json_builder_add_string_value (b, moe_dtype_get_name (o->dtype));
      json_builder_set_member_name (b, "shape");
      json_builder_begin_array (b);
      for (guint d = 0; d < o->n_dims; d++)
        json_builder_add_int_value (b, o->shape[d]);
      json_builder_end_array (b);
      json_builder_set_member_name (b, "data_offsets");
      json_builder_begin_array (b);
      json_builder_add_int_value (b, (gint64) offset);
      json_builder_add_int_value (b, (gint64) (offset + o->size));
      json_builder_end_array (b);
      json_builder_end_object (b);
      offset += o->size;
    }
  json_builder_end_object (b);
  root = json_builder_get_root (b);
  json_generator_set_root (gen, root);
  return json_generator_to_data (gen, NULL);
}

static gboolean
write_all (GOutputStream *out, gconstpointer data, gsize size, GCancellable *cancellable, GError **error)
{
  return g_output_stream_write_all (out, data, size, NULL, cancellable, error);
}

/* model.safetensors: the header (padded with spaces to 8 bytes), then each
 * entry's bytes, quantizing the expert weights as they are written. */
static gboolean
write_safetensors (const char *path, GPtrArray *entries, MoeQuantFormat format,
                   GCancellable *cancellable, GError **error)
{
  g_autoptr(GFile) file = g_file_new_for_path (path);
  g_autoptr(GFileOutputStream) fout = NULL;
  g_autoptr(GBufferedOutputStream) out = NULL;
  g_autofree char *header = safetensors_header (entries);
  gsize hlen = strlen (header), padded = (hlen + 7) / 8 * 8;
  guint64 le = GUINT64_TO_LE ((guint64) padded);
  g_autoptr(MoeTensor) pending_scale = NULL;

  fout = g_file_create (file, G_FILE_CREATE_NONE, cancellable, error);
  if (fout == NULL)
    return FALSE;
  out = G_BUFFERED_OUTPUT_STREAM (g_buffered_output_stream_new_sized (G_OUTPUT_STREAM (fout), 1 << 20));
  if (!write_all (G_OUTPUT_STREAM (out), &le, 8, cancellable, error) ||
      !write_all (G_OUTPUT_STREAM (out), header, hlen, cancellable, error) ||
      !write_all (G_OUTPUT_STREAM (out), "        ", padded - hlen, cancellable, error))
    goto fail;

  for (guint i = 0; i < entries->len; i++)
    {
      OutEntry *o = entries->pdata[i];
      g_autoptr(GBytes) bytes = NULL;

      if (o->role == 1)
        {
          g_autoptr(MoeTensor) w = o->transpose ? transposed (o->source, error) : g_object_ref (o->source);
          g_autoptr(MoeTensor) q = w ? moe_tensor_quantize (w, format, &pending_scale, error) : NULL;
          if (q == NULL || !write_all (G_OUTPUT_STREAM (out), moe_tensor_get_data (q), o->size, cancellable, error))
            goto fail;
          continue;
        }
      if (o->role == 2)
        {
          gboolean ok = write_all (G_OUTPUT_STREAM (out), moe_tensor_get_data (pending_scale), o->size, cancellable, error);
          g_clear_object (&pending_scale);
          if (!ok)
            goto fail;
          continue;
        }
      bytes = moe_tensor_dup_bytes (o->source, error);
      if (bytes == NULL || !write_all (G_OUTPUT_STREAM (out), g_bytes_get_data (bytes, NULL), o->size, cancellable, error))
        goto fail;
    }
  if (!g_output_stream_close (G_OUTPUT_STREAM (out), cancellable, error))
    goto fail;
  return TRUE;

fail:
  g_output_stream_close (G_OUTPUT_STREAM (out), NULL, NULL);
  g_file_delete (file, NULL, NULL);
  return FALSE;
}

/* config.json with transformers' quantization_config (and expert_dtype for
 * FP4); the modules left in full precision are listed by name. */
static gboolean
write_config (const char *src_dir, const char *path, MoeQuantFormat format, GPtrArray *kept_modules,
              GError **error)
{
  g_autofree char *src = g_build_filename (src_dir, "config.json", NULL);
  g_autoptr(JsonParser) parser = json_parser_new ();
  g_autoptr(JsonGenerator) gen = json_generator_new ();
  JsonObject *root, *q;
  JsonArray *block, *kept;

  if (!json_parser_load_from_file (parser, src, error))
    return FALSE;
  if (!JSON_NODE_HOLDS_OBJECT (json_parser_get_root (parser)))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG, "%s: not a JSON object", src);
      return FALSE;
    }
  /* moe_quantize_checkpoint() refused a quantization_config already */
  root = json_node_get_object (json_parser_get_root (parser));
  q = json_object_new ();
  json_object_set_string_member (q, "quant_method", "fp8");
  json_object_set_string_member (q, "fmt", "e4m3");
  json_object_set_string_member (q, "activation_scheme", "dynamic");
  block = json_array_new ();
  json_array_add_int_element (block, 128);
  json_array_add_int_element (block, 128);
  json_object_set_array_member (q, "weight_block_size", block);
  json_object_set_string_member (q, "scale_fmt", format == MOE_QUANT_FORMAT_FP8 ? "float" : "ue8m0");
  kept = json_array_new ();
  for (guint i = 0; i < kept_modules->len; i++)
    json_array_add_string_element (kept, kept_modules->pdata[i]);
  json_object_set_array_member (q, "modules_to_not_convert", kept);
  json_object_set_object_member (root, "quantization_config", q);
  if (format == MOE_QUANT_FORMAT_FP4)
    {
      json_object_set_string_member (root, "expert_dtype", "fp4");
      /* a vision-language model's experts read their text sub-config's */
      if (json_object_has_member (root, "text_config") &&
          JSON_NODE_HOLDS_OBJECT (json_object_get_member (root, "text_config")))
        json_object_set_string_member (json_object_get_object_member (root, "text_config"), "expert_dtype", "fp4");
    }

  json_generator_set_root (gen, json_parser_get_root (parser));
  json_generator_set_pretty (gen, TRUE);
  json_generator_set_indent (gen, 2);
  return json_generator_to_file (gen, path, error);
}

/* Everything else of the checkpoint directory but its weights and config. */
static gboolean
copy_other_files (const char *src_dir, const char *dst_dir, GCancellable *cancellable, GError **error)
{
  g_autoptr(GDir) dir = g_dir_open (src_dir, 0, error);
  const char *name;

  if (dir == NULL)
    return FALSE;
  while ((name = g_dir_read_name (dir)) != NULL)
    {
      g_autofree char *from = g_build_filename (src_dir, name, NULL);
      g_autofree char *to = g_build_filename (dst_dir, name, NULL);
      g_autoptr(GFile) f = NULL, t = NULL;

      if (g_str_equal (name, "config.json") || g_str_has_suffix (name, ".safetensors") ||
          g_str_has_suffix (name, ".safetensors.index.json") || !g_file_test (from, G_FILE_TEST_IS_REGULAR))
        continue;
      f = g_file_new_for_path (from);
      t = g_file_new_for_path (to);
      if (!g_file_copy (f, t, G_FILE_COPY_NONE, cancellable, NULL, NULL, error))
        return FALSE;
    }
  return TRUE;
}

/**
 * moe_quantize_checkpoint:
 * @source: a checkpoint directory (config.json + safetensors, unquantized)
 * @destination: a directory to write the quantized checkpoint to; created
 *   if missing, and it must not hold a checkpoint already
 * @format: the format
 * @cancellable: (nullable): a #GCancellable
 * @error: return location for a #GError
 *
 * Writes a copy of @source whose per-expert projection weights
 * (`….experts.N.gate_proj.weight` and the like) are quantized, each with
 * its `….weight_scale_inv`, or whose fused experts (Qwen3-VL-MoE's
 * `….experts.gate_up_proj` and `….experts.down_proj`) are, written
 * `[E, 2I, H]` and `[E, H, I]` as transformers' FP8 experts hold them, each
 * with its `…_scale_inv`; in one `model.safetensors`, and a config.json
 * with transformers' `quantization_config` (`quant_method: "fp8"`,
 * dynamic activations, 128×128 blocks, `scale_fmt`, and every other linear
 * module under `modules_to_not_convert`); FP4 also sets `expert_dtype:
 * "fp4"`. Other files (generation_config.json, the tokenizer) are copied.
 * Nothing is written over: an existing model.safetensors or config.json in
 * @destination is an error, and a failed write removes its partial file.
 *
 * Returns: %TRUE on success
 */
gboolean
moe_quantize_checkpoint (const char      *source,
                         const char      *destination,
                         MoeQuantFormat   format,
                         GCancellable    *cancellable,
                         GError         **error)
{
  g_autoptr(MoeCheckpoint) ck = NULL;
  g_autoptr(GPtrArray) entries = g_ptr_array_new_with_free_func (out_entry_free);
  g_autoptr(GPtrArray) kept = g_ptr_array_new_with_free_func (g_free);
  g_auto(GStrv) names = NULL;
  g_autofree char *weights_path = NULL, *config_path = NULL;
  guint n_quantized = 0;

  g_return_val_if_fail (source != NULL && destination != NULL, FALSE);

  if (!g_file_test (source, G_FILE_TEST_IS_DIR))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND, "%s is not a checkpoint directory", source);
      return FALSE;
    }
  weights_path = g_build_filename (destination, "model.safetensors", NULL);
  config_path = g_build_filename (destination, "config.json", NULL);
  if (g_file_test (weights_path, G_FILE_TEST_EXISTS) || g_file_test (config_path, G_FILE_TEST_EXISTS))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                   "%s holds a checkpoint already; quantize into a new directory", destination);
      return FALSE;
    }
  {
    g_autofree char *src_config = g_build_filename (source, "config.json", NULL);
    g_autoptr(MoeConfig) config = moe_config_new_from_file (src_config, error);
    if (config == NULL)
      return FALSE;
    if (moe_config_has_key (config, "quantization_config"))
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_ARGUMENT,
                     "%s: the checkpoint is quantized already (it has a quantization_config)", src_config);
        return FALSE;
      }
  }
  if (!(ck = moe_checkpoint_open (source, error)))
    return FALSE;

  names = moe_checkpoint_list_tensors (ck);
  for (guint i = 0; names[i] != NULL; i++)
    {
      OutEntry *o = g_new0 (OutEntry, 1);

      o->name = g_strdup (names[i]);
      if (!(o->source = moe_checkpoint_get_tensor (ck, names[i], error)))
        {
          out_entry_free (o);
          return FALSE;
        }
      o->n_dims = moe_tensor_get_n_dims (o->source);
      o->dtype = moe_tensor_get_dtype (o->source);
      memcpy (o->shape, moe_tensor_get_shape (o->source, NULL), o->n_dims * sizeof (gint64));
      if ((is_expert_weight (names[i]) && o->n_dims == 2) || (strstr (names[i], ".experts.") && o->n_dims == 3))
        {
          OutEntry *s;
          gint64 qshape[8], sshape[8];

          if (o->n_dims == 3 && !plan_fused_experts (ck, source, names[i], &o->transpose, error))
            {
              out_entry_free (o);
              return FALSE;
            }
          s = g_new0 (OutEntry, 1);
          if (!quantized_shapes (o->source, o->transpose, format, qshape, sshape, error))
            {
              g_prefix_error (error, "%s: ", names[i]);
              out_entry_free (o);
              out_entry_free (s);
              return FALSE;
            }
          o->role = 1;
          o->dtype = quantized_dtype (format);
          memcpy (o->shape, qshape, sizeof qshape);
          s->role = 2;
          s->name = g_strdup_printf ("%.*s_scale_inv", (int) strlen (names[i]), names[i]);
          s->dtype = scale_dtype (format);
          s->n_dims = o->n_dims;
          memcpy (s->shape, sshape, sizeof sshape);
          o->size = shape_bytes (o->dtype, o->shape, o->n_dims);
          s->size = shape_bytes (s->dtype, s->shape, s->n_dims);
          g_ptr_array_add (entries, o);
          g_ptr_array_add (entries, s);
          n_quantized++;
          continue;
        }
      if (o->n_dims == 2 && g_str_has_suffix (names[i], ".weight") && !strstr (names[i], "embed"))
        g_ptr_array_add (kept, g_strndup (names[i], strlen (names[i]) - strlen (".weight")));
      o->size = shape_bytes (o->dtype, o->shape, o->n_dims);
      g_ptr_array_add (entries, o);
    }
  if (n_quantized == 0)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND,
                   "%s has no expert weights (….experts.N.gate_proj.weight, or fused ….experts.gate_up_proj) "
                   "to quantize", source);
      return FALSE;
    }

  if (g_mkdir_with_parents (destination, 0755) != 0)
    {
      int saved = errno;
      g_set_error (error, G_FILE_ERROR, g_file_error_from_errno (saved), "Could not create %s: %s",
                   destination, g_strerror (saved));
      return FALSE;
    }
  if (!write_safetensors (weights_path, entries, format, cancellable, error))
    return FALSE;
  if (!write_config (source, config_path, format, kept, error) ||
      !copy_other_files (source, destination, cancellable, error))
    {
      g_unlink (weights_path);
      g_unlink (config_path);
      return FALSE;
    }
  return TRUE;
}
