/* moe-tensor.c: an n-dimensional buffer on a device
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <string.h>

#include "moe-private.h"
#include "moe-cpu-kernels.h"

/**
 * MoeTensor:
 *
 * A dense, contiguous, row-major n-dimensional array of one [enum@DType],
 * held on a [class@Device].
 *
 * Tensors on the CPU wrap a [struct@GLib.Bytes], so a tensor read from a
 * memory-mapped checkpoint costs no copy. Tensors are immutable once handed
 * out: operations return new tensors.
 */
struct _MoeTensor
{
  GObject     parent_instance;

  MoeDType    dtype;
  guint       n_dims;
  gint64      shape[MOE_TENSOR_MAX_DIMS];
  gint64      n_elements;

  MoeDevice  *device;
  GBytes     *bytes;        /* CPU storage */
  gpointer    device_data;  /* other devices: owned unless @base is set */
  MoeTensor  *base;         /* a view keeps its owner alive */
};

G_DEFINE_FINAL_TYPE (MoeTensor, moe_tensor, G_TYPE_OBJECT)

static void
moe_tensor_finalize (GObject *object)
{
  MoeTensor *self = MOE_TENSOR (object);

  /* Plain unrefs, no clearing: the last reference may be dropped on another
   * thread than the one that used the tensor, and finalize then only reads. */
  if (self->bytes != NULL)
    g_bytes_unref (self->bytes);
  if (self->device_data != NULL && self->base == NULL)
    MOE_DEVICE_GET_CLASS (self->device)->free (self->device, self->device_data);
  if (self->base != NULL)
    g_object_unref (self->base);
  if (self->device != NULL)
    g_object_unref (self->device);

  G_OBJECT_CLASS (moe_tensor_parent_class)->finalize (object);
}

static void
moe_tensor_class_init (MoeTensorClass *klass)
{
  G_OBJECT_CLASS (klass)->finalize = moe_tensor_finalize;
}

static void
moe_tensor_init (MoeTensor *self)
{
}

gboolean
_moe_shape_n_elements (const gint64 *shape,
                       guint         n_dims,
                       gint64       *n_elements,
                       GError      **error)
{
  gint64 n = 1;

  if (n_dims > MOE_TENSOR_MAX_DIMS)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "A tensor has at most %d dimensions, not %u", MOE_TENSOR_MAX_DIMS, n_dims);
      return FALSE;
    }
  for (guint i = 0; i < n_dims; i++)
    {
      if (shape[i] < 0)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                       "Dimension %u is negative (%" G_GINT64_FORMAT ")", i, shape[i]);
          return FALSE;
        }
      if (shape[i] != 0 && n > G_MAXINT64 / 16 / shape[i])
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                       "The shape's element count overflows");
          return FALSE;
        }
      n *= shape[i];
    }
  *n_elements = n;
  return TRUE;
}

static MoeTensor *
tensor_alloc (MoeDevice     *device,
              MoeDType       dtype,
              const gint64  *shape,
              guint          n_dims,
              GError       **error)
{
  MoeTensor *self;
  gint64 n;

  if ((guint) dtype > MOE_DTYPE_BOOL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH, "Unknown dtype %d", dtype);
      return NULL;
    }
  if (!_moe_shape_n_elements (shape, n_dims, &n, error))
    return NULL;

  self = g_object_new (MOE_TYPE_TENSOR, NULL);
  self->dtype = dtype;
  self->n_dims = n_dims;
  if (n_dims > 0)
    memcpy (self->shape, shape, n_dims * sizeof (gint64));
  self->n_elements = n;
  self->device = g_object_ref (device != NULL ? device : moe_device_get_cpu ());
  return self;
}

/**
 * moe_tensor_new_from_bytes:
 * @dtype: the element type
 * @shape: (array length=n_dims): the dimensions
 * @n_dims: the number of dimensions (0 for a scalar)
 * @data: little-endian, row-major elements; exactly the product of @shape
 *   times the dtype's size bytes
 * @error: return location for a #GError
 *
 * Wraps @data as a tensor on the CPU, without copying it.
 *
 * Returns: (transfer full): a new tensor, or %NULL if @data's size does not
 *   match @shape and @dtype
 */
MoeTensor *
moe_tensor_new_from_bytes (MoeDType       dtype,
                           const gint64  *shape,
                           guint          n_dims,
                           GBytes        *data,
                           GError       **error)
{
  g_autoptr(MoeTensor) self = NULL;
  gsize size;
  gconstpointer ptr;

  g_return_val_if_fail (data != NULL, NULL);
  g_return_val_if_fail (shape != NULL || n_dims == 0, NULL);

  self = tensor_alloc (NULL, dtype, shape, n_dims, error);
  if (self == NULL)
    return NULL;

  ptr = g_bytes_get_data (data, &size);
  if ((gint64) size != self->n_elements * (gint64) moe_dtype_get_size (dtype))
    {
      g_autofree char *desc = moe_tensor_to_string (self);
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "A %s tensor needs %" G_GINT64_FORMAT " bytes, but %" G_GSIZE_FORMAT " were given",
                   desc, self->n_elements * (gint64) moe_dtype_get_size (dtype), size);
      return NULL;
    }

  /* Elements must be naturally aligned for the kernels; safetensors data is
   * usually aligned, and anything else gets one copy here. */
  if (size > 0 && ((guintptr) ptr % MIN (moe_dtype_get_size (dtype), 8)) != 0)
    self->bytes = g_bytes_new (ptr, size);
  else
    self->bytes = g_bytes_ref (data);

  return g_steal_pointer (&self);
}

/**
 * moe_tensor_new_empty: (skip)
 * @device: (nullable): the device, or %NULL for the CPU
 * @dtype: the element type
 * @shape: (array length=n_dims): the dimensions
 * @n_dims: the number of dimensions
 * @error: return location for a #GError
 *
 * Allocates an uninitialised tensor whose data the caller then writes
 * through moe_tensor_get_mutable_data() before handing it out.
 *
 * Returns: (transfer full): a new tensor
 */
MoeTensor *
moe_tensor_new_empty (MoeDevice     *device,
                      MoeDType       dtype,
                      const gint64  *shape,
                      guint          n_dims,
                      GError       **error)
{
  g_autoptr(MoeTensor) self = tensor_alloc (device, dtype, shape, n_dims, error);
  gsize size;

  if (self == NULL)
    return NULL;

  size = (gsize) self->n_elements * moe_dtype_get_size (dtype);
  if (moe_device_is_cpu (self->device))
    {
      gpointer mem = g_try_malloc (MAX (size, 1));
      if (mem == NULL)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY,
                       "Could not allocate %" G_GSIZE_FORMAT " bytes for a tensor", size);
          return NULL;
        }
      self->bytes = g_bytes_new_take (mem, size);
    }
  else
    {
      self->device_data = MOE_DEVICE_GET_CLASS (self->device)->alloc (self->device, MAX (size, 1), error);
      if (self->device_data == NULL)
        return NULL;
    }
  return g_steal_pointer (&self);
}

/**
 * moe_tensor_new_zeros:
 * @dtype: the element type
 * @shape: (array length=n_dims): the dimensions
 * @n_dims: the number of dimensions
 * @error: return location for a #GError
 *
 * Returns: (transfer full): a new CPU tensor filled with zeros
 */
MoeTensor *
moe_tensor_new_zeros (MoeDType       dtype,
                      const gint64  *shape,
                      guint          n_dims,
                      GError       **error)
{
  MoeTensor *self = moe_tensor_new_empty (NULL, dtype, shape, n_dims, error);

  if (self != NULL)
    memset (moe_tensor_get_mutable_data (self), 0, moe_tensor_get_n_bytes (self));
  return self;
}

/**
 * moe_tensor_get_data: (skip)
 * @self: a tensor
 *
 * Returns: the first element: a host pointer on the CPU, a device pointer elsewhere
 */
gconstpointer
moe_tensor_get_data (MoeTensor *self)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);

  if (self->bytes != NULL)
    return g_bytes_get_data (self->bytes, NULL);
  return self->device_data;
}

/**
 * moe_tensor_get_mutable_data: (skip)
 * @self: a tensor made by moe_tensor_new_empty()
 *
 * Returns: the first element, writable. Only the code that created the
 *   tensor may write to it, and only before handing it out.
 */
gpointer
moe_tensor_get_mutable_data (MoeTensor *self)
{
  return (gpointer) moe_tensor_get_data (self);
}

/**
 * moe_tensor_get_dtype:
 * @self: a tensor
 *
 * Returns: the element type
 */
MoeDType
moe_tensor_get_dtype (MoeTensor *self)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), MOE_DTYPE_F32);
  return self->dtype;
}

/**
 * moe_tensor_get_shape:
 * @self: a tensor
 * @n_dims: (out) (optional): the number of dimensions
 *
 * Returns: (array length=n_dims) (transfer none): the dimensions
 */
const gint64 *
moe_tensor_get_shape (MoeTensor *self,
                      guint     *n_dims)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);
  if (n_dims != NULL)
    *n_dims = self->n_dims;
  return self->shape;
}

/**
 * moe_tensor_get_n_dims:
 * @self: a tensor
 *
 * Returns: the number of dimensions
 */
guint
moe_tensor_get_n_dims (MoeTensor *self)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), 0);
  return self->n_dims;
}

/**
 * moe_tensor_get_dim:
 * @self: a tensor
 * @axis: an axis; negative counts from the end
 *
 * Returns: the size of @axis, or -1 if there is no such axis
 */
gint64
moe_tensor_get_dim (MoeTensor *self,
                    int        axis)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), -1);
  if (axis < 0)
    axis += (int) self->n_dims;
  if (axis < 0 || axis >= (int) self->n_dims)
    return -1;
  return self->shape[axis];
}

/**
 * moe_tensor_get_n_elements:
 * @self: a tensor
 *
 * Returns: the number of elements
 */
gint64
moe_tensor_get_n_elements (MoeTensor *self)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), 0);
  return self->n_elements;
}

/**
 * moe_tensor_get_n_bytes:
 * @self: a tensor
 *
 * Returns: the size of the data in bytes
 */
gsize
moe_tensor_get_n_bytes (MoeTensor *self)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), 0);
  return (gsize) self->n_elements * moe_dtype_get_size (self->dtype);
}

/**
 * moe_tensor_get_device:
 * @self: a tensor
 *
 * Returns: (transfer none): the device holding the data
 */
MoeDevice *
moe_tensor_get_device (MoeTensor *self)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);
  return self->device;
}

/**
 * moe_tensor_has_shape:
 * @self: a tensor
 * @shape: (array length=n_dims): dimensions; -1 matches any size
 * @n_dims: the number of dimensions
 *
 * Returns: %TRUE if the tensor has exactly these dimensions
 */
gboolean
moe_tensor_has_shape (MoeTensor    *self,
                      const gint64 *shape,
                      guint         n_dims)
{
  g_return_val_if_fail (MOE_IS_TENSOR (self), FALSE);
  if (self->n_dims != n_dims)
    return FALSE;
  for (guint i = 0; i < n_dims; i++)
    if (shape[i] >= 0 && shape[i] != self->shape[i])
      return FALSE;
  return TRUE;
}

/**
 * moe_tensor_to_string:
 * @self: a tensor
 *
 * Returns: (transfer full): a description such as `F32[18, 64]@cpu`
 */
char *
moe_tensor_to_string (MoeTensor *self)
{
  GString *s;

  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);

  s = g_string_new (moe_dtype_get_name (self->dtype));
  g_string_append_c (s, '[');
  for (guint i = 0; i < self->n_dims; i++)
    g_string_append_printf (s, "%s%" G_GINT64_FORMAT, i ? ", " : "", self->shape[i]);
  g_string_append_printf (s, "]@%s", moe_device_get_name (self->device));
  return g_string_free (s, FALSE);
}

/**
 * moe_tensor_dup_bytes:
 * @self: a tensor
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the elements in host memory (a copy if the
 *   tensor lives on another device)
 */
GBytes *
moe_tensor_dup_bytes (MoeTensor  *self,
                      GError    **error)
{
  gsize size;
  gpointer host;

  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);

  if (self->bytes != NULL)
    return g_bytes_ref (self->bytes);

  size = moe_tensor_get_n_bytes (self);
  host = g_try_malloc (MAX (size, 1));
  if (host == NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY,
                   "Could not allocate %" G_GSIZE_FORMAT " bytes of host memory", size);
      return NULL;
    }
  if (!MOE_DEVICE_GET_CLASS (self->device)->copy_to_host (self->device, host, self->device_data, size, error))
    {
      g_free (host);
      return NULL;
    }
  return g_bytes_new_take (host, size);
}

/**
 * moe_tensor_to_dtype:
 * @self: a tensor of a float dtype
 * @dtype: F32, F16, BF16 or F64
 * @error: return location for a #GError
 *
 * Converts the elements, rounding to nearest even.
 *
 * Returns: (transfer full): a new CPU tensor (or @self, referenced, if it
 *   already has @dtype and lives on the CPU)
 */
MoeTensor *
moe_tensor_to_dtype (MoeTensor  *self,
                     MoeDType    dtype,
                     GError    **error)
{
  g_autoptr(GBytes) host = NULL;
  MoeTensor *out;

  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);

  if (!moe_dtype_is_float (self->dtype) || !moe_dtype_is_float (dtype))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_DTYPE_MISMATCH,
                   "Can only convert between F32, F16, BF16 and F64, not %s to %s",
                   moe_dtype_get_name (self->dtype), moe_dtype_get_name (dtype));
      return NULL;
    }
  if (dtype == self->dtype && moe_device_is_cpu (self->device))
    return g_object_ref (self);

  host = moe_tensor_dup_bytes (self, error);
  if (host == NULL)
    return NULL;
  out = moe_tensor_new_empty (NULL, dtype, self->shape, self->n_dims, error);
  if (out != NULL)
    {
      /* a checkpoint's weights in another dtype: fresh memory, faulted in
       * from several threads before the one that converts fills it */
      moe_cpu_fault_in (moe_tensor_get_mutable_data (out), moe_tensor_get_n_bytes (out));
      moe_cpu_convert (self->dtype, g_bytes_get_data (host, NULL), dtype,
                       moe_tensor_get_mutable_data (out), (gsize) self->n_elements);
    }
  return out;
}

/**
 * moe_tensor_to_f32_bytes:
 * @self: a tensor of a float dtype
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the elements as little-endian float32, in host memory
 */
GBytes *
moe_tensor_to_f32_bytes (MoeTensor  *self,
                         GError    **error)
{
  g_autoptr(MoeTensor) f32 = moe_tensor_to_dtype (self, MOE_DTYPE_F32, error);

  if (f32 == NULL)
    return NULL;
  return g_bytes_ref (f32->bytes);
}

/**
 * moe_tensor_to_device:
 * @self: a tensor
 * @device: the target device
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the tensor on @device (@self, referenced, if it
 *   is already there)
 */
MoeTensor *
moe_tensor_to_device (MoeTensor  *self,
                      MoeDevice  *device,
                      GError    **error)
{
  g_autoptr(GBytes) host = NULL;
  g_autoptr(MoeTensor) out = NULL;

  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);
  g_return_val_if_fail (MOE_IS_DEVICE (device), NULL);

  if (device == self->device)
    return g_object_ref (self);

  if (!moe_device_is_cpu (self->device) || moe_device_is_cpu (device))
    {
      host = moe_tensor_dup_bytes (self, error);
      if (host == NULL)
        return NULL;
      if (moe_device_is_cpu (device))
        return moe_tensor_new_from_bytes (self->dtype, self->shape, self->n_dims, host, error);
    }

  out = moe_tensor_new_empty (device, self->dtype, self->shape, self->n_dims, error);
  if (out == NULL)
    return NULL;
  /* from host memory (a mapped checkpoint, say) straight to the device */
  if (!MOE_DEVICE_GET_CLASS (device)->copy_from_host (device, out->device_data,
                                                      host ? g_bytes_get_data (host, NULL) : moe_tensor_get_data (self),
                                                      moe_tensor_get_n_bytes (self), error))
    return NULL;
  return g_steal_pointer (&out);
}

/**
 * moe_tensor_reshape:
 * @self: a tensor
 * @shape: (array length=n_dims): the new dimensions
 * @n_dims: the number of dimensions
 * @error: return location for a #GError
 *
 * Returns: (transfer full): a view of the same data with another shape of
 *   the same element count
 */
MoeTensor *
moe_tensor_reshape (MoeTensor     *self,
                    const gint64  *shape,
                    guint          n_dims,
                    GError       **error)
{
  g_autoptr(MoeTensor) out = NULL;

  g_return_val_if_fail (MOE_IS_TENSOR (self), NULL);

  out = tensor_alloc (self->device, self->dtype, shape, n_dims, error);
  if (out == NULL)
    return NULL;
  if (out->n_elements != self->n_elements)
    {
      g_autofree char *from = moe_tensor_to_string (self);
      g_set_error (error, MOE_ERROR, MOE_ERROR_SHAPE_MISMATCH,
                   "Cannot reshape %s to %" G_GINT64_FORMAT " elements", from, out->n_elements);
      return NULL;
    }
  if (self->bytes != NULL)
    out->bytes = g_bytes_ref (self->bytes);
  else
    {
      out->device_data = self->device_data;
      out->base = g_object_ref (self->base != NULL ? self->base : self);
    }
  return g_steal_pointer (&out);
}
