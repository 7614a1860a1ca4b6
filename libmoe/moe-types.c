/* moe-types.c: dtypes and the error domain
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include "moe-types.h"
#include "moe-error.h"

G_DEFINE_QUARK (moe-error-quark, moe_error)

static const struct {
  const char *name;
  gsize size;
  gboolean is_float;
} dtypes[] = {
  [MOE_DTYPE_F32]    = { "F32", 4, TRUE },
  [MOE_DTYPE_F16]    = { "F16", 2, TRUE },
  [MOE_DTYPE_BF16]   = { "BF16", 2, TRUE },
  [MOE_DTYPE_F64]    = { "F64", 8, TRUE },
  [MOE_DTYPE_F8E4M3] = { "F8_E4M3", 1, FALSE },
  [MOE_DTYPE_E8M0]   = { "F8_E8M0", 1, FALSE },
  [MOE_DTYPE_I8]     = { "I8", 1, FALSE },
  [MOE_DTYPE_U8]     = { "U8", 1, FALSE },
  [MOE_DTYPE_I16]    = { "I16", 2, FALSE },
  [MOE_DTYPE_I32]    = { "I32", 4, FALSE },
  [MOE_DTYPE_I64]    = { "I64", 8, FALSE },
  [MOE_DTYPE_BOOL]   = { "BOOL", 1, FALSE },
};

/**
 * moe_dtype_get_size:
 * @dtype: a dtype
 *
 * Returns: the size of one element in bytes
 */
gsize
moe_dtype_get_size (MoeDType dtype)
{
  g_return_val_if_fail ((guint) dtype < G_N_ELEMENTS (dtypes), 0);
  return dtypes[dtype].size;
}

/**
 * moe_dtype_get_name:
 * @dtype: a dtype
 *
 * Returns: the dtype's safetensors name ("F32", "BF16", "F8_E4M3"…)
 */
const char *
moe_dtype_get_name (MoeDType dtype)
{
  g_return_val_if_fail ((guint) dtype < G_N_ELEMENTS (dtypes), NULL);
  return dtypes[dtype].name;
}

/**
 * moe_dtype_is_float:
 * @dtype: a dtype
 *
 * Returns: %TRUE for F32, F16, BF16 and F64, the dtypes activations can have
 */
gboolean
moe_dtype_is_float (MoeDType dtype)
{
  g_return_val_if_fail ((guint) dtype < G_N_ELEMENTS (dtypes), FALSE);
  return dtypes[dtype].is_float;
}

/**
 * moe_dtype_from_name:
 * @name: a safetensors dtype name ("F32"…) or a torch-style name
 *   ("float32", "bfloat16", "float16"…)
 * @dtype: (out): the dtype
 *
 * Returns: %TRUE if @name names a dtype
 */
gboolean
moe_dtype_from_name (const char *name,
                     MoeDType   *dtype)
{
  static const struct { const char *alias; MoeDType dtype; } aliases[] = {
    { "float32", MOE_DTYPE_F32 }, { "f32", MOE_DTYPE_F32 }, { "float", MOE_DTYPE_F32 },
    { "float16", MOE_DTYPE_F16 }, { "f16", MOE_DTYPE_F16 }, { "half", MOE_DTYPE_F16 },
    { "bfloat16", MOE_DTYPE_BF16 }, { "bf16", MOE_DTYPE_BF16 },
    { "float64", MOE_DTYPE_F64 }, { "f64", MOE_DTYPE_F64 },
    { "float8_e4m3fn", MOE_DTYPE_F8E4M3 }, { "f8e4m3", MOE_DTYPE_F8E4M3 },
    { "float8_e8m0fnu", MOE_DTYPE_E8M0 }, { "e8m0", MOE_DTYPE_E8M0 },
    { "int8", MOE_DTYPE_I8 }, { "uint8", MOE_DTYPE_U8 }, { "int16", MOE_DTYPE_I16 },
    { "int32", MOE_DTYPE_I32 }, { "int64", MOE_DTYPE_I64 }, { "bool", MOE_DTYPE_BOOL },
  };

  g_return_val_if_fail (dtype != NULL, FALSE);

  if (name == NULL)
    return FALSE;
  for (guint i = 0; i < G_N_ELEMENTS (dtypes); i++)
    if (g_str_equal (name, dtypes[i].name))
      {
        *dtype = (MoeDType) i;
        return TRUE;
      }
  for (guint i = 0; i < G_N_ELEMENTS (aliases); i++)
    if (g_ascii_strcasecmp (name, aliases[i].alias) == 0)
      {
        *dtype = aliases[i].dtype;
        return TRUE;
      }
  return FALSE;
}
