/* moe-test-experts-fixture.h: loading transformers' experts fixtures
 * (tests/data/experts), shared by the CPU and GPU tests
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <libmoe.h>

#include "moe-test-util.h"

typedef struct {
  MoeCheckpoint *ck;
  MoeExperts    *experts;
  MoeTensor     *hidden, *index, *weights, *reference;
} Case;

static char *
metadata (MoeCheckpoint *ck, const char *key)
{
  const char *v = moe_checkpoint_get_metadata_value (ck, key);
  g_assert_nonnull (v);
  /* transformers wrote some values JSON-quoted */
  return g_strdelimit (g_strdup (v), "\"", ' ');
}

/* A boolean the fixture's metadata may leave out (then @fallback). */
static gboolean
metadata_bool (MoeCheckpoint *ck, const char *key, gboolean fallback)
{
  g_autofree char *v = NULL;

  if (moe_checkpoint_get_metadata_value (ck, key) == NULL)
    return fallback;
  v = metadata (ck, key);
  return g_str_equal (g_strstrip (v), "true");
}

/* A fixture tensor in @dtype (float tensors only), on @device (NULL: CPU). */
static MoeTensor *
tensor (MoeCheckpoint *ck, const char *name, MoeDType dtype, MoeDevice *device)
{
  g_autoptr(GError) error = NULL;
  g_autoptr(MoeTensor) t = moe_checkpoint_get_tensor (ck, name, &error);
  g_autoptr(MoeTensor) typed = NULL;
  MoeTensor *out;

  g_assert_no_error (error);
  if (!moe_dtype_is_float (moe_tensor_get_dtype (t)))
    typed = g_steal_pointer (&t);
  else
    typed = moe_tensor_to_dtype (t, dtype, &error);
  g_assert_no_error (error);
  if (device == NULL)
    return g_steal_pointer (&typed);
  out = moe_tensor_to_device (typed, device, &error);
  g_assert_no_error (error);
  return out;
}

/* Loads an experts fixture; with @device the experts, hidden states,
 * index and routing weights live there and the reference stays on the CPU. */
static void
case_load_from (Case *c, const char *dir, const char *name, MoeDType dtype, MoeDevice *device)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *file = g_strconcat (name, ".safetensors", NULL);
  g_autofree char *path = moe_test_data_path (dir, file, NULL);
  g_autoptr(MoeTensor) up = NULL, down = NULL;
  g_autofree char *act = NULL;

  c->ck = moe_checkpoint_open (path, &error);
  g_assert_no_error (error);
  up = tensor (c->ck, "up_weight", dtype, device);
  down = tensor (c->ck, "down_weight", dtype, device);
  c->experts = moe_experts_new (up, down);
  if (device != NULL)
    moe_experts_set_device (c->experts, moe_device_get_name (device));
  act = metadata (c->ck, "act");
  moe_experts_set_activation (c->experts, g_strstrip (act));
  moe_experts_set_has_gate (c->experts, metadata_bool (c->ck, "has_gate", TRUE));
  moe_experts_set_is_transposed (c->experts, metadata_bool (c->ck, "is_transposed", FALSE));
  if (metadata_bool (c->ck, "interleaved_clamped_swiglu", FALSE))
    moe_experts_set_gate_layout (c->experts, MOE_GATE_LAYOUT_INTERLEAVED);
  if (moe_checkpoint_has_tensor (c->ck, "up_bias"))
    {
      g_autoptr(MoeTensor) ub = tensor (c->ck, "up_bias", dtype, device);
      g_autoptr(MoeTensor) db = tensor (c->ck, "down_bias", dtype, device);
      moe_experts_set_up_bias (c->experts, ub);
      moe_experts_set_down_bias (c->experts, db);
    }
  /* quantized experts (tests/data/quant/experts): FP8/FP4 weights and scales */
  if (moe_checkpoint_has_tensor (c->ck, "up_weight_scale_inv"))
    {
      g_autoptr(MoeTensor) us = tensor (c->ck, "up_weight_scale_inv", MOE_DTYPE_F32, device);
      g_autoptr(MoeTensor) ds = tensor (c->ck, "down_weight_scale_inv", MOE_DTYPE_F32, device);
      moe_experts_set_up_weight_scale (c->experts, us);
      moe_experts_set_down_weight_scale (c->experts, ds);
    }
  g_assert_true (moe_experts_validate (c->experts, &error));
  g_assert_no_error (error);

  c->hidden = tensor (c->ck, "hidden_states", dtype, device);
  c->index = tensor (c->ck, "top_k_index", dtype, device);
  c->weights = tensor (c->ck, "top_k_weights", MOE_DTYPE_F32, device);
  /* quantized experts are checked against the dynamic activation scheme */
  c->reference = tensor (c->ck, moe_checkpoint_has_tensor (c->ck, "output_f64") ? "output_f64" : "output_ref_dyn",
                         MOE_DTYPE_F64, NULL);
}

static void
case_clear (Case *c)
{
  g_clear_object (&c->ck);
  g_clear_object (&c->experts);
  g_clear_object (&c->hidden);
  g_clear_object (&c->index);
  g_clear_object (&c->weights);
  g_clear_object (&c->reference);
}

static G_GNUC_UNUSED void
case_load (Case *c, const char *name, MoeDType dtype, MoeDevice *device)
{
  case_load_from (c, "experts", name, dtype, device);
}

/* One forward through @backend; the output has the input's shape, dtype and
 * device. */
static G_GNUC_UNUSED MoeTensor *
experts_run (MoeExperts *experts, const char *backend, MoeTensor *hidden, MoeTensor *index,
             MoeTensor *weights)
{
  g_autoptr(GError) error = NULL;
  MoeTensor *out;

  moe_experts_set_implementation (experts, backend);
  out = moe_experts_forward (experts, hidden, index, weights, &error);
  g_assert_no_error (error);
  g_assert_nonnull (out);
  g_assert_true (moe_tensor_has_shape (out, moe_tensor_get_shape (hidden, NULL), 2));
  g_assert_cmpint (moe_tensor_get_dtype (out), ==, moe_tensor_get_dtype (hidden));
  g_assert_true (moe_tensor_get_device (out) == moe_tensor_get_device (hidden));
  return out;
}

static G_GNUC_UNUSED MoeTensor *
case_run (Case *c, const char *backend)
{
  return experts_run (c->experts, backend, c->hidden, c->index, c->weights);
}

/* Every backend of @backends (NULL-terminated) against the case's reference
 * within @tolerance; returns their outputs. */
static G_GNUC_UNUSED GPtrArray *
case_check_backends (Case *c, const char * const *backends, const char *label, double tolerance)
{
  GPtrArray *outs = g_ptr_array_new_with_free_func (g_object_unref);

  for (guint i = 0; backends[i] != NULL; i++)
    {
      MoeTensor *out = case_run (c, backends[i]);
      double err = moe_test_rel_error (out, c->reference);
      g_test_message ("%s %s %s: rel err %.3g", label, moe_dtype_get_name (moe_tensor_get_dtype (c->hidden)),
                      backends[i], err);
      g_assert_cmpfloat (err, <=, tolerance);
      g_ptr_array_add (outs, out);
    }
  return outs;
}
