/* moe-tensor.h: an n-dimensional buffer on a device
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#if !defined(LIBMOE_INSIDE) && !defined(MOE_COMPILATION)
# error "Only <libmoe.h> can be included directly."
#endif

#include <glib-object.h>

#include "moe-types.h"

G_BEGIN_DECLS

/**
 * MOE_TENSOR_MAX_DIMS:
 *
 * The largest number of dimensions a [class@Tensor] may have.
 */
#define MOE_TENSOR_MAX_DIMS 8

#define MOE_TYPE_TENSOR (moe_tensor_get_type ())

MOE_AVAILABLE_IN_ALL
G_DECLARE_FINAL_TYPE (MoeTensor, moe_tensor, MOE, TENSOR, GObject)

MOE_AVAILABLE_IN_ALL
MoeTensor      *moe_tensor_new_from_bytes  (MoeDType       dtype,
                                            const gint64  *shape,
                                            guint          n_dims,
                                            GBytes        *data,
                                            GError       **error);
MOE_AVAILABLE_IN_ALL
MoeTensor      *moe_tensor_new_zeros       (MoeDType       dtype,
                                            const gint64  *shape,
                                            guint          n_dims,
                                            GError       **error);
MOE_AVAILABLE_IN_ALL
MoeDType        moe_tensor_get_dtype       (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
const gint64   *moe_tensor_get_shape       (MoeTensor     *self,
                                            guint         *n_dims);
MOE_AVAILABLE_IN_ALL
guint           moe_tensor_get_n_dims      (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
gint64          moe_tensor_get_dim         (MoeTensor     *self,
                                            int            axis);
MOE_AVAILABLE_IN_ALL
gint64          moe_tensor_get_n_elements  (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
gsize           moe_tensor_get_n_bytes     (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
MoeDevice      *moe_tensor_get_device      (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
char           *moe_tensor_to_string       (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
GBytes         *moe_tensor_dup_bytes       (MoeTensor     *self,
                                            GError       **error);
MOE_AVAILABLE_IN_ALL
GBytes         *moe_tensor_to_f32_bytes    (MoeTensor     *self,
                                            GError       **error);
MOE_AVAILABLE_IN_ALL
MoeTensor      *moe_tensor_to_dtype        (MoeTensor     *self,
                                            MoeDType       dtype,
                                            GError       **error);
MOE_AVAILABLE_IN_ALL
MoeTensor      *moe_tensor_to_device       (MoeTensor     *self,
                                            MoeDevice     *device,
                                            GError       **error);
MOE_AVAILABLE_IN_ALL
MoeTensor      *moe_tensor_reshape         (MoeTensor     *self,
                                            const gint64  *shape,
                                            guint          n_dims,
                                            GError       **error);
MOE_AVAILABLE_IN_ALL
gboolean        moe_tensor_has_shape       (MoeTensor     *self,
                                            const gint64  *shape,
                                            guint          n_dims);

G_END_DECLS
