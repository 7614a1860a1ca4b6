/* moe-plugin.h: the API for plugin authors (not part of the introspected API)
 *
 * A plugin is a GModule `libmoe-<module>.so` beside a `<name>.plugin` keyfile:
 *
 * |[
 * [Moe Plugin]
 * Module=foo
 * Name=foo
 * Kind=experts-backend
 * Type=FooBackend
 * Abi=1
 * ]|
 *
 * and one source file says `MOE_PLUGIN_DEFINE (foo, foo_plugin_init)`.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#pragma once

#include <libmoe.h>
#include <gmodule.h>

G_BEGIN_DECLS

typedef struct _MoePluginDesc MoePluginDesc;

/**
 * MoePluginDesc: (skip)
 * @abi_version: %MOE_PLUGIN_ABI_VERSION the plugin was built with
 * @major_version: libmoe's major version the plugin was built against
 * @minor_version: libmoe's minor version the plugin was built against
 * @module_name: the module name; must equal the keyfile's `Module=`
 * @init: registers the plugin's types; returns %FALSE with @error set on
 *   failure. It runs under the registry's lock: it must not call the
 *   registry, and neither may the plugin type's instance init.
 *
 * What a plugin's entry symbol `moe_plugin_<module>_get_desc()` returns.
 */
struct _MoePluginDesc
{
  guint32     abi_version;
  guint16     major_version;
  guint16     minor_version;
  const char *module_name;
  gboolean  (*init) (GError **error);

  /*< private >*/
  gpointer _reserved[8];
};

/**
 * MOE_PLUGIN_DEFINE: (skip)
 * @module: the module name, as a C identifier (the keyfile's `Module=`)
 * @init_func: a `gboolean (*) (GError **)` that registers the plugin's types
 *
 * Defines the plugin's descriptor and its exported entry symbol.
 */
#define MOE_PLUGIN_DEFINE(module, init_func)                                   \
  G_MODULE_EXPORT const MoePluginDesc *G_PASTE (G_PASTE (moe_plugin_, module), _get_desc) (void); \
  G_MODULE_EXPORT const MoePluginDesc *                                         \
  G_PASTE (G_PASTE (moe_plugin_, module), _get_desc) (void)                     \
  {                                                                             \
    static const MoePluginDesc desc = {                                         \
      MOE_PLUGIN_ABI_VERSION, MOE_MAJOR_VERSION, MOE_MINOR_VERSION,             \
      G_STRINGIFY (module), init_func, { NULL, }                                \
    };                                                                          \
    return &desc;                                                               \
  }

/* Raw access for backends and devices. Host pointers on the CPU device,
 * device pointers elsewhere. */
MOE_AVAILABLE_IN_ALL
gconstpointer  moe_tensor_get_data          (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
gpointer       moe_tensor_get_mutable_data  (MoeTensor     *self);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_tensor_new_empty         (MoeDevice     *device,
                                             MoeDType       dtype,
                                             const gint64  *shape,
                                             guint          n_dims,
                                             GError       **error);

/* Experts on devices other than the CPU: a backend hands its schedule to
 * the device, which owns the kernels (plugins/cuda for "cuda"). */
MOE_AVAILABLE_IN_ALL
void           moe_experts_backend_class_set_device_schedule (MoeExpertsBackendClass *klass,
                                                              MoeExpertsSchedule      schedule);
MOE_AVAILABLE_IN_ALL
gboolean       moe_device_supports_experts  (MoeDevice          *self,
                                             MoeExpertsSchedule  schedule,
                                             MoeExperts         *experts,
                                             GError            **error);
MOE_AVAILABLE_IN_ALL
MoeTensor     *moe_device_run_experts       (MoeDevice          *self,
                                             MoeExpertsSchedule  schedule,
                                             MoeExperts         *experts,
                                             MoeTensor          *hidden_states,
                                             MoeTensor          *top_k_index,
                                             MoeTensor          *top_k_weights,
                                             GError            **error);

/* Per-experts state a backend keeps between forwards (repacked weights…);
 * freed with the experts object. */
MOE_AVAILABLE_IN_ALL
gpointer       moe_experts_get_backend_data (MoeExperts    *self,
                                             MoeExpertsBackend *backend);
MOE_AVAILABLE_IN_ALL
void           moe_experts_set_backend_data (MoeExperts    *self,
                                             MoeExpertsBackend *backend,
                                             gpointer       data,
                                             GDestroyNotify destroy);

/* The CUDA toolkit, for backends whose kernels are compiled just in time
 * (deepgemm): found on the host and run as a program, so that libmoe itself
 * needs neither CUDA headers nor libraries. */

/**
 * MoeCudaToolkit: (skip)
 * @home: the toolkit's root directory
 * @nvcc: `home/bin/nvcc`
 * @major: the toolkit's CUDA major version
 * @minor: the toolkit's CUDA minor version
 *
 * A CUDA toolkit with nvcc, as [func@cuda_toolkit_find] finds it. Start
 * from a zeroed struct and free the strings with
 * [func@cuda_toolkit_clear]; `g_auto(MoeCudaToolkit) tk = { 0, };` does both.
 */
typedef struct
{
  char  *home;
  char  *nvcc;
  guint  major;
  guint  minor;
} MoeCudaToolkit;

MOE_AVAILABLE_IN_ALL
gboolean       moe_cuda_toolkit_find        (MoeCudaToolkit       *toolkit,
                                             GError              **error);
MOE_AVAILABLE_IN_ALL
void           moe_cuda_toolkit_clear       (MoeCudaToolkit       *toolkit);
MOE_AVAILABLE_IN_ALL
gboolean       moe_cuda_toolkit_require     (const MoeCudaToolkit *toolkit,
                                             guint                 major,
                                             guint                 minor,
                                             const char           *what,
                                             GError              **error);
MOE_AVAILABLE_IN_ALL
GBytes        *moe_cuda_jit_compile         (const MoeCudaToolkit *toolkit,
                                             const char           *source,
                                             const char * const   *nvcc_args,
                                             GError              **error);

G_DEFINE_AUTO_CLEANUP_CLEAR_FUNC (MoeCudaToolkit, moe_cuda_toolkit_clear)

G_END_DECLS
